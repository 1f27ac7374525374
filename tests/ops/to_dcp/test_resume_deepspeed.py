"""``ckpt convert --to dcp`` from DeepSpeed, proven by resuming (issue 48). DeepSpeed ZeRO 1/2/3
on gloo at world 2 (CPU) trains :mod:`tests.helpers.fsdp_resume`'s model, data, AdamW
(``torch_adam``) and linear-warmup ``LambdaLR`` for K0 steps and saves; a fresh engine loads
that checkpoint and trains K more steps (:mod:`tests.helpers.ds_resume`). ckpt converts the
checkpoint; the FSDP2 (``fully_shard``) loop resumes it at world 1 and 2 for the same K steps.
Its parameters, Adam moments and step then equal DeepSpeed's (full FP32 master weights and
moments, gathered), and the LR of each resumed step is DeepSpeed's, exactly.

Bounds, as measured (K0=6, K=5; the same on every stage):

* **World 2 (DeepSpeed's own): exact**, FP32 and BF16. Each rank sees the same half batch,
  computes the same gradients and the two are averaged alike (FSDP2 reducing BF16 gradients
  in BF16 as DeepSpeed's default ``communication_data_type`` does); then torch's AdamW does
  the same elementwise math on the flat ZeRO partitions as on the FSDP2 shards.
* **Gradient clipping** (``gradient_clipping`` = 1.25, clipping about half the steps,
  against ``clip_grad_norm_``): the global norm is summed in another order and DeepSpeed
  divides by ``(norm + 1e-6) / max`` where torch multiplies by ``max / (norm + 1e-6)``; a few
  FP32 ulps (measured at world 2: 1.5e-8 absolute on the parameters, 3.7e-9 on ``exp_avg``).
  FP32 bound ``rtol=1e-5, atol=1e-7``.
* **World 1, FP32**: one process sums the batch that two ranks summed in halves: a few ulps
  in the gradients, passed on by Adam's normalisation (measured: 3.0e-8 absolute, 7.6e-7
  relative on the parameters). The FP32 bound.
* **World 1, BF16**: the full batch's BF16 gradient is not the BF16 average of two halves'
  BF16 gradients; a BF16 ulp (2**-8 relative) in gradients moves Adam's update. Measured:
  6.4e-5 on the parameters, 2.1e-4 on ``exp_avg``, 1.9e-5 on ``exp_avg_sq`` (absolute).
  BF16 bound: 2e-4, 1e-3, 1e-4 absolute.
* **DeepSpeed's CPU Adam** (``DeepSpeedCPUAdam``, ZeRO-2 with ``offload_optimizer``, a C++
  op built on first use) against torch's AdamW: its fused loop orders the same operations
  differently, a few FP32 ulps a step (measured at either world: 1.2e-7 absolute, 3.7e-5
  relative on the parameters, 2.2e-8 on ``exp_avg``). Bound ``rtol=1e-5``, ``atol=5e-7``
  on the parameters, ``1e-7`` on the moments. Its param groups lack torch's Adam keys
  (``maximize``...), which ckpt fills in: without them ``dcp.load`` of a torch AdamW's state
  failed (``Missing key ... maximize``).

The same resume without the optimizer state (weights only, same schedule and
data) ends 2e-2 away, far outside every bound: the moments carried are what make it match.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import requires_deepspeed

pytestmark = [pytest.mark.requires_torch, requires_deepspeed, pytest.mark.slow]

torch = pytest.importorskip("torch")

from tests.helpers import ds_resume  # noqa: E402
from tests.helpers import fsdp_resume as fr  # noqa: E402

K0, K = 6, 5  # K0 inside the warmup, so the resumed steps' LRs all differ
#: DeepSpeed configs (ds_resume.py) and the DCP layout each is converted to.
CONFIGS = {"z1-fp32": "recipe", "z2-fp32": "torchtitan", "z3-fp32": "torchtitan",
           "z2-bf16": "torchtitan", "z3-bf16": "torchtitan", "z2-fp32+clip": "torchtitan"}
#: Run apart (its own fixture), as DeepSpeed's CPU Adam op is compiled on first use (minutes).
CPU_ADAM_CONFIG = "z2-fp32+cpuadam"
#: The bounds (absolute per quantity, and rtol) the module docstring explains.
EXACT = {"model": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0, "rtol": 0.0}
FP32 = {"model": 1e-7, "exp_avg": 1e-7, "exp_avg_sq": 1e-7, "rtol": 1e-5}
BF16 = {"model": 2e-4, "exp_avg": 1e-3, "exp_avg_sq": 1e-4, "rtol": 0.0}
CPU_ADAM = {"model": 5e-7, "exp_avg": 1e-7, "exp_avg_sq": 1e-7, "rtol": 1e-5}


def bound(cfg: str, world: int) -> dict[str, float]:
    """The bound the module docstring explains."""
    if "cpuadam" in cfg:
        return CPU_ADAM
    if world == 1:
        return BF16 if "bf16" in cfg else FP32
    return FP32 if "clip" in cfg else EXACT


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every config's DeepSpeed checkpoint (OUT/<cfg>) and continuation (OUT/<cfg>.cont.pt)."""
    from tests.helpers.makers import _clear_stale_extension_locks

    out = tmp_path_factory.mktemp("ds-resume")
    _clear_stale_extension_locks()
    fr.launch(2, Path(ds_resume.__file__), str(out), str(K0), str(K), *CONFIGS)
    return out


