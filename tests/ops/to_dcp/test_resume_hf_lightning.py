"""``ckpt convert --to dcp`` proven by resuming, from HF Trainer and Lightning (issue 48).

Each framework trains a small model on CPU, saves its own checkpoint after K0 steps and
continues from it, recording after every step the parameters and optimizer state by FQN and
the LRs of the step (``tests/helpers/resume_recipes.py``). ckpt converts the checkpoint; the
FSDP2 (``fully_shard``) loop of ``tests/helpers/fsdp_resume.py`` resumes it on gloo at world 1
and 2 (``dcp.load`` + ``set_state_dict``, the LR scheduler's state) and trains the same K
steps on the same data. Both runs have two param groups with their own hyperparameters:

- HF Trainer: Trainer's own optimizer (fused AdamW) and groups (weight decay on the matrices,
  none on biases and LayerNorms: the two groups' FQNs interleave in the model), linear
  warmup-then-decay, gradient clipping off, a sequential sampler.
- Lightning: AdamW with the first Linear in one group (lr 1e-2, weight decay 0.1) and the
  rest in another (lr 5e-3, none), the warmup ``LambdaLR`` stepped every batch.

The resuming optimizer starts from placeholder hyperparameters, so each group's ``lr``,
``betas``, ``eps``, ``weight_decay`` and flags come from the converted ``param_groups``.

Bounds. World 1 in FP32 is exact, at every step: the same kernels on the same tensors. At
world 2 each rank's loss is the mean over its half of the batch and FSDP2 averages the two
gradients: sums in another order, a few FP32 ulps in the gradients. Measured after 5 steps:
Lightning 3.0e-8 absolute and 4.7e-7 relative at most on the parameters; HF Trainer 1.1e-8
absolute on every parameter but GPT-2's attention bias (``c_attn.bias``), whose key third gets
no gradient in exact arithmetic (softmax ignores a shift shared by every key): its gradient is
rounding noise (1e-12) that Adam divides by its own size, so the two runs' noise moves those
entries apart by up to 3.2e-6. The tests allow ``rtol=1e-5, atol=1e-7`` (and ``atol=1e-5`` on
``c_attn.bias``). Without the optimizer state (weights only) the parameters land 1e-3 and more
away: the moments matter, not only that they were written.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.requires_torch, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("transformers") is None
                                 or importlib.util.find_spec("lightning") is None,
                                 reason="transformers and lightning are needed")]

torch = pytest.importorskip("torch")

from tests.conftest import third_party_quiet  # noqa: E402
from tests.helpers import fsdp_resume as fr  # noqa: E402
from tests.helpers import resume_recipes as rr  # noqa: E402

BOUND = {"rtol": 1e-5, "atol": 1e-7}
LOOSE = {"hf": {"transformer.h.0.attn.c_attn.bias": 1e-5}, "lightning": {}}
STEPS = {"hf": (rr.HF_K0, rr.HF_K), "lightning": (rr.PL_K0, rr.PL_K)}


def _source(name: str, tmp: Path) -> dict[str, Any]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the torchrun ranks (OMP_NUM_THREADS=1): the same kernels
    try:
        with third_party_quiet():
            if name == "hf":
                ckpt = rr.hf_source(tmp / "out")
                run = rr.hf_continue(ckpt, tmp / "continued")
            else:
                ckpt = rr.pl_source(tmp / "ckpts")
                run = rr.pl_continue(ckpt)
    finally:
        torch.set_num_threads(threads)
    return {**run, "name": name, "dir": tmp, "ckpt": ckpt}


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Trainer's checkpoint-K0 and Trainer continuing from it."""
    return _source("hf", tmp_path_factory.mktemp("hf-resume"))


