"""``ckpt stats RUN``: anomalies, update ratios, the figure cache, run selection and ``--part``
on runs written by real training loops (torch.save with AdamW stepping an ``nn.Module``, an HF
Trainer run, ``ckpt sample``'s run), locally and on S3 (issue 41's run-mode "Done when")."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import run_cli, third_party_quiet
from tests.helpers import s3
from tests.helpers.train_loop import Loop, injected_run, load_model, module_of

pytestmark = [pytest.mark.requires_torch,
              # botocore and moto call datetime.utcnow() and friends; not ckpt's code.
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

ROOT = Path(__file__).resolve().parents[3]


def stats_json(*args: str | Path, code: int = 0) -> dict[str, Any]:
    """``ckpt stats ARGS --json``, its exit status checked, parsed."""
    r = run_cli("stats", *args, "--json")
    assert r.exit_code == code, r.stdout + r.stderr
    doc: dict[str, Any] = json.loads(r.stdout)
    return doc


def found(doc: dict[str, Any]) -> set[tuple[int, str, str]]:
    return {(a["step"], a["module"], a["kind"]) for a in doc["anomalies"]}


def model_bytes(path: Path) -> int:
    """Bytes of the saved model's tensors (the default scope: weights and buffers)."""
    return sum(t.numel() * t.element_size() for t in load_model(path).values())