@pytest.fixture(scope="module")
def cpu_adam_run(run: Path) -> Path:
    """``z2-fp32+cpuadam``'s checkpoint and continuation, beside ``run``'s."""
    from deepspeed.ops.op_builder import CPUAdamBuilder

    if not CPUAdamBuilder().is_compatible(verbose=False):
        pytest.skip("DeepSpeed's CPU Adam op cannot be built here (no compiler?)")
    fr.launch(2, Path(ds_resume.__file__), str(run), str(K0), str(K), CPU_ADAM_CONFIG)
    return run


def _resumed(run: Path, cfg: str, world: int, weights_only: bool = False) -> dict[str, Any]:
    import ckpt_cli

    layout = CONFIGS.get(cfg, "torchtitan")
    dcp = run / f"{cfg}.dcp"
    if not dcp.exists():
        ckpt_cli.convert(run / cfg, dcp, to="dcp", dcp_layout=layout)
    res = run / f"{cfg}.res{world}{'-w' if weights_only else ''}.pt"
    flags = [*(["--weights-only"] if weights_only else []), *(["--bf16"] if "bf16" in cfg else []),
             *(["--clip", str(ds_resume.CLIP)] if "clip" in cfg else [])]
    fr.launch(world, Path(fr.__file__), str(dcp), str(res), "--layout", layout,
              "--steps", str(K), *flags)
    return dict(torch.load(res, weights_only=True))


def _compare(src: dict[str, Any], got: dict[str, Any], tol: dict[str, float]) -> None:
    assert got["step"] == src["step"] == K0
    assert got["lrs"] == src["lrs"]  # exactly: the schedule's state carried over
    assert len({tuple(x) for x in got["lrs"]}) == K  # the warmup: each step its own LR
    assert set(got["model"]) == set(src["model"]) == set(got["optim"]) == set(src["optim"])
    for k, v in src["model"].items():
        torch.testing.assert_close(got["model"][k], v, rtol=tol["rtol"], atol=tol["model"])
    for fqn, entries in src["optim"].items():
        assert float(got["optim"][fqn]["step"]) == float(entries["step"]) == K0 + K
        for m in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(got["optim"][fqn][m], entries[m], rtol=tol["rtol"],
                                       atol=tol[m], msg=lambda s, f=fqn, m=m: f"{f}.{m}: {s}")


def _source(run: Path, cfg: str) -> dict[str, Any]:
    return dict(torch.load(run / f"{cfg}.cont.pt", weights_only=True))


@pytest.mark.parametrize("world", [2, 1])
@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_fsdp2_resume_matches_deepspeed(run: Path, cfg: str, world: int) -> None:
    _compare(_source(run, cfg), _resumed(run, cfg, world), bound(cfg, world))


@pytest.mark.parametrize("world", [2, 1])
def test_fsdp2_resume_matches_deepspeed_cpu_adam(cpu_adam_run: Path, world: int) -> None:
    _compare(_source(cpu_adam_run, CPU_ADAM_CONFIG),
             _resumed(cpu_adam_run, CPU_ADAM_CONFIG, world), CPU_ADAM)


def test_deepspeed_adam_groups_get_torch_adam_keys(cpu_adam_run: Path) -> None:
    """DeepSpeed's CPU Adam keeps lr, betas, eps, weight_decay, bias_correction in its groups;
    a torch AdamW asks dcp.load for its every key, so they are filled in with its defaults."""
    from ckpt_cli.ops.to_dcp.deepspeed import read_deepspeed

    st = read_deepspeed(cpu_adam_run / CPU_ADAM_CONFIG)
    opt = torch.optim.AdamW(fr.tiny_model().parameters())
    want = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    for group in st.param_groups:
        assert {k: group[k] for k in want if k not in ("lr", "betas", "weight_decay")} == {
            k: v for k, v in want.items() if k not in ("lr", "betas", "weight_decay")}
        assert group["betas"] == (0.9, 0.99) and "bias_correction" not in group
    assert any("torch's Adam defaults filled in" in n for n in st.notes)


@pytest.mark.parametrize(("cfg", "world"), [("z2-fp32", 2), ("z2-bf16", 1)])
def test_weights_only_resume_diverges(run: Path, cfg: str, world: int) -> None:
    """Where the bound is exact, and where it is loosest (BF16 at world 1)."""
    src, got = _source(run, cfg), _resumed(run, cfg, world, weights_only=True)
    assert got["lrs"] == src["lrs"]  # same schedule and data: only the moments differ
    assert got["step"] == K0
    worst = max(float((got["model"][k] - v).abs().max()) for k, v in src["model"].items())
    assert worst > 50 * BF16["model"], worst  # measured: 2e-2
    moved = max(float((got["optim"][n]["exp_avg"] - e["exp_avg"]).abs().max())
                for n, e in src["optim"].items())
    assert moved > 10 * BF16["exp_avg"], moved  # measured: 5e-2
