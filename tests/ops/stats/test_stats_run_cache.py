"""``ckpt stats`` on runs: the figures cache (kept per checkpoint, rewritten when stale or
damaged, never trusted blindly).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.train_loop import Loop, injected_run, load_model
from tests.ops.stats.run_helpers import close, model_bytes, stats_json, torch_modules

pytestmark = [pytest.mark.requires_torch,
              # botocore and moto call datetime.utcnow() and friends; not ckpt's code.
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def listing(root: Path) -> dict[str, tuple[int, int, int]]:
    """Every entry under ``root``: mode, size, mtime (ns)."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns)
    st = root.lstat()
    out["."] = (st.st_mode, 0, st.st_mtime_ns)
    return out


# --- the cache ----------------------------------------------------------------------------------

def test_fifty_checkpoints_are_read_once_then_only_what_is_new(tmp_path: Path,
                                                               cache: Path) -> None:
    run = tmp_path / "run"
    loop = Loop(run, every=1)
    for _ in range(50):
        loop.checkpoint()
    per = model_bytes(loop.saved[0])
    n = len(load_model(loop.saved[0]))
    first = stats_json(run)
    assert first["read"]["bytes"] == sum(model_bytes(p) for p in loop.saved) == 50 * per
    assert first["read"]["computed_tensors"] == 50 * n and first["read"]["cached_tensors"] == 0
    assert first["read"]["cache_dir"] == str(cache / "stats-v2")
    second = stats_json(run)
    assert second["read"]["bytes"] == 0 and second["read"]["computed_tensors"] == 0
    assert second["read"]["cached_tensors"] == 50 * n
    assert second["checkpoints"] == first["checkpoints"]
    assert second["anomalies"] == first["anomalies"] == []
    # one more checkpoint: its figures, and its update against its predecessor (whose values
    # are read again for the difference; its figures come from the cache)
    loop.checkpoint()
    third = stats_json(run)
    assert third["read"]["bytes"] == model_bytes(loop.saved[-1]) + model_bytes(loop.saved[-2])
    assert third["read"]["computed_tensors"] == n
    assert third["read"]["cached_tensors"] == 50 * n
    assert third["checkpoints"][:50] == first["checkpoints"]
    fresh = stats_json(run, "--no-cache")
    assert third["checkpoints"] == fresh["checkpoints"]
    assert fresh["read"]["bytes"] == 51 * per


def _rewrite(path: Path, scale: float) -> None:
    """Save ``path`` again in place with its model's floating-point tensors scaled."""
    obj = torch.load(path, map_location="cpu", weights_only=True)
    for k, v in obj["model"].items():
        if v.is_floating_point():
            obj["model"][k] = v * scale
    before = path.stat().st_mtime_ns
    torch.save(obj, path)
    os.utime(path, ns=(before + 10**9, before + 10**9))


@pytest.mark.parametrize("scale", [1.25, 1.0])
def test_a_checkpoint_rewritten_in_place_is_recomputed(tmp_path: Path, cache: Path,
                                                        scale: float) -> None:
    loop = injected_run(tmp_path / "run", checkpoints=5, jump_at=None, nan_at=None,
                        freeze_from=None)
    n = len(load_model(loop.saved[0]))
    stats_json(tmp_path / "run")
    _rewrite(loop.saved[2], scale)  # same values (1.0): only its mtime says it changed
    again = stats_json(tmp_path / "run")
    # its own figures; the updates into and out of it: its neighbours' values read again
    assert again["read"]["computed_tensors"] == n
    assert again["read"]["bytes"] == sum(model_bytes(p) for p in loop.saved[1:4])
    assert again["checkpoints"] == stats_json(tmp_path / "run", "--no-cache")["checkpoints"]
    want = torch_modules(loop.saved[1], loop.saved[2])
    got = {m["name"]: m for m in again["checkpoints"][2]["modules"]}
    assert close(got["head"]["l2"], want["head"]["l2"])
    assert close(got["head"]["update_ratio"], want["head"]["update_ratio"])