def figures(doc: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """Each checkpoint's module figures (what must not depend on the cache or the place)."""
    return [c["modules"] for c in doc["checkpoints"]]


def listing(root: Path) -> dict[str, tuple[int, int, int]]:
    """Every entry under ``root``: mode, size, mtime (ns)."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns)
    st = root.lstat()
    out["."] = (st.st_mode, 0, st.st_mtime_ns)
    return out


def torch_modules(prev: Path | None, cur: Path) -> dict[str, dict[str, float | None]]:
    """Per module: torch's float64 L2 norm and update ratio ||W_t - W_{t-1}|| / ||W_{t-1}||
    over the module's tensors (None where a value is not finite)."""
    now = load_model(cur)
    before = load_model(prev) if prev is not None else {}
    sq: dict[str, float] = {}
    upd: dict[str, float] = {}
    base: dict[str, float] = {}
    for name, t in now.items():
        mod = module_of(name)
        x = t.double()
        finite = x[torch.isfinite(x)]
        sq[mod] = sq.get(mod, 0.0) + float(finite.pow(2).sum())
        if name in before:
            b = before[name].double()
            upd[mod] = upd.get(mod, 0.0) + float((x - b).pow(2).sum())
            base[mod] = base.get(mod, 0.0) + float(b[torch.isfinite(b)].pow(2).sum())
    out: dict[str, dict[str, float | None]] = {}
    for mod, s in sq.items():
        ratio = None
        if mod in upd and math.isfinite(upd[mod]) and base[mod] > 0:
            ratio = math.sqrt(upd[mod]) / math.sqrt(base[mod])
        out[mod] = {"l2": math.sqrt(s), "update_ratio": ratio}
    return out


def close(a: float | None, b: float | None, rel: float = 1e-12) -> bool:
    if a is None or b is None:
        return a is b
    return a == b or abs(a - b) <= rel * max(abs(a), abs(b))


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The figure cache of this test (never the user's)."""
    d = tmp_path / "cache"
    monkeypatch.setenv("CKPT_CACHE_DIR", str(d))
    return d


# --- anomalies ----------------------------------------------------------------------------------

def test_injected_run_flags_exactly_the_jump_the_nan_and_the_frozen_module(
        tmp_path: Path, cache: Path) -> None:
    loop = injected_run(tmp_path / "run", checkpoints=6, jump_at=2, nan_at=3, freeze_from=4)
    steps = [int(p.stem.split("_")[1]) for p in loop.saved]
    doc = stats_json(tmp_path / "run", code=1)
    assert found(doc) == {(steps[2], "layers.1", "norm-jump"),
                          (steps[3], "layers.0", "nan"),
                          (steps[4], "layers.2", "frozen")}
    by = {a["kind"]: a for a in doc["anomalies"]}
    assert {a["checkpoint"] for a in doc["anomalies"]} == {
        loop.saved[2].name, loop.saved[3].name, loop.saved[4].name}
    # the figures that triggered each, as torch computes them
    jump_now = torch_modules(loop.saved[1], loop.saved[2])["layers.1"]
    jump_was = torch_modules(None, loop.saved[1])["layers.1"]
    assert close(by["norm-jump"]["l2"], jump_now["l2"])
    assert close(by["norm-jump"]["previous_l2"], jump_was["l2"])
    assert by["norm-jump"]["ratio"] == by["norm-jump"]["l2"] / by["norm-jump"]["previous_l2"]
    assert 50 < by["norm-jump"]["ratio"] < 200
    assert by["nan"]["nan"] == 1 and by["nan"]["numel"] == 16 * 16 + 16
    frozen_before = torch_modules(loop.saved[2], loop.saved[3])["layers.2"]
    assert by["frozen"]["update_ratio"] == 0.0
    assert close(by["frozen"]["previous_update_ratio"], frozen_before["update_ratio"])
    for a in doc["anomalies"]:
        assert a["message"] and "\n" not in a["message"]
    # the frozen module's weights really are bit-identical from there on
    for a, b in zip(loop.saved[4:], loop.saved[3:], strict=False):
        assert torch.equal(load_model(a)["layers.2.weight"], load_model(b)["layers.2.weight"])


def test_jump_and_filter_choose_what_is_judged(tmp_path: Path, cache: Path) -> None:
    loop = injected_run(tmp_path / "run", checkpoints=6, jump_at=2, nan_at=3, freeze_from=4)
    steps = [int(p.stem.split("_")[1]) for p in loop.saved]
    lax = stats_json(tmp_path / "run", "--jump", "200", code=1)
    assert lax["jump"] == 200.0
    assert found(lax) == {(steps[3], "layers.0", "nan"),
                          (steps[4], "layers.2", "frozen")}
    one = stats_json(tmp_path / "run", "--filter", "model.layers.1.*", code=1)
    assert found(one) == {(steps[2], "layers.1", "norm-jump")}
    assert {m["name"] for c in one["checkpoints"] for m in c["modules"]} == {"layers.1"}
    assert stats_json(tmp_path / "run", "--filter", "*.layers.2.*", "--last", "2")[
        "anomalies"] == []  # frozen since before the newest two: nothing changed in them


def test_a_tensor_zeroed_at_one_step_is_flagged_dead(tmp_path: Path, cache: Path) -> None:
    loop = injected_run(tmp_path / "run", checkpoints=4, jump_at=None, nan_at=None,
                        freeze_from=None, dead_at=3)
    doc = stats_json(tmp_path / "run", code=1)
    step = int(loop.saved[3].stem.split("_")[1])
    assert found(doc) == {(step, "head", "dead")}
    (dead,) = doc["anomalies"]
    assert dead["tensor"] == "model.head.weight" and dead["numel"] == 4 * 16


def test_the_same_loop_without_injection_is_clean(tmp_path: Path, cache: Path) -> None:
    loop = injected_run(tmp_path / "run", checkpoints=6, jump_at=None, nan_at=None,
                        freeze_from=None)
    doc = stats_json(tmp_path / "run")
    assert doc["anomalies"] == [] and doc["mode"] == "run"
    assert [c["step"] for c in doc["checkpoints"]] == [0, 2, 4, 6, 8, 10]
    # one of its checkpoints alone: its causal mask's -inf is no anomaly either
    one = stats_json(loop.saved[-1])
    assert one["mode"] == "checkpoint" and one["anomalies"] == []
    mask = next(t for t in one["tensors"] if t["name"] == "model.causal_mask")
    assert mask["inf"] == 8 * 7 // 2 and mask["group"] == "buffer"


def test_a_diverging_run_flags_each_module_once_where_nan_appears(tmp_path: Path,
                                                                  cache: Path) -> None:
    loop = Loop(tmp_path / "run")
    for k in range(6):
        if k == 3:  # a NaN in the live weights: the next steps spread it everywhere
            with torch.no_grad():
                loop.net.layers[1].weight[0, 0] = float("nan")
        loop.checkpoint()
    doc = stats_json(tmp_path / "run", code=1)
    trained = {module_of(n) for n, t in load_model(loop.saved[0]).items()
               if t.is_floating_point() and n != "causal_mask"}
    assert found(doc) == {(6, m, "nan") for m in trained}
    for a in doc["anomalies"]:
        assert a["nan"] == a["numel"]  # every value: the last good checkpoint is step 4


def test_update_ratios_and_norms_equal_torchs_float64(tmp_path: Path, cache: Path) -> None:
    loop = injected_run(tmp_path / "run", checkpoints=5, jump_at=2, nan_at=3, freeze_from=None)
    doc = stats_json(tmp_path / "run", code=1)
    checked = 0
    for i, c in enumerate(doc["checkpoints"]):
        want = torch_modules(loop.saved[i - 1] if i else None, loop.saved[i])
        got = {m["name"]: m for m in c["modules"]}
        assert set(got) == set(want)
        for mod, w in want.items():
            assert close(got[mod]["l2"], w["l2"]), (c["name"], mod)
            assert close(got[mod]["update_ratio"], w["update_ratio"]), (c["name"], mod)
            checked += w["update_ratio"] is not None
    # every module of every later checkpoint has a ratio, except where a value is not
    # finite: the mask's -inf (module "model"), layers.0 at and after its NaN
    assert checked == 4 * 6 - 2
    assert doc["checkpoints"][0]["modules"][0]["update_ratio"] is None


def test_a_batchnorm_step_counter_is_no_norm_jump(tmp_path: Path, cache: Path) -> None:
    # num_batches_tracked (an int64 counter) grows with the step count: 0, 20, 40...
    loop = Loop(tmp_path / "run", every=20, batchnorm=True)
    for _ in range(4):
        loop.checkpoint()
    doc = stats_json(tmp_path / "run")
    assert doc["anomalies"] == []
    bn = [{m["name"]: m for m in c["modules"]}["bn"] for c in doc["checkpoints"]]
    assert bn[1]["l2"] > 2 * bn[0]["l2"]  # the module's figures hold the counter


def test_a_module_of_integer_counters_only_is_not_judged_on_its_norm(
        tmp_path: Path, cache: Path) -> None:
    loop = Loop(tmp_path / "run", every=20, batchnorm=True)
    loop.train(5)
    for _ in range(3):
        loop.checkpoint()  # num_batches_tracked: 5, 25, 45
    doc = stats_json(tmp_path / "run", "--filter", "*num_batches_tracked")
    assert [m["l2"] for c in doc["checkpoints"] for m in c["modules"]] == [5, 25, 45]
    assert doc["anomalies"] == []


class _Lora(torch.nn.Module):
    """A frozen base Linear with a LoRA adapter: ``B`` zero-initialized, as peft does."""

    def __init__(self) -> None:
        super().__init__()
        self.base = torch.nn.Linear(16, 16).requires_grad_(False)
        self.lora_A = torch.nn.Linear(16, 4, bias=False)
        self.lora_B = torch.nn.Linear(4, 16, bias=False)
        torch.nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x))  # type: ignore[no-any-return]


