"""``ckpt diff``: metadata, the human and JSON output, and bad input (errors name the side)."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from ckpt_cli.errors import UnsupportedError
from ckpt_cli.formats import read_index
from ckpt_cli.ops.diff import DiffOptions, diff, diff_indexes
from tests.conftest import Golden, requires_deepspeed, run_cli
from tests.helpers.makers import tiny_state_dict, training_checkpoint
from tests.ops.diff.conftest import _json
from tests.ops.inspect.test_inspect_cli import _imports_torch

pytestmark = pytest.mark.requires_torch


# --- metadata --------------------------------------------------------------------------------

def test_metadata_changes(tmp_path: Path) -> None:
    ck = training_checkpoint(step=100)
    torch.save(ck, tmp_path / "a.pt")
    ck2 = {**ck, "step": 200, "lr": 5e-4, "note": "resumed"}
    torch.save(ck2, tmp_path / "b.pt")
    r = diff(tmp_path / "a.pt", tmp_path / "b.pt")
    assert r.tensors and all(t.status == "identical" for t in r.tensors)
    got = {m.key: (m.a, m.b, m.status) for m in r.metadata}
    assert got == {"step": (100, 200, "changed"), "lr": (1e-3, 5e-4, "changed"),
                   "note": (None, "resumed", "only_in_b")}
    assert r.differences() == ["2 metadata values changed"]
    assert diff(tmp_path / "a.pt", tmp_path / "b.pt", DiffOptions(metadata=False)).equal
    assert run_cli("diff", tmp_path / "a.pt", tmp_path / "b.pt", "--no-metadata").exit_code == 0


def test_lightning_checkpoints(lightning_dir: Path) -> None:
    r = diff(lightning_dir / "epoch=0-step=2.ckpt", lightning_dir / "epoch=0-step=4.ckpt")
    assert {t.name for t in r.tensors} == {"state_dict.net.weight", "state_dict.net.bias"}
    assert all(t.status == "changed" for t in r.tensors)
    keys = {m.key for m in r.metadata_changes}
    assert {"step", "global_step"} <= keys
    # Hyper-parameters are compared (equal here), loop counters only with --all.
    assert not any(k.startswith("hyper_parameters") for k in keys)
    assert not any(k.startswith("loops.") for k in keys)
    r_all = diff(lightning_dir / "epoch=0-step=2.ckpt", lightning_dir / "epoch=0-step=4.ckpt",
                 DiffOptions(all_tensors=True))
    assert any(m.key.startswith("loops.") for m in r_all.metadata_changes)


def test_hf_trainer_checkpoints(hf_trainer_dir: Path) -> None:
    r = diff(hf_trainer_dir / "checkpoint-2", hf_trainer_dir / "checkpoint-4")
    assert r.index_a.flavor == "hf-trainer" and r.excluded_a.get("optimizer", 0) > 0
    assert r.tensors and all(t.group in ("model", "buffer") for t in r.tensors)
    assert {"step", "epoch"} <= {m.key for m in r.metadata_changes}


@requires_deepspeed
def test_deepspeed_fp32_against_bf16_run(ds_dir: Path) -> None:
    a, b = ds_dir / "z2-fp32" / "global_step3", ds_dir / "z2-bf16" / "global_step3"
    r = diff(a, b)
    weights = [t for t in r.tensors if t.dtype_changed]
    assert weights and all((t.dtype_a, t.dtype_b) == ("F32", "BF16") for t in weights)
    assert all(t.tolerance is not None and t.tolerance.source == "dtype:BF16" for t in weights)
    # Optimizer files' scalars (loss scaler, partition counts) are optimizer state: --all only.
    assert r.excluded_a.get("optimizer") and not any("optim_states" in m.key
                                                     for m in r.metadata)
    r_all = diff(a, b, DiffOptions(all_tensors=True))
    assert any("optim_states" in m.key for m in r_all.metadata)


# --- output and errors -----------------------------------------------------------------------

def test_human_tables_top_and_by_module(tmp_path: Path) -> None:
    a = tiny_state_dict(seed=0)
    b = {k: (v * 1.5 if k.startswith("layers.") and v.is_floating_point() else v)
         for k, v in a.items()}
    b["head.weight"] = a["head.weight"] + 1e-3
    save_file(a, str(tmp_path / "a.safetensors"))
    save_file(b, str(tmp_path / "b.safetensors"))
    r = run_cli("diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors", "--top", "2",
                "--by-module", "--depth", "2")
    assert r.exit_code == 1
    out = r.stdout
    table = out[out.index("Changed tensors"):out.index("By module")]
    rows = [ln.split()[0] for ln in table.splitlines()[2:] if ln and not ln.startswith("…")]
    assert len(rows) == 2 and "head.weight" not in rows  # the smallest change is cut by --top
    assert "█" in table and "more (--top 0 shows all)" in table
    modules = out[out.index("By module"):]
    # --top limits this table too: the 2 most changed modules, in model order.
    assert modules.startswith("By module (3; the 2 most changed, in model order)")
    assert "layers.0" in modules and "head" in modules and "embed" not in modules
    assert modules.index("head") < modules.index("layers.0")
    assert "… 1 more (--top 0 shows all)" in modules
    r = run_cli("diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors", "--top", "0",
                "--by-module", "--depth", "2")
    modules = r.stdout[r.stdout.index("By module"):]
    assert modules.startswith("By module (3)\n") and "embed" in modules and "more" not in modules
    doc = _json(tmp_path / "a.safetensors", tmp_path / "b.safetensors", "--by-module",
                "--depth", "2", code=1)
    mods = {m["name"]: m for m in doc["modules"]}
    assert mods["layers.0"]["changed"] == 4 and mods["embed"]["changed"] == 0
    layer = [k for k in a if k.startswith("layers.0.")]
    norm_diff = math.sqrt(sum(float(((a[k] - b[k]).double() ** 2).sum()) for k in layer))
    norm_b = math.sqrt(sum(float((b[k].double() ** 2).sum()) for k in layer))
    assert mods["layers.0"]["rel_l2"] == pytest.approx(norm_diff / norm_b, rel=1e-6)


def test_json_schema(tmp_path: Path) -> None:
    ck = training_checkpoint()
    torch.save(ck, tmp_path / "train.pt")
    save_file({k: v.half() for k, v in ck["model"].items()}, str(tmp_path / "m.safetensors"))
    doc = _json(tmp_path / "train.pt", tmp_path / "m.safetensors")
    assert doc["schema_version"] == 1 and doc["command"] == "diff"
    assert set(doc) >= {"a", "b", "equal", "differences", "scope", "renames", "summary",
                        "only_in_a", "only_in_b", "tensors", "metadata", "options"}
    assert doc["equal"] is True and doc["differences"] == []
    assert doc["a"]["format"] == "torch" and doc["b"]["format"] == "safetensors"
    assert doc["a"]["excluded"] == {"optimizer": 12}
    s = doc["summary"]
    assert s["common"] == 4 and s["within_tolerance"] == 4 and s["dtype_changes"] == 4
    t = doc["tensors"][0]
    assert t["dtype_a"] == "F32" and t["dtype_b"] == "F16" and t["tolerance"] == "dtype:F16"
    assert isinstance(t["rel_l2"], float) and t["elements"] == math.prod(t["shape_a"])


def _significant(v: Any, digits: int = 6) -> Any:
    """Floats rounded to ``digits`` significant digits: norms of float32 blocks are summed by
    BLAS, whose kernel (and so the last bits of a float32 sum) varies between machines."""
    if isinstance(v, float) and math.isfinite(v) and v != 0.0:
        return float(f"{v:.{digits}g}")
    if isinstance(v, dict):
        return {k: _significant(x, digits) for k, x in v.items()}
    if isinstance(v, list):
        return [_significant(x, digits) for x in v]
    return v


def test_golden_json(tmp_path: Path, golden: Golden) -> None:
    """The diff JSON is a contract: byte-exact inputs give byte-exact output."""
    a = tiny_state_dict(seed=0)
    b = {**a, "head.weight": a["head.weight"] * 1.01, "extra.bias": torch.zeros(3)}
    del b["layers.0.norm.running_mean"]
    save_file(a, str(tmp_path / "a.safetensors"), metadata={"step": "3"})
    save_file({k: v.contiguous() for k, v in b.items()}, str(tmp_path / "b.safetensors"),
              metadata={"step": "4"})
    doc = _json(tmp_path / "a.safetensors", tmp_path / "b.safetensors", "--by-module", code=1)
    doc["a"]["path"], doc["b"]["path"] = "a.safetensors", "b.safetensors"
    golden("diff_safetensors.json", doc, _significant)


@pytest.mark.parametrize("side", ["A", "B"])
@pytest.mark.parametrize("content,fragment", [
    (b"", "empty file"),
    (b"PK\x03\x04 this is not a zip", "no zip central directory"),
    (b"not a checkpoint at all", "unrecognised file"),
])
def test_bad_input_names_the_side(tmp_path: Path, side: str, content: bytes,
                                  fragment: str) -> None:
    good = tmp_path / "good.safetensors"
    save_file(tiny_state_dict(), str(good))
    bad = tmp_path / "bad.pt"
    bad.write_bytes(content)
    args = (bad, good) if side == "A" else (good, bad)
    r = run_cli("diff", *args)
    assert r.exit_code == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"ckpt: error: {side}: {bad}") and fragment in lines[0]


def test_missing_and_truncated_data(tmp_path: Path) -> None:
    good = tmp_path / "good.safetensors"
    save_file(tiny_state_dict(), str(good))
    r = run_cli("diff", good, tmp_path / "nope.pt")
    assert r.exit_code == 2 and "ckpt: error: B:" in r.stderr and "no such file" in r.stderr
    # A header that is whole but tensor bytes that are not: found while reading values.
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(good.read_bytes()[:-64])
    r = run_cli("diff", cut, good, "--quiet")
    assert r.exit_code == 2 and "Traceback" not in r.stderr
    assert f"ckpt: error: A: {cut}" in r.stderr and "truncated" in r.stderr
    # Structure alone needs no data, so it still works.
    assert run_cli("diff", cut, good, "--structure-only", "--quiet").exit_code == 0
    r = run_cli("diff", good, good, "--input-format-b", "nope")
    assert r.exit_code == 2 and "B: unknown format 'nope'" in r.stderr


def test_run_directory_is_refused_with_a_hint(sample_copy: Path) -> None:
    sample_run = sample_copy
    (sample_run / "latest").unlink()  # with it, diff reads the checkpoint it names
    r = run_cli("diff", sample_run / "export", sample_run)
    assert r.exit_code == 2 and "Traceback" not in r.stderr
    first, hint = r.stderr.strip().splitlines()
    assert first == f"ckpt: error: B: {sample_run}: a run directory (4 complete checkpoints), " \
                    "not a checkpoint"
    assert hint.startswith("hint: name one of its checkpoints") and "step_000400" in hint


def test_diff_indexes_api_for_other_commands(tmp_path: Path) -> None:
    sd = tiny_state_dict()
    torch.save({"model": sd}, tmp_path / "a.pt")
    save_file(sd, str(tmp_path / "b.safetensors"))
    progress: list[tuple[str, int, int]] = []
    r = diff_indexes(read_index(tmp_path / "a.pt"), read_index(tmp_path / "b.safetensors"),
                     DiffOptions(block=7), progress=lambda *a: progress.append(a))
    assert r.equal
    total = 2 * sum(v.numel() * v.element_size() for v in sd.values())
    assert progress[-1] == ("comparing", total, total)
    assert {p for p, _, _ in progress} == {"comparing"}
    assert all(d1 <= d2 for (_, d1, _), (_, d2, _) in itertools.pairwise(progress))


def test_diff_does_not_import_torch(tmp_path: Path) -> None:
    sd = tiny_state_dict()
    torch.save({"model": sd, "step": 1}, tmp_path / "t.pt")
    save_file({k: v.half() if v.is_floating_point() else v for k, v in sd.items()},
              str(tmp_path / "m.safetensors"))
    for argv in (["diff", str(tmp_path / "t.pt"), str(tmp_path / "m.safetensors")],
                 ["diff", str(tmp_path / "m.safetensors"), str(tmp_path / "t.pt"), "--json",
                  "--all", "--by-module"]):
        imported, tail = _imports_torch(*argv)
        assert not imported, (argv, tail)
        assert "EXIT=0" in tail, (argv, tail)


@requires_deepspeed
@pytest.mark.parametrize("cfg", ["z3-fp32", "z3-bf16"])
def test_diff_refuses_zero3_placeholders(ds_dir: Path, tmp_path: Path, cfg: str) -> None:
    # ZeRO-3 model states hold [0]-shaped placeholders (once per rank): compared as stored, a
    # checkpoint differed from its own consolidation, and two ZeRO-3 steps looked equal.
    tag = ds_dir / cfg / "global_step3"
    out = tmp_path / "full.safetensors"
    assert run_cli("consolidate", tag, "-o", out).exit_code == 0
    for side, args in (("A", (tag, out)), ("B", (out, tag))):
        for extra in ((), ("--structure-only",), ("--all",)):
            r = run_cli("diff", *args, *extra)
            assert r.exit_code == 2 and r.stdout == "", r.output
            lines = r.stderr.strip().splitlines()
            assert lines[0].startswith(f"ckpt: error: {side}: {tag}: DeepSpeed ZeRO-3"), r.stderr
            assert len(lines) == 2 and lines[1].startswith("hint: consolidate it first")
            assert f"ckpt consolidate {tag}" in lines[1]
    r = run_cli("diff", tag, ds_dir / "z3-fp32" / "global_step3", "--json")
    err = json.loads(r.stdout)["error"]
    assert r.exit_code == 2 and err["kind"] == "unsupported" and err["side"] == "A"
    # The library API refuses too.
    from ckpt_cli.ops.diff import diff

    with pytest.raises(UnsupportedError, match="ZeRO-3"):
        diff(out, tag)


@requires_deepspeed
@pytest.mark.parametrize("cfg", ["z1-fp32", "z2-fp32", "z2-bf16", "z1-fp32+frozen"])
def test_diff_of_zero12_against_its_consolidation_is_equal(ds_dir: Path, tmp_path: Path,
                                                          cfg: str) -> None:
    # ZeRO 1/2 keep the whole module in the model states: compared as stored, as before.
    tag = ds_dir / cfg / "global_step3"
    out = tmp_path / "full.safetensors"
    assert run_cli("consolidate", tag, "-o", out).exit_code == 0
    r = run_cli("diff", tag, out, "--no-metadata", "--json")
    doc = json.loads(r.stdout)
    assert r.exit_code == 0 and doc["equal"], r.output
    assert doc["summary"]["common"] == 7 and not doc["only_in_a"] and not doc["only_in_b"]


def test_metadata_heading_counts_only_differences(tmp_path: Path) -> None:
    """One-sided values are listed under Metadata but the heading does not call them
    differences (issue 39: "Metadata differences (16)" for 16 values that were not)."""
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    w = {"w": torch.ones(2, 2)}
    torch.save({"model": w, "step": 5, "note": "x"}, a)
    torch.save({"model": w, "step": 6, "extra": 1, "more": 2}, b)
    r = run_cli("diff", a, b)
    assert r.exit_code == 1, r.output
    heading = next(line for line in r.output.splitlines() if line.startswith("Metadata ("))
    assert heading == "Metadata (4: 1 difference; not differences: 3 on one side only)"
