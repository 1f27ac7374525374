"""``ckpt stats`` on DeepSpeed ZeRO checkpoints, against the figures of zero_to_fp32's
consolidated weights.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt_cli.ops.stats import StatsOptions, stats
from ckpt_cli.ops.stats.result import module_of
from tests.conftest import HAS_DEEPSPEED, requires_deepspeed, run_cli, third_party_quiet
from tests.ops.stats.conftest import (
    REL,
    _small_windows,
    _tiny,
    check_modules,
    check_tensors,
    stats_doc,
    tensor_docs,
    unique_storages,
)

# Every test here has a private stats cache (conftest.py).
pytestmark = [pytest.mark.requires_torch, pytest.mark.usefixtures("_private_cache")]


# -- DeepSpeed ZeRO ------------------------------------------------------------------------------


def _zero_to_fp32(save_dir: Path, tag: str | None = None) -> dict[str, torch.Tensor]:
    """DeepSpeed's own FP32 consolidation (``zero_to_fp32``) of a save directory (its
    ``latest``, or ``tag``)."""
    import contextlib
    import io

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with third_party_quiet(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        sd = get_fp32_state_dict_from_zero_checkpoint(str(save_dir), tag=tag)
    return {k: v.detach() for k, v in sd.items()}


def _ds_states(tag: Path, pattern: str) -> dict[str, Any]:
    """Each rank file's contents by its stem (torch.load; DeepSpeed's pickles need it)."""
    with third_party_quiet():
        return {p.stem: torch.load(p, weights_only=False) for p in sorted(tag.glob(pattern))}


@requires_deepspeed
@pytest.mark.parametrize("cfg", ["z1-fp32", "z2-fp32", "z2-bf16"])
def test_deepspeed_zero12_weights_and_adam_state(ds_dir: Path, cfg: str) -> None:
    """DeepSpeed ZeRO-1/2 tag directories (saved by deepspeed on 2 ranks): the model's
    weights are the model states' ``module`` (torch.load), FP32 ones equal to zero_to_fp32's
    consolidation; with ``everything`` each rank's Adam exp_avg / exp_avg_sq partition and its
    FP32 master partition equal torch.load's, zeros and tiny values counted as torch does."""
    tag = ds_dir / cfg / "global_step3"
    module = _ds_states(tag, "mp_rank_*_model_states.pt")["mp_rank_00_model_states"]["module"]
    weights = {f"module.{k}": v for k, v in module.items()}
    doc = stats_doc(tag, depth=2)
    assert doc["format"] == "deepspeed" and set(tensor_docs(doc)) == set(weights)
    check_tensors(doc, weights)
    check_modules(doc, weights, 2)
    if cfg.endswith("fp32"):
        fp32 = {f"module.{k}": v for k, v in _zero_to_fp32(ds_dir / cfg).items()}
        assert set(fp32) == set(weights)
        check_tensors(doc, fp32)
    else:
        assert tensor_docs(doc)["module.0.weight"]["dtype"] == "BF16"
    full = stats_doc(tag, all_tensors=True)
    state: dict[str, torch.Tensor] = {}
    for stem, ck in _ds_states(tag, "*optim_states.pt").items():
        osd = ck["optimizer_state_dict"]
        for k, v in osd["base_optimizer_state"]["state"][0].items():
            state[f"{stem}.optimizer_state_dict.base_optimizer_state.state.0.{k}"] = v
        for i, v in enumerate(osd["single_partition_of_fp32_groups"]):
            state[f"{stem}.optimizer_state_dict.single_partition_of_fp32_groups.{i}"] = v
    assert len(state) == 2 * 4
    check_tensors(full, {**weights, **state})
    got = tensor_docs(full)
    for name, t in state.items():
        if name.endswith("exp_avg_sq"):
            assert got[name]["tiny"] == _tiny(t) and got[name]["zeros"] == int((t == 0).sum())