def _lora_run(root: Path, jump_at: int | None = None) -> list[int]:
    root.mkdir()
    gen = torch.manual_seed(0)
    net = _Lora()
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-3)
    x, y = torch.randn(32, 16, generator=gen), torch.randn(32, 16, generator=gen)
    steps = []
    for k in range(6):
        for _ in range(5 if k else 0):
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
        step = 5 * k
        sd = {n: t.clone() for n, t in net.state_dict().items()}
        if k == jump_at:
            sd["lora_B.weight"].mul_(100)
        torch.save({"model": sd, "step": step}, root / f"step_{step}.pt")
        steps.append(step)
    return steps


def test_a_lora_adapter_growing_from_zero_is_no_norm_jump(tmp_path: Path,
                                                          cache: Path) -> None:
    _lora_run(tmp_path / "run")
    doc = stats_json(tmp_path / "run")
    assert doc["anomalies"] == []
    norms = [{m["name"]: m["l2"] for m in c["modules"]}["lora_B"]
             for c in doc["checkpoints"]]
    assert norms[0] == 0 and norms[2] > 2 * norms[1]  # Adam: B's norm grows with the steps
    # still a x100 of the adapter is flagged, where it is
    steps = _lora_run(tmp_path / "sick", jump_at=3)
    sick = stats_json(tmp_path / "sick", code=1)
    assert found(sick) == {(steps[3], "lora_B", "norm-jump")}


