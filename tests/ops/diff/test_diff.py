"""``ckpt diff`` on files written by the real libraries: formats, names, values, metadata, CLI."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file, save_model

from ckpt_cli.errors import UsageError
from ckpt_cli.ops.diff import DiffOptions, diff
from ckpt_cli.ops.diff.result import DiffResult
from tests.conftest import run_cli, third_party_quiet
from tests.helpers.makers import tiny_state_dict, training_checkpoint
from tests.ops.diff.conftest import _json

pytestmark = pytest.mark.requires_torch


def _by_name(r: DiffResult) -> dict[str, Any]:
    return {t.name: t for t in r.tensors}


# --- formats and layouts ---------------------------------------------------------------------

def test_torch_file_against_safetensors_is_equal(tmp_path: Path) -> None:
    sd = tiny_state_dict()
    torch.save(sd, tmp_path / "a.pt")
    save_file(sd, str(tmp_path / "b.safetensors"))
    r = diff(tmp_path / "a.pt", tmp_path / "b.safetensors")
    assert r.equal and r.renames == [] and not r.only_a and not r.only_b
    assert {t.name for t in r.tensors} == set(sd)
    assert all(t.status == "identical" for t in r.tensors)
    # Integer and float tensors were all read and compared, not skipped.
    compared = sum(t.stats.elements for t in r.tensors if t.stats)
    assert compared == sum(v.numel() for v in sd.values())
    cli = run_cli("diff", tmp_path / "a.pt", tmp_path / "b.safetensors")
    assert cli.exit_code == 0 and "8 identical" in cli.stdout and "equal" in cli.stdout


def test_training_checkpoint_against_inference_file(tmp_path: Path) -> None:
    ck = training_checkpoint()
    torch.save(ck, tmp_path / "train.pt")
    save_file({k: v.contiguous() for k, v in ck["model"].items()},
              str(tmp_path / "model.safetensors"))
    r = diff(tmp_path / "train.pt", tmp_path / "model.safetensors")
    assert r.equal, r.differences()
    assert [(x.side, x.prefix, x.tensors, x.source) for x in r.renames] == [
        ("a", "model.", len(ck["model"]), "auto")]
    assert r.scope == "weights"
    n_opt = sum(1 for s in ck["optimizer"]["state"].values() for _ in s)
    assert r.excluded_a == {"optimizer": n_opt} and r.excluded_b == {}
    # --all compares the optimizer state too, which the inference file does not have.
    r_all = diff(tmp_path / "train.pt", tmp_path / "model.safetensors",
                 DiffOptions(all_tensors=True))
    assert not r_all.equal and len(r_all.only_a) == n_opt
    assert all(o.group == "optimizer" for o in r_all.only_a)
    doc = _json(tmp_path / "train.pt", tmp_path / "model.safetensors")
    assert doc["renames"] == [{"side": "a", "prefix": "model.", "tensors": 4, "source": "auto"}]
    out = run_cli("diff", tmp_path / "train.pt", tmp_path / "model.safetensors").stdout
    assert "stripped 'model.'" in out and "--all-tensors compares them" in out


def test_dcp_against_its_consolidated_file(sample_run: Path, tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with third_party_quiet():
        dcp_to_torch_save(sample_run / "step_000400", tmp_path / "full.pt")
    r = diff(sample_run / "step_000400", tmp_path / "full.pt", DiffOptions(all_tensors=True))
    assert r.equal, r.differences()
    assert r.index_a.format == "dcp" and r.index_b.format == "torch"
    assert len(r.tensors) == len(r.index_a.tensors) == len(r.index_b.tensors)
    assert {t.group for t in r.tensors} >= {"model", "optimizer"}
    assert all(t.status == "identical" for t in r.tensors)
    # A DCP-only fact is listed but is not a difference.
    assert [(m.key, m.status) for m in r.metadata] == [("dcp_version", "only_in_a")]


def test_hf_export_against_the_checkpoint_it_came_from(sample_run: Path) -> None:
    # The export holds the step-400 weights without the lm_head tied to wte.
    r = diff(sample_run / "step_000400", sample_run / "export")
    assert r.equal, r.differences()
    assert [(o.name, o.tied_to, o.tie) for o in r.only_a] == [
        ("lm_head.weight", "wte.weight", "values")]
    assert r.renames[0].prefix == "model." and r.renames[0].side == "a"
    # An older step: same names, every trained weight changed, the tie seen in the storage.
    old = diff(sample_run / "step_000300" / "checkpoint.pt", sample_run / "export")
    assert [(o.name, o.tie) for o in old.only_a] == [("lm_head.weight", "storage")]
    assert not old.equal and old.differences() == [f"{len(old.changed)} tensors changed"]
    assert _by_name(old)["causal_mask"].status == "identical"


def test_hf_sharded_directory_against_single_file(tmp_path: Path) -> None:
    from huggingface_hub import save_torch_state_dict

    sd = tiny_state_dict(seed=3)
    (tmp_path / "sharded").mkdir()
    save_torch_state_dict(sd, tmp_path / "sharded", max_shard_size=600)
    save_file(sd, str(tmp_path / "single.safetensors"))
    r = diff(tmp_path / "sharded", tmp_path / "single.safetensors")
    assert r.index_a.format == "hf-index" and r.index_a.layout["shards"] > 1
    assert r.equal and len(r.tensors) == len(sd)


def test_strided_view_against_contiguous_copy(tmp_path: Path) -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    torch.save({"w": base.t(), "row": base[1]}, tmp_path / "views.pt")
    save_file({"w": base.t().contiguous(), "row": base[1].clone()},
              str(tmp_path / "flat.safetensors"))
    r = diff(tmp_path / "views.pt", tmp_path / "flat.safetensors")
    assert r.index_a.tensors["w"].stride is not None  # really a strided read
    assert r.equal and all(t.status == "identical" for t in r.tensors)


def test_tie_seen_from_either_name(tmp_path: Path) -> None:
    emb = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    torch.save({"wte.weight": emb, "lm_head.weight": emb}, tmp_path / "tied.pt")
    # One export keeps the embedding, another the head: either way nothing is missing.
    save_file({"wte.weight": emb}, str(tmp_path / "wte.safetensors"))
    save_file({"lm_head.weight": emb.clone()}, str(tmp_path / "head.safetensors"))
    for other, missing, kept in (("wte", "lm_head.weight", "wte.weight"),
                                 ("head", "wte.weight", "lm_head.weight")):
        r = diff(tmp_path / "tied.pt", tmp_path / f"{other}.safetensors",
                 DiffOptions(structure_only=True))
        assert [(o.name, o.tied_to, o.tie) for o in r.only_a] == [(missing, kept, "storage")]
        assert r.equal


def test_recorded_tie_from_save_model(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False),
                                torch.nn.Linear(4, 4, bias=False))
    model[1].weight = model[0].weight
    save_model(model, str(tmp_path / "tied.safetensors"))  # drops 1.weight, records it
    save_file({k: v.detach().clone() for k, v in model.state_dict().items()},
              str(tmp_path / "both.safetensors"))
    r = diff(tmp_path / "both.safetensors", tmp_path / "tied.safetensors")
    assert [(o.name, o.tied_to, o.tie) for o in r.only_a] == [("1.weight", "0.weight",
                                                               "recorded")]
    assert r.equal


# --- names -----------------------------------------------------------------------------------

def test_wrapper_prefixes_are_stripped_automatically(tmp_path: Path) -> None:
    sd = tiny_state_dict()
    torch.save({f"module._orig_mod.{k}": v for k, v in sd.items()}, tmp_path / "ddp.pt")
    save_file(sd, str(tmp_path / "plain.safetensors"))
    r = diff(tmp_path / "ddp.pt", tmp_path / "plain.safetensors")
    assert r.equal
    assert [(x.prefix, x.source) for x in r.renames] == [("module.", "auto"),
                                                         ("_orig_mod.", "auto")]
    exact = diff(tmp_path / "ddp.pt", tmp_path / "plain.safetensors",
                 DiffOptions(exact_names=True))
    assert not exact.tensors and len(exact.only_a) == len(exact.only_b) == len(sd)
    given = diff(tmp_path / "ddp.pt", tmp_path / "plain.safetensors",
                 DiffOptions(exact_names=True, strip_prefix=("module.", "_orig_mod.")))
    assert given.equal and {x.source for x in given.renames} == {"option"}
    r2 = run_cli("diff", tmp_path / "ddp.pt", tmp_path / "plain.safetensors", "--exact-names",
                 "--strip-prefix", "module.", "--strip-prefix", "_orig_mod.")
    assert r2.exit_code == 0, r2.stdout


def test_model_prefix_only_stripped_when_it_helps(tmp_path: Path) -> None:
    # A causal-LM file (model.* + lm_head) against a training dict holding it under "model":
    # B's container prefix goes, A's own "model." stays.
    g = torch.Generator().manual_seed(0)
    lm = {"model.layers.0.w": torch.randn(3, 3, generator=g),
          "model.norm.weight": torch.ones(3), "lm_head.weight": torch.randn(5, 3, generator=g)}
    save_file(lm, str(tmp_path / "lm.safetensors"))
    torch.save({"model": lm, "step": 7}, tmp_path / "train.pt")
    r = diff(tmp_path / "lm.safetensors", tmp_path / "train.pt")
    assert [(x.side, x.prefix) for x in r.renames] == [("b", "model.")]
    assert r.equal and {t.name for t in r.tensors} == set(lm)
    # The base model alone (no lm_head) saved under "model": names already match, no rename.
    base = {k.removeprefix("model."): v for k, v in lm.items() if k.startswith("model.")}
    torch.save({"model": base}, tmp_path / "base.pt")
    r2 = diff(tmp_path / "lm.safetensors", tmp_path / "base.pt")
    assert r2.renames == [] and [o.name for o in r2.only_a] == ["lm_head.weight"]


def test_strip_prefix_collision_is_a_usage_error(tmp_path: Path) -> None:
    save_file({"module.w": torch.ones(2), "w": torch.zeros(2)}, str(tmp_path / "a.safetensors"))
    save_file({"w": torch.ones(2)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(UsageError, match="same name"):
        diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors",
             DiffOptions(strip_prefix=("module.",)))
    r = run_cli("diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors",
                "--strip-prefix", "module.")
    assert r.exit_code == 2 and "A's names" in r.stderr and "Traceback" not in r.stderr


# --- values ----------------------------------------------------------------------------------

def test_fp32_against_its_fp16_copy_is_equal_within_fp16_rounding(tmp_path: Path) -> None:
    sd = tiny_state_dict(seed=1)
    sd["tiny"] = torch.tensor([1e-9, -3e-8, 2e-6, 0.1])  # below FP16's normal range
    torch.save(sd, tmp_path / "fp32.pt")
    save_file({k: v.half() if v.is_floating_point() else v for k, v in sd.items()},
              str(tmp_path / "fp16.safetensors"))
    r = diff(tmp_path / "fp32.pt", tmp_path / "fp16.safetensors")
    assert r.equal, r.differences()
    floats = [t for t in r.tensors if t.dtype_a == "F32"]
    assert len(floats) == 8 and all(t.dtype_b == "F16" for t in floats)
    status = {t.name: t.status for t in floats}
    # Ones and zeros survive FP16 exactly; random values and tiny ones are rounded.
    assert status["layers.0.norm.weight"] == status["layers.0.norm.running_mean"] == "identical"
    assert status["embed.weight"] == status["tiny"] == "within_tolerance"
    tol = floats[0].tolerance
    assert tol is not None and tol.source == "dtype:F16" and tol.rtol == 2.0 ** -10
    out = run_cli("diff", tmp_path / "fp32.pt", tmp_path / "fp16.safetensors").stdout
    assert "F32 in A, F16 in B" in out and "within F16 rounding" in out
    # A real change in the FP16 copy is still caught.
    bad = {k: v.half() if v.is_floating_point() else v for k, v in sd.items()}
    bad["head.weight"][0, 0] += 0.5
    save_file(bad, str(tmp_path / "bad.safetensors"))
    r2 = diff(tmp_path / "fp32.pt", tmp_path / "bad.safetensors")
    changed = r2.changed
    assert [t.name for t in changed] == ["head.weight"]
    assert changed[0].stats is not None and changed[0].stats.outside == 1


def test_bf16_copy_and_structure_only(tmp_path: Path) -> None:
    sd = {"w": torch.randn(64, 64, generator=torch.Generator().manual_seed(2))}
    save_file(sd, str(tmp_path / "fp32.safetensors"))
    save_file({"w": sd["w"].bfloat16()}, str(tmp_path / "bf16.safetensors"))
    r = diff(tmp_path / "fp32.safetensors", tmp_path / "bf16.safetensors")
    assert r.equal and r.tensors[0].tolerance is not None
    assert r.tensors[0].tolerance.source == "dtype:BF16"
    # Without values a dtype change cannot be shown harmless: it is a difference.
    s = diff(tmp_path / "fp32.safetensors", tmp_path / "bf16.safetensors",
             DiffOptions(structure_only=True))
    assert not s.equal and s.tensors[0].status == "not_compared" and s.tensors[0].stats is None
    assert s.differences() == ["1 tensor with a different dtype"]


def test_statistics_of_a_known_change(tmp_path: Path) -> None:
    a = torch.ones(1000)
    b = a.clone()
    b[10] = 1.5
    b[20] = 0.0
    save_file({"w": a}, str(tmp_path / "a.safetensors"))
    save_file({"w": b}, str(tmp_path / "b.safetensors"))
    r = diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    (t,) = r.tensors
    s = t.stats
    assert s is not None and t.status == "changed"
    assert s.changed == 2 and s.max_abs == 1.0 and s.mean_abs == pytest.approx(1.5 / 1000)
    # ||a-b|| = sqrt(0.25 + 1); ||a|| = sqrt(1000); ||b|| = sqrt(998 + 2.25)
    assert s.rel_l2 == pytest.approx(math.sqrt(1.25) / math.sqrt(1000.25))
    doc = _json(tmp_path / "a.safetensors", tmp_path / "b.safetensors", code=1)
    (tj,) = doc["tensors"]
    assert tj["elements_changed"] == 2 and tj["max_abs"] == 1.0 and tj["status"] == "changed"
    # Tolerances: --atol 1 accepts both; --rtol 0.6 accepts 1 -> 1.5 (bound 0.9) but not 1 -> 0.
    assert diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors",
                DiffOptions(atol=1.0)).equal
    rr = diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors", DiffOptions(rtol=0.6))
    assert rr.tensors[0].stats is not None and rr.tensors[0].stats.outside == 1
    assert run_cli("diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors",
                   "--atol", "1").exit_code == 0
    assert run_cli("diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors",
                   "--exit-zero").exit_code == 0


def test_tiny_differences_are_not_lost(tmp_path: Path) -> None:
    # Squares of these underflow in float32; the change must still be seen and measured.
    save_file({"w": torch.tensor([1e-30, 2e-30, 0.0])}, str(tmp_path / "a.safetensors"))
    save_file({"w": torch.tensor([1.1e-30, 2e-30, 0.0])}, str(tmp_path / "b.safetensors"))
    (t,) = diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors").tensors
    assert t.status == "changed" and t.stats is not None and t.stats.changed == 1
    assert t.rel_l2 == pytest.approx(0.1e-30 / math.hypot(1.1e-30, 2e-30), rel=1e-5)


def test_nan_and_inf(tmp_path: Path) -> None:
    nan, inf = float("nan"), float("inf")
    save_file({"same": torch.tensor([1.0, nan, inf, -inf]),
               "moved": torch.tensor([1.0, nan, 2.0, inf])}, str(tmp_path / "a.safetensors"))
    save_file({"same": torch.tensor([1.0, nan, inf, -inf]),
               "moved": torch.tensor([1.0, 3.0, nan, -inf])}, str(tmp_path / "b.safetensors"))
    r = diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors", DiffOptions(atol=100.0))
    t = _by_name(r)
    assert t["same"].status == "identical" and t["same"].stats.nonfinite_matched == 3
    moved = t["moved"].stats
    assert t["moved"].status == "changed"  # no tolerance excuses NaN vs a number
    assert moved.nonfinite_mismatches == 3 and moved.changed == 3 and moved.elements == 4
    assert moved.max_abs == 0.0  # the one finite pair is equal
    assert math.isinf(moved.rel_l2)
    doc = _json(tmp_path / "a.safetensors", tmp_path / "b.safetensors", code=1)
    assert {x["name"]: x["rel_l2"] for x in doc["tensors"]} == {"same": 0.0, "moved": None}


def test_integers_are_exact_whatever_the_tolerance(tmp_path: Path) -> None:
    save_file({"n": torch.tensor([7, 8]), "flag": torch.tensor([True, False])},
              str(tmp_path / "a.safetensors"))
    save_file({"n": torch.tensor([7, 9], dtype=torch.int32), "flag": torch.tensor([True, True])},
              str(tmp_path / "b.safetensors"))
    r = diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors",
             DiffOptions(atol=10.0, rtol=1.0))
    t = _by_name(r)
    assert t["n"].status == "changed" and t["n"].dtype_changed and t["n"].stats.max_abs == 1
    assert t["flag"].status == "changed" and t["n"].tolerance.source == "exact"


def test_packed_fp4_is_compared_byte_for_byte(tmp_path: Path) -> None:
    raw = torch.randint(0, 255, (4, 8), dtype=torch.uint8, generator=torch.Generator()
                        .manual_seed(0))
    save_file({"q": raw.view(torch.float4_e2m1fn_x2)}, str(tmp_path / "a.safetensors"))
    flipped = raw.clone()
    flipped[0, 0] ^= 1
    save_file({"q": flipped.view(torch.float4_e2m1fn_x2)}, str(tmp_path / "b.safetensors"))
    (tmp_path / "a2.safetensors").write_bytes((tmp_path / "a.safetensors").read_bytes())
    assert diff(tmp_path / "a.safetensors", tmp_path / "a2.safetensors").equal
    (t,) = diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors").tensors
    assert t.dtype_a == "F4" and t.shape_a == (4, 16) and t.status == "changed"
    assert t.stats is not None and t.stats.raw_only and t.stats.changed == 1
    out = run_cli("diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors").stdout
    assert "1 byte " in out


def test_tensors_without_data_are_skipped_and_said(tmp_path: Path) -> None:
    torch.save({"w": torch.empty(3, device="meta"), "b": torch.ones(2)}, tmp_path / "meta.pt")
    torch.save({"w": torch.ones(3), "b": torch.ones(2)}, tmp_path / "dense.pt")
    r = diff(tmp_path / "meta.pt", tmp_path / "dense.pt")
    t = _by_name(r)
    assert t["w"].status == "skipped" and t["w"].reason == "A holds a meta tensor"
    assert t["b"].status == "identical" and r.equal
    out = run_cli("diff", tmp_path / "meta.pt", tmp_path / "dense.pt").stdout
    assert "1 tensor not compared" in out and "A holds a meta tensor" in out


def test_filter_narrows_the_scope(tmp_path: Path) -> None:
    a = tiny_state_dict()
    b = {k: v + 1 if v.is_floating_point() else v for k, v in a.items()}
    save_file(a, str(tmp_path / "a.safetensors"))
    save_file(b, str(tmp_path / "b.safetensors"))
    r = diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors",
             DiffOptions(name_glob="layers.*.attn.*"))
    assert {t.name for t in r.tensors} == {"layers.0.attn.q_proj.weight",
                                           "layers.0.attn.q_proj.bias"}
    assert sum(r.excluded_a.values()) == len(a) - 2
    doc = _json(tmp_path / "a.safetensors", tmp_path / "b.safetensors", "--filter",
                "embed.*", code=1)
    assert [t["name"] for t in doc["tensors"]] == ["embed.weight"]
    assert doc["options"]["filter"] == "embed.*"


def test_shape_change_and_one_sided_tensors(tmp_path: Path) -> None:
    save_file({"w": torch.zeros(4, 2), "gone": torch.zeros(1)}, str(tmp_path / "a.safetensors"))
    save_file({"w": torch.zeros(2, 4), "new": torch.zeros(3)}, str(tmp_path / "b.safetensors"))
    r = diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert [t.name for t in r.shape_changes] == ["w"] and r.shape_changes[0].stats is None
    assert [o.name for o in r.only_a] == ["gone"] and [o.name for o in r.only_b] == ["new"]
    assert r.differences() == ["1 tensor only in A", "1 tensor only in B",
                               "1 tensor with a different shape"]
    out = run_cli("diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert out.exit_code == 1
    assert "Shape changes (1)" in out.stdout and "F32 [4, 2]" in out.stdout
    assert "Only in A (1)" in out.stdout and "Only in B (1)" in out.stdout
