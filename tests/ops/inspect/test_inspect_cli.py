"""``ckpt inspect`` end to end: human output, the JSON schema, errors and start-up cost."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.conftest import Golden, run_cli
from tests.helpers.makers import tiny_state_dict, training_checkpoint

pytestmark = pytest.mark.requires_torch

REQUIRED_KEYS = {"schema_version", "command", "format", "files", "num_tensors", "num_parameters",
                 "total_bytes", "bytes_by_group", "metadata", "warnings"}


def _json(*args: str | Path) -> dict:  # type: ignore[type-arg]
    r = run_cli("inspect", *args, "--json")
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)  # type: ignore[no-any-return]


def test_human_summary_of_a_training_checkpoint(tmp_path: Path) -> None:
    torch.save(training_checkpoint(), tmp_path / "train.pt")
    r = run_cli("inspect", tmp_path / "train.pt")
    assert r.exit_code == 0, r.stderr
    out = r.stdout
    assert "torch" in out and "step 100, epoch 2, lr 0.001" in out
    assert "optimizer" in out and "model" in out and "Parameters" in out
    assert r.stderr == ""


def test_dtypes_row_counts_elements_of_weights_and_buffers(tmp_path: Path) -> None:
    """``Dtypes`` says its unit and scope, so it may exceed ``Parameters`` without surprise:
    the buffers (running_mean, num_batches_tracked) are elements, not parameters."""
    sd = tiny_state_dict()
    save_file(sd, str(tmp_path / "m.safetensors"))
    r = run_cli("inspect", tmp_path / "m.safetensors")
    assert r.exit_code == 0, r.stderr
    rows = {line.split("  ")[0]: line.split("  ", 1)[1].strip()
            for line in r.stdout.splitlines() if line[:1].isalpha() and "  " in line}
    params = sum(v.numel() for k, v in sd.items() if "running" not in k and "num_b" not in k)
    assert rows["Parameters"] == f"{params:,}"
    assert rows["Dtypes"] == (f"F32 {params + 8} (100%), I64 1 (0%) elements of weights and "
                              "buffers")


def test_json_schema_of_a_file(tmp_path: Path) -> None:
    ck = training_checkpoint()
    torch.save(ck, tmp_path / "train.pt")
    doc = _json(tmp_path / "train.pt")
    assert REQUIRED_KEYS <= set(doc)
    assert doc["schema_version"] == 1 and doc["command"] == "inspect"
    assert doc["kind"] == "checkpoint"
    assert doc["num_parameters"] == sum(v.numel() for v in ck["model"].values())
    assert set(doc["bytes_by_group"]) == {"model", "buffer", "optimizer", "other"}
    assert doc["metadata"]["step"] == 100
    assert doc["files"] == [{"path": "train.pt", "bytes": (tmp_path / "train.pt").stat().st_size,
                             "role": "weights", "format": "torch"}]
    assert "tensors" not in doc


def test_tensors_filter_and_sort(tmp_path: Path) -> None:
    save_file(tiny_state_dict(), str(tmp_path / "m.safetensors"))
    doc = _json(tmp_path / "m.safetensors", "--filter", "layers.*.weight", "--sort", "size")
    names = [t["name"] for t in doc["tensors"]]
    assert names == ["layers.0.mlp.fc.weight", "layers.0.attn.q_proj.weight",
                     "layers.0.norm.weight"]
    assert set(doc["tensors"][0]) >= {"name", "dtype", "shape", "bytes", "group"}
    r = run_cli("inspect", tmp_path / "m.safetensors", "--tensors")
    assert "layers.0.norm.running_mean" in r.stdout and "buffer" in r.stdout


def test_tree(tmp_path: Path) -> None:
    save_file(tiny_state_dict(), str(tmp_path / "m.safetensors"))
    doc = _json(tmp_path / "m.safetensors", "--tree", "--depth", "2")
    layers = next(c for c in doc["tree"]["children"] if c["name"] == "layers")
    assert layers["tensors"] == 6
    assert [c["name"] for c in layers["children"]] == ["0"]
    assert layers["children"][0]["children"] == []  # depth 2 stops below layers.0
    r = run_cli("inspect", tmp_path / "m.safetensors", "--tree")
    assert "attn" in r.stdout and "mlp" in r.stdout


def _tree_nodes(node: dict) -> list[dict]:  # type: ignore[type-arg]
    out = [node]
    for c in node["children"]:
        out += _tree_nodes(c)
    return out


def _check_tree_adds_up(doc: dict) -> dict:  # type: ignore[type-arg]
    """The tree's root is the summary; each node's leaves plus its children make it up."""
    root = doc["tree"]
    assert root["tensors"] == doc["num_tensors"]
    assert root["parameters"] == doc["num_parameters"]
    assert root["bytes"] == doc["total_bytes"]
    assert root["bytes_by_group"] == doc["bytes_by_group"]
    assert root["tied"] == len(doc["tied_tensors"])
    for n in _tree_nodes(root):
        for key in ("tensors", "parameters", "bytes", "tied"):
            assert sum(c[key] for c in n["children"]) <= n[key], (n["name"], key)
    return root  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", ["step_000300", "step_000400"])
def test_tree_adds_up_to_the_summary(sample_run: Path, name: str) -> None:
    # A torch file (the tie is one storage) and DCP (the tie is found by value), both with
    # optimizer state and a buffer: the tree counts as the summary does.
    doc = _json(sample_run / name, "--tree", "--depth", "2")
    root = _check_tree_adds_up(doc)
    assert doc["num_parameters"] == 134_912
    model = next(c for c in root["children"] if c["name"] == "model")
    assert model["parameters"] == doc["num_parameters"]
    assert model["bytes_by_group"]["buffer"] == doc["bytes_by_group"]["buffer"] > 0
    optim = next(c for c in root["children"] if c["name"] != "model")
    assert optim["parameters"] == 0
    assert optim["bytes"] == optim["bytes_by_group"]["optimizer"] == \
        doc["bytes_by_group"]["optimizer"]
    head = next(c for c in model["children"] if c["name"] == "lm_head")
    assert (head["tensors"], head["parameters"], head["bytes"], head["tied"]) == (1, 0, 0, 1)
    out = run_cli("inspect", sample_run / name, "--tree").stdout
    assert f"{name}  {doc['num_tensors']} tensors, 134.9K params," in out
    assert "lm_head  1 tensor, 1 tied copy (not counted again)" in out
    assert "1 tensors" not in out
    assert "optimizer state" in out


def test_tree_of_a_transformers_model_with_tied_embeddings(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    from tests.conftest import third_party_quiet

    with third_party_quiet():
        model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50,
                                           n_positions=16))
    torch.save(model.state_dict(), tmp_path / "gpt2.pt")
    doc = _json(tmp_path / "gpt2.pt", "--tree")
    root = _check_tree_adds_up(doc)
    assert root["parameters"] == model.num_parameters()  # the tied head once
    head = next(c for c in root["children"] if c["name"] == "lm_head")
    assert (head["parameters"], head["tied"]) == (0, 1)
    body = next(c for c in root["children"] if c["name"] == "transformer")
    assert body["parameters"] == model.num_parameters()


def test_run_directory(sample_run: Path) -> None:
    doc = _json(sample_run)
    assert doc["kind"] == "run"
    steps = [c["step"] for c in doc["checkpoints"]]
    assert steps == [100, 200, 300, 400]
    keys = {"path", "step", "format", "bytes", "complete"}
    assert all(set(c) >= keys for c in doc["checkpoints"])
    assert doc["latest"] == "step_000400" and doc["described"] == "step_000400"
    assert doc["format"] == "dcp" and doc["metadata"]["step"] == 400
    r = run_cli("inspect", sample_run)
    assert "step_000300" in r.stdout and "complete, latest" in r.stdout


def test_hf_export_and_dcp_of_the_sample(sample_run: Path) -> None:
    doc = _json(sample_run / "export")
    assert doc["format"] == "hf-index" and doc["warnings"] == []
    dcp = _json(sample_run / "step_000400")
    assert dcp["layout"]["world_size"] == 4
    # The export drops the tied lm_head (one tensor less), DCP writes it as a second tensor
    # and the torch file as a second name of one storage: one model, one parameter count.
    torch_doc = _json(sample_run / "step_000300")
    assert dcp["num_tensors"] > doc["num_tensors"]
    assert dcp["num_parameters"] == doc["num_parameters"] == torch_doc["num_parameters"]
    tie = {"name": "model.lm_head.weight", "tied_to": "model.wte.weight",
           "counted_twice": False}
    assert dcp["tied_tensors"] == [{**tie, "tie": "values"}]
    assert torch_doc["tied_tensors"] == [{**tie, "tie": "storage"}]
    assert doc["tied_tensors"] == []
    assert "model.lm_head.weight = model.wte.weight" in run_cli(
        "inspect", sample_run / "step_000400").stdout


@pytest.mark.parametrize("content,fragment", [
    (b"", "empty file"),
    (b"\x00" * 100, "unrecognised file"),
    (b"PK\x03\x04 this is not a zip", "no zip central directory"),
    (b"not a checkpoint at all", "unrecognised file"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, content: bytes, fragment: str) -> None:
    p = tmp_path / "bad.pt"
    p.write_bytes(content)
    r = run_cli("inspect", p)
    assert r.exit_code == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert str(p) in lines[0] and fragment in lines[0]
    assert "Traceback" not in r.stderr and r.stdout == ""


def test_missing_and_truncated(tmp_path: Path) -> None:
    r = run_cli("inspect", tmp_path / "nope.safetensors")
    assert r.exit_code == 2 and "no such file or directory" in r.stderr
    p = tmp_path / "t.pt"
    torch.save(training_checkpoint(), p)
    p.write_bytes(p.read_bytes()[:-100])
    r = run_cli("inspect", p)
    assert r.exit_code == 2 and "truncated" in r.stderr and "Traceback" not in r.stderr


def test_empty_directory_and_unknown_format_option(tmp_path: Path) -> None:
    r = run_cli("inspect", tmp_path)
    assert r.exit_code == 2 and "unrecognised directory" in r.stderr
    save_file(tiny_state_dict(), str(tmp_path / "m.safetensors"))
    r = run_cli("inspect", tmp_path / "m.safetensors", "--input-format", "nope")
    assert r.exit_code == 2 and "unknown format 'nope'" in r.stderr


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_file(tmp_path: Path) -> None:
    p = tmp_path / "m.safetensors"
    save_file(tiny_state_dict(), str(p))
    p.chmod(0)
    r = run_cli("inspect", p)
    assert r.exit_code == 2 and "Permission denied" in r.stderr


def _imports_torch(*argv: str) -> tuple[bool, str]:
    code = ("import sys, runpy\nsys.argv = ['ckpt', *sys.argv[1:]]\n"
            "try:\n    runpy.run_module('ckpt_cli', run_name='__main__')\n"
            "except SystemExit as e:\n    code = e.code\nelse:\n    code = 0\n"
            "sys.stderr.write('\\nTORCH=%s EXIT=%s' % ('torch' in sys.modules, code))")
    r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                       timeout=60)
    tail = r.stderr.strip().splitlines()[-1]
    return "TORCH=True" in tail, tail


def test_help_and_inspect_do_not_import_torch(tmp_path: Path) -> None:
    save_file(tiny_state_dict(), str(tmp_path / "m.safetensors"))
    torch.save(training_checkpoint(), tmp_path / "t.pt")
    for argv in (["--help"], ["inspect", str(tmp_path / "m.safetensors")],
                 ["inspect", str(tmp_path / "t.pt"), "--json"]):
        imported, tail = _imports_torch(*argv)
        assert not imported, (argv, tail)
        assert "EXIT=0" in tail, (argv, tail)


def test_python_dash_m(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "ckpt_cli", "--version"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("ckpt ")


def test_golden_json(tmp_path: Path, golden: Golden) -> None:
    """The JSON schema is a contract: a byte-exact safetensors file gives byte-exact JSON."""
    path = tmp_path / "golden.safetensors"
    save_file(tiny_state_dict(), str(path), metadata={"format": "pt", "step": "3"})
    r = run_cli("inspect", path, "--json", "--tensors", "--tree")
    assert r.exit_code == 0
    doc = json.loads(r.stdout)
    doc["path"] = "golden.safetensors"
    golden("inspect_safetensors.json", doc)


def test_an_empty_file_in_a_checkpoint_directory_is_called_empty(hf_trainer_dir: Path,
                                                                 tmp_path: Path) -> None:
    # An empty model.safetensors inside checkpoint-4 used to be "not a format ckpt reads;
    # skipped" (and validate called the checkpoint valid): now the words of a lone empty file.
    import shutil

    ckpt = tmp_path / "checkpoint-4"
    shutil.copytree(hf_trainer_dir / "checkpoint-4", ckpt)
    (ckpt / "model.safetensors").write_bytes(b"")
    words = "model.safetensors: empty file (0 bytes)"
    r = run_cli("validate", ckpt)
    assert r.exit_code == 1, r.stdout + r.stderr
    assert words in r.stdout + r.stderr
    assert "not a format ckpt reads" not in r.stdout + r.stderr
    doc = json.loads(run_cli("validate", ckpt, "--json").stdout)
    codes = {(f["severity"], f["code"]) for c in doc["checkpoints"] for f in c["findings"]}
    assert ("error", "empty-file") in codes
    r = run_cli("inspect", ckpt)
    assert words in r.stdout + r.stderr
    assert "not a format ckpt reads" not in r.stdout + r.stderr


def test_ties_among_callback_state_are_counted_not_listed(tmp_path: Path) -> None:
    """A Lightning checkpoint's callback scores share one tensor under long keys: the Tied row
    counts them in a phrase instead of listing ~900 characters of paths (issue 39), and still
    lists a tie that involves a weight."""
    score = torch.tensor(0.5)
    w = torch.randn(4, 4)
    key = "/very/long/path/to/some/checkpoint/epoch=0-step=100.ckpt"
    torch.save({"state_dict": {"layer.weight": w, "head.weight": w},
                "callbacks": {"ModelCheckpoint{monitor=val_loss}": {
                    "best_model_score": score, "current_score": score, "kth_value": score,
                    "best_k_models": {key: score}}},
                "epoch": 1, "global_step": 100}, tmp_path / "last.ckpt")
    r = run_cli("inspect", tmp_path / "last.ckpt")
    assert r.exit_code == 0, r.output
    said = " ".join(r.output.split())
    assert "state_dict.head.weight = state_dict.layer.weight (one storage): counted once" in said
    assert "3 among tensors that are not weights" in said
    assert key not in r.output and "best_model_score" not in r.output