def test_the_sample_run_has_no_anomaly(sample_run: Path, cache: Path) -> None:
    doc = stats_json(sample_run)
    assert doc["anomalies"] == []
    assert [c["step"] for c in doc["checkpoints"]] == [100, 200, 300, 400]
    assert doc["checkpoints"][-1]["format"] == "dcp"  # the others: step dirs of torch files


def test_an_hf_trainer_run_has_no_anomaly(hf_trainer_dir: Path, cache: Path) -> None:
    doc = stats_json(hf_trainer_dir)
    assert doc["anomalies"] == []
    assert [c["name"] for c in doc["checkpoints"]] == ["checkpoint-2", "checkpoint-4"]
    last = doc["checkpoints"][-1]["modules"]
    assert last and all(m["update_ratio"] is not None and m["update_ratio"] > 0 for m in last)


def test_a_lightning_run_with_last_ckpt_is_not_frozen(lightning_dir: Path,
                                                      cache: Path) -> None:
    # last.ckpt is Lightning's copy of the newest save: the same step, the same weights
    doc = stats_json(lightning_dir)
    assert doc["anomalies"] == []
    assert [c["step"] for c in doc["checkpoints"]][:2] == [2, 4]


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


# --- which checkpoints --------------------------------------------------------------------------

@pytest.fixture
def ten(tmp_path: Path) -> Path:
    loop = Loop(tmp_path / "run", every=2)
    for _ in range(10):
        loop.checkpoint()
    return tmp_path / "run"  # steps 0, 2, ... 18


@pytest.mark.parametrize(("args", "steps"), [
    ((), [0, 2, 4, 6, 8, 10, 12, 14, 16, 18]),
    (("--every", "3"), [0, 6, 12, 18]),
    (("--every", "4"), [2, 10, 18]),
    (("--every", "20"), [18]),
    (("--last", "3"), [14, 16, 18]),
    (("--last", "30"), [0, 2, 4, 6, 8, 10, 12, 14, 16, 18]),
    (("--every", "2", "--last", "2"), [14, 18]),
])
def test_every_and_last_pick_the_checkpoints(ten: Path, cache: Path, args: tuple[str, ...],
                                             steps: list[int]) -> None:
    doc = stats_json(ten, *args)
    assert [c["step"] for c in doc["checkpoints"]] == steps
    # updates are between the checkpoints listed: the first has none
    assert all(m["update_ratio"] is None for m in doc["checkpoints"][0]["modules"])
    if len(steps) > 1:
        assert any(m["update_ratio"] for m in doc["checkpoints"][1]["modules"])


def _dcp_without_metadata(root: Path, step: int) -> Path:
    import torch.distributed.checkpoint as dcp

    dest = root / f"step_{step}"
    with third_party_quiet():  # no process group: torch warns it saves as one process
        dcp.save({"model": {"w": torch.ones(4, 4)}}, checkpoint_id=str(dest))
    (dest / ".metadata").unlink()
    return dest


def test_incomplete_checkpoints_are_skipped_and_named(tmp_path: Path, cache: Path) -> None:
    loop = injected_run(tmp_path / "run", checkpoints=3, jump_at=None, nan_at=None,
                        freeze_from=None)
    run = tmp_path / "run"
    _dcp_without_metadata(run, 100)
    shutil.copy(loop.saved[-1], run / "step_200.pt.tmp")
    doc = stats_json(run)
    assert [c["name"] for c in doc["checkpoints"]] == [p.name for p in loop.saved]
    skipped = {s["name"]: s["reason"] for s in doc["skipped"]}
    assert "step_100" in skipped and ".metadata" in skipped["step_100"]
    assert doc["read"]["bytes"] == sum(model_bytes(p) for p in loop.saved)
    r = run_cli("stats", run)
    assert r.exit_code == 0
    assert "1 not read" in r.stdout or "step_100" in r.stdout + r.stderr