@pytest.fixture(scope="module")
def ds3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ZeRO-3 saved by deepspeed itself: with the LayerNorm frozen (its parameters kept as
    per-rank fragments in the model states), with two layers sharing a weight, and saved
    after each of 3 steps."""
    if not HAS_DEEPSPEED:
        pytest.skip("deepspeed is not installed")
    from tests.helpers.makers import deepspeed_checkpoints

    return deepspeed_checkpoints(tmp_path_factory.mktemp("ds3"),
                                 ["z3-fp32+frozen", "z3-fp32+tied", "z3-fp32+each"])


@requires_deepspeed
@pytest.mark.parametrize("cfg", ["z3-fp32", "z3-bf16", "z3-fp32+frozen", "z3-fp32+tied"])
def test_deepspeed_zero3_weights_are_the_consolidated_ones(ds_dir: Path, ds3: Path,
                                                           cfg: str) -> None:
    """ZeRO-3 keeps the weights only as flat FP32 partitions (the model states hold ``[0]``
    placeholders; each partition is padded, with whatever the padding's memory held) and, for
    frozen parameters, per-rank fragments: the weights' figures are those of DeepSpeed's own
    consolidation (zero_to_fp32), per parameter and module, the padding in none of them; a
    shared parameter is its twin's (``same_as``), counted once in the modules."""
    base = ds3 if "+" in cfg else ds_dir
    tag = base / cfg / "global_step3"
    fp32 = {f"module.{k}": v for k, v in _zero_to_fp32(base / cfg).items()}
    doc = stats_doc(tag, depth=2)
    assert set(tensor_docs(doc)) == set(fp32)
    check_tensors(doc, fp32)
    check_modules(doc, unique_storages(fp32), 2)
    for name, t in tensor_docs(doc).items():
        assert t["shape"] == list(fp32[name].shape), name
        assert t["same_as"] == ("module.3.weight" if name == "module.4.weight" else None)
    if cfg.endswith("tied"):
        assert fp32["module.4.weight"].data_ptr() == fp32["module.3.weight"].data_ptr()


@requires_deepspeed
def test_deepspeed_zero3_partitions_that_cannot_be_gathered(ds_dir: Path,
                                                            tmp_path: Path) -> None:
    """A ZeRO-3 tag whose rank-1 optimizer file is cut short: each parameter says why it
    cannot be read (the file named); the buffer, stored whole, is still read."""
    import shutil

    tag = tmp_path / "global_step3"
    shutil.copytree(ds_dir / "z3-fp32" / "global_step3", tag)
    cut = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    doc = stats_doc(tag)
    got = tensor_docs(doc)
    params = [n for n in got if n != "module.counter"]
    assert len(params) == 6
    for n in params:
        assert "ZeRO-3 partitions cannot be gathered" in got[n]["error"], n
        assert cut.name in got[n]["error"] and got[n].get("mean") is None
    assert got["module.counter"]["error"] is None and got["module.counter"]["mean"] == 1.0
    # Figures that could not be computed fail the gate: one `unreadable` anomaly per tensor.
    assert sorted(a["tensor"] for a in doc["anomalies"] if a["kind"] == "unreadable") == \
        sorted(params)
    r = run_cli("stats", tag, "--no-cache")
    assert r.exit_code == 1 and "unreadable" in r.stdout


def test_views_of_one_storage_in_a_torch_zip(tmp_path: Path) -> None:
    """torch.save of views of one storage: the whole, its transpose (strided), a row range
    (an offset into the storage), a column (strided) and the same view twice: each equal to
    torch's figures of what torch.load gives, only the identical view an alias."""
    g = torch.Generator().manual_seed(5)
    base = torch.randn(300, 700, generator=g)
    base[10, 20] = float("nan")
    sd = {"m.w": base, "m.wt": base.t(), "m.rows": base[3:7], "m.col": base[:, 2],
          "m.again": base}
    torch.save(sd, tmp_path / "views.pt")
    ref = torch.load(tmp_path / "views.pt", weights_only=True)
    assert ref["m.wt"].stride() == (1, 700)
    doc = stats_doc(tmp_path / "views.pt")
    check_tensors(doc, ref)
    check_modules(doc, {k: v for k, v in ref.items() if k != "m.again"}, None)
    assert {t["name"]: t["same_as"] for t in doc["tensors"]} == {
        "m.w": None, "m.wt": None, "m.rows": None, "m.col": None, "m.again": "m.w"}


def test_other_dtypes_in_small_windows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """FP64 (a window spans two pieces), int8, uint8, int64 and bool tensors, saved by
    safetensors, read with ``everything`` in 4,000-byte windows: torch's figures."""
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(9)
    sd = {"a.f64": torch.randn(70, 90, generator=g, dtype=torch.float64) * 1e3,
          "a.i8": torch.randint(-128, 128, (4001,), generator=g, dtype=torch.int8),
          "a.u8": torch.randint(0, 256, (3, 1001), generator=g, dtype=torch.uint8),
          "a.i64": torch.randint(-2**40, 2**40, (999,), generator=g, dtype=torch.int64),
          "a.mask": torch.rand(5000, generator=g) > 0.3}
    sd["a.f64"][1, 1] = float("inf")
    save_file(sd, tmp_path / "d.safetensors")
    sizes = _small_windows(monkeypatch, 4000)
    doc = stats_doc(tmp_path / "d.safetensors", all_tensors=True)
    ref = load_file(tmp_path / "d.safetensors")
    check_tensors(doc, ref)
    check_modules(doc, ref, None)
    assert max(sizes) == 1000 and len(sizes) > 5


@requires_deepspeed
def test_deepspeed_zero3_run_updates(ds3: Path) -> None:
    """A ZeRO-3 save directory of 3 steps read as a run: each checkpoint's module figures,
    and each module's update norm ``||W_t - W_{t-1}||``, equal torch's on zero_to_fp32's
    consolidation of each tag."""
    run = ds3 / "z3-fp32+each"
    doc = stats(run, StatsOptions(no_cache=True)).json_body()
    assert doc["mode"] == "run" and doc["anomalies"] == []
    tags = [c["name"] for c in doc["checkpoints"]]
    assert tags == ["global_step1", "global_step2", "global_step3"]
    prev: dict[str, torch.Tensor] | None = None
    for c in doc["checkpoints"]:
        now = {f"module.{k}": v for k, v in _zero_to_fp32(run, c["name"]).items()}
        check_modules(c, now, None)
        for m in c["modules"]:
            if prev is None:
                assert m["update_l2"] is None
                continue
            names = [n for n in now if module_of(n, None, "module.") == m["name"]]
            want = float(torch.linalg.vector_norm(torch.cat(
                [(now[n].double() - prev[n].double()).reshape(-1) for n in names])))
            assert math.isclose(m["update_l2"], want, rel_tol=REL, abs_tol=1e-300), (
                f"{c['name']}: module {m['name']}: update {m['update_l2']!r}, torch {want!r}")
        prev = now


@requires_deepspeed
def test_deepspeed_zero3_records_are_checked_once(ds_dir: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Gathering ZeRO-3 parameters checks the CRC-32 of each zip record holding partitions
    once per worker thread, not once per parameter (a record holds every parameter's share:
    once per parameter would read the partitions again for each)."""
    from ckpt_cli.formats import zero

    calls: list[tuple[int, int]] = []
    real = zero.crc32_range

    def counting(fd: Any, start: int, length: int) -> Any:
        calls.append((start, length))
        return real(fd, start, length)

    monkeypatch.setattr(zero, "crc32_range", counting)
    doc = stats_doc(ds_dir / "z3-fp32" / "global_step3", jobs=1)
    assert len([t for t in doc["tensors"] if t["error"] is None]) == 7
    assert len(calls) == 2, calls  # one flat partition record per rank
