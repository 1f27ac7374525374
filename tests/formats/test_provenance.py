"""What ckpt writes it reads back: the ``ckpt.*`` metadata of its outputs (the step and epoch
they carry over, the ``total_parameters`` of an index) and how ``diff`` treats provenance."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from tests.conftest import run_cli, third_party_quiet

pytestmark = pytest.mark.requires_torch

SAMPLE_PARAMETERS = 134_912  # TinyGPT's parameters: the tied head once, the causal mask not


def _json(*args: str | Path, code: int = 0) -> Any:
    r = run_cli(*args, "--json")
    assert r.exit_code == code, r.output
    return json.loads(r.stdout)


def _index_meta(out: Path) -> dict[str, Any]:
    (index,) = out.glob("*.index.json")
    return json.loads(index.read_text())["metadata"]  # type: ignore[no-any-return]


# Outputs: one safetensors file, safetensors shards with an index, torch shards with an index
# (whose shards have no metadata of their own: the index carries it).
OUTPUTS = [("model.safetensors", ()), ("st", ("--max-shard-size", "150KB")),
           ("pt", ("--max-shard-size", "150KB", "--format", "pt"))]


@pytest.mark.parametrize(("name", "opts"), OUTPUTS, ids=[o[0] for o in OUTPUTS])
def test_consolidated_dcp_reads_back_its_step(sample_run: Path, tmp_path: Path, name: str,
                                              opts: tuple[str, ...]) -> None:
    out = tmp_path / name
    r = run_cli("consolidate", sample_run / "step_000400", "-o", out, *opts)
    assert r.exit_code == 0, r.output
    doc = _json("inspect", out)
    assert (doc["step"], doc["step_source"]) == (400, "metadata")
    assert doc["metadata"]["epoch"] == 2
    assert doc["num_parameters"] == SAMPLE_PARAMETERS
    if out.is_dir():
        # The index's total_parameters is what inspect counts (it was 168,704: the tied
        # head twice and the causal-mask buffer counted as parameters).
        assert _index_meta(out)["total_parameters"] == SAMPLE_PARAMETERS
        assert doc["metadata"]["total_parameters"] == SAMPLE_PARAMETERS
    r = run_cli("validate", out, "--require", "step")
    assert r.exit_code == 0, r.output
    assert "no training step recorded" not in r.output
    # Weights only by design: the dropped optimizer is a note here, not a warning.
    report = _json("validate", out, "--strict")
    assert report["valid"] is True


@pytest.mark.parametrize(("name", "opts"), OUTPUTS, ids=[o[0] for o in OUTPUTS])
def test_converted_torch_checkpoint_reads_back_its_step(sample_run: Path, tmp_path: Path,
                                                        name: str,
                                                        opts: tuple[str, ...]) -> None:
    out = tmp_path / name
    r = run_cli("convert", sample_run / "step_000300" / "checkpoint.pt", "--to", "bf16",
                "-o", out, *opts)
    assert r.exit_code == 0, r.output
    doc = _json("inspect", out)
    assert (doc["step"], doc["step_source"]) == (300, "metadata")
    assert doc["num_parameters"] == SAMPLE_PARAMETERS
    if out.is_dir():
        assert _index_meta(out)["total_parameters"] == SAMPLE_PARAMETERS
    assert run_cli("validate", out, "--require", "step").exit_code == 0


def test_total_parameters_of_a_transformers_model_with_tied_embeddings(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    with third_party_quiet():
        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=300,
                                           n_positions=32))
    torch.save(model.state_dict(), tmp_path / "gpt2.pt")
    for fmt in ("safetensors", "pt"):
        out = tmp_path / fmt
        r = run_cli("convert", tmp_path / "gpt2.pt", "-o", out, "--max-shard-size", "20KB",
                    "--format", fmt)
        assert r.exit_code == 0, r.output
        written = _index_meta(out)["total_parameters"]
        assert written == model.num_parameters() == _json("inspect", out)["num_parameters"]
        # transformers writes the same count into its own index.
        with third_party_quiet():
            model.save_pretrained(tmp_path / f"hf-{fmt}", max_shard_size="20KB",
                                  safe_serialization=fmt == "safetensors")
        assert _index_meta(tmp_path / f"hf-{fmt}")["total_parameters"] == written


def test_source_is_recorded_without_the_directories_above_it(sample_run: Path,
                                                             tmp_path: Path) -> None:
    for src, recorded in ((sample_run / "step_000100", "step_000100"),
                          (sample_run / "step_000300" / "checkpoint.pt", "checkpoint.pt")):
        out = tmp_path / f"{src.name}.safetensors"
        doc = _json("convert", src, "-o", out)
        assert doc["metadata"]["ckpt.source"] == recorded
        with safe_open(str(out), "pt") as f:
            assert f.metadata()["ckpt.source"] == recorded
        # Nothing of the directories above the source is in the file (a file's own directory
        # may be a home directory: alice/checkpoint.pt would name a user).
        assert str(sample_run.parent).encode() not in out.read_bytes()
        if src.is_file():
            assert src.parent.name.encode() not in out.read_bytes()


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_two_conversions_of_the_same_weights_are_equal(sample_run: Path, tmp_path: Path,
                                                       fmt: str) -> None:
    src = sample_run / "step_000300"
    copy = tmp_path / "copied" / "step_300_backup"
    shutil.copytree(src, copy)
    outs = []
    for i, source in enumerate((src, src, copy)):
        (tmp_path / f"out{i}").mkdir()
        out = tmp_path / f"out{i}" / "model"
        r = run_cli("convert", source, "-o", out, "--format", fmt, "--max-shard-size", "300KB")
        assert r.exit_code == 0, r.output
        outs.append(out)
    # The same source into two output directories: nothing differs at all.
    doc = _json("diff", outs[0], outs[1])
    assert doc["equal"] is True and doc["metadata"] == [] and doc["provenance_differences"] == []
    # The same weights from a copy elsewhere: only the provenance differs, which is shown,
    # noted, and not a difference.
    doc = _json("diff", outs[0], outs[2])
    assert doc["equal"] is True and doc["differences"] == []
    where = "safetensors_metadata" if fmt == "safetensors" else "index_metadata"
    assert doc["provenance_differences"] == [f"{where}.ckpt.source"]
    assert [(m["key"], m["a"], m["b"], m["provenance"]) for m in doc["metadata"]] == [
        (f"{where}.ckpt.source", "step_000300", "step_300_backup", True)]
    assert doc["summary"]["metadata_changed"] == 0
    r = run_cli("diff", outs[0], outs[2])
    assert r.exit_code == 0, r.output
    text = " ".join(r.stdout.split())  # the summary wraps at the terminal's width
    assert (f"1 provenance key differs (how ckpt made a file; not a difference): "
            f"{where}.ckpt.source") in text
    assert f"{where}.ckpt.source (provenance)" in r.stdout
    assert "Result    equal" in r.stdout


def test_a_changed_carried_fact_is_still_a_difference(sample_run: Path, tmp_path: Path) -> None:
    # ckpt.step is what the checkpoint holds, not provenance: the same weights under another
    # step differ (as the canonical step, once).
    src = tmp_path / "step_000300"
    shutil.copytree(sample_run / "step_000300", src)
    ck = torch.load(src / "checkpoint.pt", weights_only=True)
    ck["step"] = 301
    torch.save(ck, src / "checkpoint.pt")
    for name, source in (("a.safetensors", sample_run / "step_000300"), ("b.safetensors", src)):
        assert run_cli("convert", source, "-o", tmp_path / name).exit_code == 0
    doc = _json("diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors", code=1)
    assert [(m["key"], m["a"], m["b"]) for m in doc["metadata"] if not m["provenance"]] == [
        ("step", 300, 301)]
    assert doc["differences"] == ["1 metadata value changed"]