def test_a_checkpoint_behind_a_symlink_is_recomputed_when_its_target_changes(
        tmp_path: Path, cache: Path) -> None:
    from safetensors.torch import save_file

    store = tmp_path / "store"
    store.mkdir()
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "model.safetensors").symlink_to(store / "blob.safetensors")
    (tmp_path / "link.pt").symlink_to(store / "real.pt")

    def write(value: float) -> None:
        save_file({"a.weight": torch.full((4, 4), value)}, store / "blob.safetensors")
        torch.save({"model": {"a.weight": torch.full((4, 4), value)}}, store / "real.pt")

    write(1.0)
    for path in (tmp_path / "ckpt", tmp_path / "link.pt"):
        assert stats_json(path)["tensors"][0]["l2"] == 4.0
        assert stats_json(path)["read"]["bytes"] == 0
    write(3.0)  # the targets rewritten in place; the links themselves unchanged
    for path in (tmp_path / "ckpt", tmp_path / "link.pt"):
        doc = stats_json(path)
        assert doc["tensors"][0]["l2"] == 12.0 and doc["read"]["bytes"] == 64


def test_figures_of_every_kind_of_value_are_kept(tmp_path: Path, cache: Path) -> None:
    # the cache's sanity check must accept whatever a computation gives: NaN, Inf, subnormal
    # and zero values, integers and booleans, half-precision floats
    from safetensors.torch import save_file

    run = tmp_path / "run"
    run.mkdir()
    gen = torch.manual_seed(0)
    for step in (1, 2):
        save_file({"a.weight": torch.randn(64, 64, generator=gen).bfloat16(),
                   "b.weight": torch.randn(33, generator=gen).half(),
                   "c.position_ids": torch.arange(10),
                   "d.mask": torch.ones(5, dtype=torch.bool),
                   "e.weight": torch.tensor([float("nan"), float("inf"), 0.0, 1e-45, -1e-40]),
                   "f.weight": torch.zeros(7)}, run / f"step_{step}.safetensors")
    first = stats_json(run, code=1)  # e.weight's NaN and Inf
    again = stats_json(run, code=1)
    assert again["read"]["bytes"] == 0 and again["read"]["cached_tensors"] == 12
    assert again["checkpoints"] == first["checkpoints"]


def _entries(cache: Path) -> list[Path]:
    return sorted((cache / "stats-v2").glob("*/*.json"))


def _garbage(p: Path) -> None:
    p.write_bytes(b"\x00\xffnot json at all" * 10)