@pytest.fixture(scope="module")
def pl(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Lightning's step=K0.ckpt and Lightning continuing from it."""
    return _source("lightning", tmp_path_factory.mktemp("pl-resume"))


def _converted(run: dict[str, Any], layout: str) -> Path:
    import ckpt_cli

    out = run["dir"] / f"dcp-{layout}"
    if not out.exists():
        ckpt_cli.convert(run["ckpt"], out, to="dcp", dcp_layout=layout)
    return Path(out)


def _resumed(run: dict[str, Any], world: int, layout: str, weights_only: bool = False
             ) -> dict[str, Any]:
    tag = "weights" if weights_only else "full"
    out = run["dir"] / f"res-{tag}-{layout}-{world}.pt"
    if out.exists():  # another test ran it already
        return dict(torch.load(out, weights_only=True))
    return fr.resume(_converted(run, layout), out, world, layout=layout,
                     steps=STEPS[run["name"]][1], recipe=run["name"],
                     weights_only=weights_only)


def _close(got: torch.Tensor, want: torch.Tensor, fqn: str, loose: dict[str, float],
           tol: dict[str, float]) -> None:
    if fqn in loose and tol["atol"] > 0:
        tol = {**tol, "atol": loose[fqn]}
    torch.testing.assert_close(got, want, **tol)


def _compare(run: dict[str, Any], got: dict[str, Any], **tol: float) -> None:
    """``got`` (the FSDP2 run) equals ``run`` (the source continuing) at every step."""
    k0, k = STEPS[run["name"]]
    loose = LOOSE[run["name"]]
    assert got["step"] == k0
    assert got["lrs"] == run["lrs"]  # every group's LR at every resumed step, exactly
    assert len(got["trace"]) == len(run["trace"]) == k
    for mine, theirs in zip(got["trace"], run["trace"], strict=True):
        assert set(mine["model"]) == set(theirs["model"])
        for fqn, v in theirs["model"].items():
            _close(mine["model"][fqn], v, fqn, loose, tol)
        assert set(mine["optim"]) == set(theirs["optim"])
        for fqn, entries in theirs["optim"].items():
            assert set(mine["optim"][fqn]) == set(entries)
            for key, v in entries.items():
                _close(mine["optim"][fqn][key], v, fqn, loose, tol)


def _plain(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


def _check_groups(run: dict[str, Any], groups: list[dict[str, Any]], skip: set[str]) -> None:
    """``groups`` have the source's hyperparameters (but ``skip``) and FQNs, in order."""
    want = run["groups"]
    assert len(groups) == len(want) == 2
    assert want[0] != want[1]
    for mine, theirs in zip(groups, want, strict=True):
        assert {k: _plain(v) for k, v in mine.items() if k not in skip} == {
            k: _plain(v) for k, v in theirs.items() if k not in skip}


@pytest.mark.parametrize("layout", ["torchtitan", "recipe"])
def test_hf_trainer_world1_exact(hf: dict[str, Any], layout: str) -> None:
    _compare(hf, _resumed(hf, 1, layout), rtol=0, atol=0)


def test_hf_trainer_world2_within_bound(hf: dict[str, Any]) -> None:
    _compare(hf, _resumed(hf, 2, "torchtitan"), **BOUND)


@pytest.mark.parametrize("layout", ["torchtitan", "recipe"])
def test_lightning_world1_exact(pl: dict[str, Any], layout: str) -> None:
    _compare(pl, _resumed(pl, 1, layout), rtol=0, atol=0)


def test_lightning_world2_within_bound(pl: dict[str, Any]) -> None:
    _compare(pl, _resumed(pl, 2, "recipe"), **BOUND)


@pytest.mark.parametrize("framework", ["hf", "pl"])
def test_weights_only_diverges(framework: str, request: pytest.FixtureRequest) -> None:
    run = request.getfixturevalue(framework)
    got = _resumed(run, 1, "torchtitan", weights_only=True)
    assert got["lrs"] == run["lrs"]  # same schedule and data: only the moments differ
    last = run["trace"][-1]["model"]
    worst = max(float((got["model"][k] - v).abs().max()) for k, v in last.items())
    assert worst > 1e-3, worst  # far outside every bound above
    with pytest.raises(AssertionError):
        _compare(run, got, **BOUND)


@pytest.mark.parametrize("framework", ["hf", "pl"])
def test_param_groups_keep_hyperparameters_and_fqns(framework: str,
                                                    request: pytest.FixtureRequest) -> None:
    """The converted groups equal those the framework restores from its own checkpoint, and
    the FSDP2 run's groups took every hyperparameter from them (not the placeholders)."""
    import numpy as np
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    run = request.getfixturevalue(framework)
    flat = run["dir"] / "recipe.pt"
    rng = [np._core.multiarray._reconstruct, np.ndarray, np.dtype, np.dtypes.UInt32DType]
    with third_party_quiet(), torch.serialization.safe_globals(rng):  # Trainer's numpy RNG
        dcp_to_torch_save(_converted(run, "recipe"), flat)
        converted = torch.load(flat, weights_only=True)["optim"]["param_groups"]
    _check_groups(run, converted, skip=set())
    resumed = _resumed(run, 1, "recipe")["param_groups"]
    _check_groups(run, resumed, skip={"params", "lr"})  # lr: the schedule moved it since
    assert all(_plain(g[k]) != _plain(v) for g in resumed for k, v in fr.PLACEHOLDER.items()
               if k != "lr")