def test_a_temporary_named_checkpoint_is_named_as_skipped(tmp_path: Path,
                                                          cache: Path) -> None:
    loop = injected_run(tmp_path / "run", checkpoints=2, jump_at=None, nan_at=None,
                        freeze_from=None)
    shutil.copy(loop.saved[-1], tmp_path / "run" / "step_200.pt.tmp")
    doc = stats_json(tmp_path / "run")
    assert "step_200.pt.tmp" in {s["name"] for s in doc["skipped"]}


def test_no_complete_checkpoint_is_an_input_error(tmp_path: Path, cache: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    _dcp_without_metadata(run, 100)
    _dcp_without_metadata(run, 200)
    r = run_cli("stats", run)
    assert r.exit_code == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


# --- --part -------------------------------------------------------------------------------------

def _cli(*args: str | Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "NO_COLOR": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "ckpt_cli", "stats", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT)


def test_two_parts_in_two_processes_make_the_whole(tmp_path: Path, cache: Path) -> None:
    loop = injected_run(tmp_path / "run", checkpoints=6, jump_at=2, nan_at=3, freeze_from=4)
    run, shared = tmp_path / "run", tmp_path / "shared"
    n = len(load_model(loop.saved[0]))
    procs = [_cli(run, "--part", f"{i}/2", "--cache-dir", shared, "--json") for i in (1, 2)]
    outs = [p.communicate(timeout=120) for p in procs]
    docs = []
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode in (0, 1), err.decode()
        docs.append(json.loads(out))
    whole = stats_json(run, "--no-cache", code=1)
    # each computed its share, none twice
    assert sorted(d["part"]["part"] for d in docs) == [1, 2]
    assert sum(d["part"]["tensors"] for d in docs) == 6 * n
    assert all(d["part"]["tensors"] > 0 for d in docs)
    complete = [d for d in docs if d["part"]["complete"]]
    assert complete  # the last to finish found every figure
    for d in complete:
        assert d["checkpoints"] == whole["checkpoints"] and d["anomalies"] == whole["anomalies"]
    plain = stats_json(run, "--cache-dir", shared, code=1)
    assert plain["read"]["bytes"] == 0 and plain["read"]["computed_tensors"] == 0
    assert plain["checkpoints"] == whole["checkpoints"]
    assert found(plain) == found(whole) and len(found(whole)) == 3


def test_part_without_the_cache_is_a_usage_error(tmp_path: Path, cache: Path) -> None:
    injected_run(tmp_path / "run", checkpoints=2, jump_at=None, nan_at=None, freeze_from=None)
    r = run_cli("stats", tmp_path / "run", "--part", "1/2", "--no-cache")
    assert r.exit_code == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "--part" in r.stderr
    assert not cache.exists()


# --- object storage -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def endpoint() -> Iterator[tuple[str, s3.Proxy]]:
    with s3.moto_endpoint() as pair:
        yield pair


def test_a_run_on_s3_has_the_local_figures_and_uses_the_cache(
        s3env: s3.Proxy, endpoint: tuple[str, s3.Proxy], tmp_path: Path, cache: Path) -> None:
    moto = endpoint[0]
    injected_run(tmp_path / "run", checkpoints=4, jump_at=2, nan_at=None, freeze_from=None)
    bucket = f"stats-{uuid.uuid4().hex[:10]}"
    s3.client(moto).create_bucket(Bucket=bucket)
    s3.upload(moto, tmp_path / "run", bucket, "run")
    local = stats_json(tmp_path / "run", "--no-cache", code=1)
    url = f"s3://{bucket}/run"
    remote = stats_json(url, code=1)
    assert remote["mode"] == "run"
    assert [c["name"] for c in remote["checkpoints"]] == [c["name"]
                                                         for c in local["checkpoints"]]
    assert figures(remote) == figures(local)
    assert found(remote) == found(local)
    assert remote["read"]["bytes"] == local["read"]["bytes"]
    again = stats_json(url, code=1)
    assert again["read"]["bytes"] == 0 and again["read"]["computed_tensors"] == 0
    assert figures(again) == figures(local)