def _truncated(p: Path) -> None:
    raw = p.read_bytes()
    p.write_bytes(raw[:len(raw) // 2])


def _wrong_version(p: Path) -> None:
    doc = json.loads(p.read_bytes())
    doc["version"] += 1  # a later version
    for figs in doc["tensors"].values():
        figs[4] *= 4  # sumsq: the L2 norm doubled, were it believed
    p.write_text(json.dumps(doc))


def _wrong_key(p: Path) -> None:
    doc = json.loads(p.read_bytes())
    doc["key"] = "0" * 40
    p.write_text(json.dumps(doc))


def _bad_types(p: Path) -> None:
    doc = json.loads(p.read_bytes())
    for figs in doc["tensors"].values():
        figs[2] = [figs[2]]  # the mean as a list
    p.write_text(json.dumps(doc))


def _inconsistent(p: Path) -> None:
    doc = json.loads(p.read_bytes())
    for i, figs in enumerate(doc["tensors"].values()):
        if i % 2:
            figs[2] = "nan"  # a mean float() reads, that no computation gives
        else:
            figs[0] += 7  # values that do not add up
            figs[4] *= 4
    p.write_text(json.dumps(doc))


def _bad_update(p: Path) -> None:
    doc = json.loads(p.read_bytes())
    doc["updates"] = {k: dict.fromkeys(v, "x") for k, v in doc["updates"].items()} or {"k": 1}
    p.write_text(json.dumps(doc))


def _a_directory(p: Path) -> None:
    p.unlink()
    p.mkdir()


@pytest.mark.parametrize("damage", [_garbage, _truncated, _wrong_version, _wrong_key,
                                    _bad_types, _inconsistent, _bad_update, _a_directory],
                         ids=lambda f: f.__name__.strip("_"))
def test_a_damaged_cache_entry_is_recomputed_never_trusted(tmp_path: Path, cache: Path,
                                                            damage: Any) -> None:
    loop = injected_run(tmp_path / "run", checkpoints=3, jump_at=None, nan_at=None,
                        freeze_from=None)
    n = len(load_model(loop.saved[0]))
    first = stats_json(tmp_path / "run")
    entries = _entries(cache)
    assert len(entries) == 3
    for p in entries:
        damage(p)
    again = stats_json(tmp_path / "run")
    assert again["read"]["computed_tensors"] == 3 * n
    assert again["read"]["bytes"] == first["read"]["bytes"]
    assert again["checkpoints"] == first["checkpoints"]
    if damage is not _a_directory:  # rewritten whole: the third run reads nothing
        third = stats_json(tmp_path / "run")
        assert third["read"]["bytes"] == 0 and third["checkpoints"] == first["checkpoints"]


def test_no_cache_writes_nothing_and_nothing_is_ever_written_into_the_run(
        tmp_path: Path, cache: Path) -> None:
    injected_run(tmp_path / "run", checkpoints=3, jump_at=None, nan_at=None, freeze_from=None)
    run = tmp_path / "run"
    before = listing(run)
    off = stats_json(run, "--no-cache")
    assert off["read"]["cache_dir"] is None and not cache.exists()
    assert listing(run) == before
    on = stats_json(run)
    assert _entries(cache) and listing(run) == before
    assert on["checkpoints"] == off["checkpoints"]
    # a read-only run directory: read, and the cache still used
    for p in run.iterdir():
        p.chmod(0o444)
    run.chmod(0o555)
    try:
        before = listing(run)
        # chmod moved the files' inode-change time, part of their stamp: read once more,
        # then from the cache
        assert stats_json(run)["checkpoints"] == on["checkpoints"]
        again = stats_json(run)
        assert again["read"]["bytes"] == 0 and again["checkpoints"] == on["checkpoints"]
        assert stats_json(run, "--no-cache")["checkpoints"] == on["checkpoints"]
        assert listing(run) == before
    finally:
        run.chmod(0o755)


def test_an_unwritable_cache_directory_costs_only_a_reread(tmp_path: Path) -> None:
    injected_run(tmp_path / "run", checkpoints=2, jump_at=None, nan_at=None, freeze_from=None)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    doc = stats_json(tmp_path / "run", "--cache-dir", blocker / "cache")
    again = stats_json(tmp_path / "run", "--cache-dir", blocker / "cache")
    assert again["read"]["bytes"] == doc["read"]["bytes"] > 0
    assert blocker.read_text() == "not a directory"


def _depth1(path: Path, prev: Path) -> dict[str, float]:
    """torch's update ratio per first name component of the model (``--depth 1``: the
    ``model.`` container key is not a component)."""
    now, before = load_model(path), load_model(prev)
    upd: dict[str, float] = {}
    base: dict[str, float] = {}
    for name, t in now.items():
        if not t.is_floating_point() or not torch.isfinite(t).all():
            continue
        mod = name.split(".")[0]
        b = before[name].double()
        upd[mod] = upd.get(mod, 0.0) + float((t.double() - b).pow(2).sum())
        base[mod] = base.get(mod, 0.0) + float(b.pow(2).sum())
    return {m: math.sqrt(upd[m]) / math.sqrt(base[m]) for m in upd}


def test_other_roll_ups_and_selections_come_from_the_cache(tmp_path: Path,
                                                           cache: Path) -> None:
    loop = injected_run(tmp_path / "run", checkpoints=5, jump_at=None, nan_at=None,
                        freeze_from=None)
    run = tmp_path / "run"
    stats_json(run)
    # another depth: rolled up from the kept per-tensor figures and updates, nothing read
    deep = stats_json(run, "--depth", "1")
    assert deep["read"]["bytes"] == 0 and deep["read"]["computed_tensors"] == 0
    for i in (1, 4):
        got = {m["name"]: m["update_ratio"] for m in deep["checkpoints"][i]["modules"]}
        for mod, want in _depth1(loop.saved[i], loop.saved[i - 1]).items():
            assert close(got[mod], want), (i, mod)
    # the model's top modules, never a "model" row of the container (the causal mask at the
    # model's top level is a row of its own, under its name)
    assert {m["name"] for m in deep["checkpoints"][0]["modules"]} == {
        "emb", "norm", "layers", "head", "causal_mask"}
    # every other checkpoint: the figures are kept, the updates between those two are new
    every = stats_json(run, "--every", "2")
    assert [c["step"] for c in every["checkpoints"]] == [0, 4, 8]
    assert every["read"]["computed_tensors"] == 0
    assert every["read"]["bytes"] == sum(model_bytes(p) for p in loop.saved[::2])
    got = {m["name"]: m["update_ratio"] for m in every["checkpoints"][2]["modules"]}
    want = torch_modules(loop.saved[2], loop.saved[4])
    assert all(close(got[m], w["update_ratio"]) for m, w in want.items())
    assert stats_json(run, "--every", "2")["read"]["bytes"] == 0
