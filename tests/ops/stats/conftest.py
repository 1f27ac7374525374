"""Fixtures and helpers the stats_formats test modules share."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt_cli.ops.stats import StatsOptions, stats
from ckpt_cli.ops.stats.result import container_prefix, module_of
from tests.conftest import third_party_quiet

TORCHRUN = Path(sys.executable).with_name("torchrun")
HELPERS = Path(__file__).parents[2] / "helpers"
REL = 1e-12
COUNTS = ("numel", "zeros", "nan", "inf")
FLOATS = ("mean", "std", "min", "max", "absmax", "l2")


@pytest.fixture
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing here writes to the user's cache, even a call that forgets ``--no-cache``
    (the modules that want it list it in their ``pytestmark``)."""
    monkeypatch.setenv("CKPT_CACHE_DIR", str(tmp_path / "ckpt-cache"))


# -- references ---------------------------------------------------------------------------


def ref_figures(values: Iterable[torch.Tensor]) -> dict[str, Any]:
    """torch's float64 figures of the values of ``values`` together (one tensor, or a
    module's tensors concatenated): counts over all values, moments over the finite ones."""
    x = torch.cat([v.detach().reshape(-1).to(torch.float64) for v in values])
    finite = x[torch.isfinite(x)]
    n = finite.numel()
    return {
        "numel": x.numel(),
        "zeros": int((x == 0).sum()),
        "nan": int(torch.isnan(x).sum()),
        "inf": int(torch.isinf(x).sum()),
        "mean": float(finite.mean()) if n else None,
        "std": _std(finite),
        "min": float(finite.min()) if n else None,
        "max": float(finite.max()) if n else None,
        "absmax": float(finite.abs().max()) if n else None,
        "l2": float(torch.linalg.vector_norm(finite)),
    }


def _std(finite: torch.Tensor) -> float | None:
    """``std(correction=1)`` in float64, two-pass: ``sqrt(sum((x - mean)**2) / (n - 1))``.

    Not ``torch.std``: on a real Adam ``exp_avg`` (326,144 zeros and 1,536 values near 1e-10)
    its float64 result is 3.2e-12 relative off the exact value (computed with fractions),
    while the two-pass sum is within 1e-15 of it (and ckpt's within 3e-14).
    """
    n = finite.numel()
    if n < 2:
        return None
    d = finite - finite.mean()
    return math.sqrt(float((d * d).sum()) / (n - 1))


def assert_figures(what: str, got: Mapping[str, Any], want: Mapping[str, Any]) -> None:
    """Counts exact, moments within ``REL`` relative; a failure names ``what`` and the figure."""
    for k in COUNTS:
        assert got[k] == want[k], f"{what}: {k} is {got[k]!r}, torch says {want[k]!r}"
    for k in FLOATS:
        g, w = got[k], want[k]
        if w is None:
            assert g is None, f"{what}: {k} is {g!r}, torch says there is none"
            continue
        assert g is not None, f"{what}: {k} is missing, torch says {w!r}"
        assert math.isclose(g, w, rel_tol=REL), (
            f"{what}: {k} is {g!r}, torch says {w!r} (relative error "
            f"{abs(g - w) / max(abs(w), 1e-300):.3g})")


def tensor_docs(doc: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["name"]: t for t in doc["tensors"]}


def module_docs(doc: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["name"]: m for m in doc["modules"]}


def stats_doc(path: Path, **opts: Any) -> dict[str, Any]:
    """``stats()``'s ``--json`` document (no cache)."""
    res = stats(path, StatsOptions(no_cache=True, **opts))
    return res.json_body()


def check_tensors(doc: Mapping[str, Any], ref: Mapping[str, torch.Tensor],
                  rename: Mapping[str, str] | None = None) -> None:
    """Every tensor of ``ref`` (by its name in the checkpoint: ``rename`` maps ref names to
    them) is in ``doc`` with torch's figures."""
    got = tensor_docs(doc)
    for name, t in ref.items():
        shown = (rename or {}).get(name, name)
        assert shown in got, f"{shown} not reported; got {sorted(got)}"
        assert got[shown].get("error") is None, f"{shown}: {got[shown]['error']}"
        assert_figures(shown, got[shown], ref_figures([t]))


def check_modules(doc: Mapping[str, Any], ref: Mapping[str, torch.Tensor],
                  depth: int | None, prefix: str | None = None) -> None:
    """The module roll-up equals torch's figures of each module's tensors concatenated (tied
    tensors once: ``ref`` holds each storage under one name only); module names and depth
    leave out the container ``prefix`` (default: the wrappers every name carries)."""
    if prefix is None:
        prefix = container_prefix(list(ref))
    groups: dict[str, list[torch.Tensor]] = {}
    for name, t in ref.items():
        groups.setdefault(module_of(name.removeprefix(prefix), depth), []).append(t)
    got = module_docs(doc)
    assert set(got) == set(groups), f"modules {sorted(got)}, expected {sorted(groups)}"
    for mod, ts in groups.items():
        assert got[mod]["tensors"] == len(ts), f"module {mod}: {got[mod]['tensors']} tensors"
        assert_figures(f"module {mod} (depth {depth})", got[mod], ref_figures(ts))


# -- one model, every format -------------------------------------------------------------------


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = torch.nn.Module()
        self.attn.q_proj = torch.nn.Linear(16, 16)
        self.mlp = torch.nn.Module()
        self.mlp.fc = torch.nn.Linear(16, 25)  # odd rows: replicated in DCP
        self.ln = torch.nn.LayerNorm(16)


class Tiny(torch.nn.Module):
    """Embedding 640x512 (1.25 MiB: read in several windows) tied to the head, two blocks, a
    BatchNorm (FP32 running statistics and an int64 ``num_batches_tracked`` buffer)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(640, 512)
        self.down = torch.nn.Linear(512, 16)
        self.layers = torch.nn.ModuleList([Block(), Block()])
        self.norm = torch.nn.BatchNorm1d(16)
        self.head = torch.nn.Linear(512, 640, bias=False)
        self.head.weight = self.embed.weight  # tied


def tiny_model() -> Tiny:
    """:class:`Tiny` with values that test the arithmetic: a LayerNorm weight within 1e-6 of 1
    (cancellation in ``sum(x**2) - n*mean**2``), exact zeros of both signs, a huge and a
    subnormal value, a zero bias, a running variance and a counter."""
    torch.manual_seed(41)
    m = Tiny()
    with torch.no_grad():
        m.layers[0].ln.weight.copy_(1 + 1e-6 * torch.randn(16))
        m.down.weight[:3] = 0.0
        m.down.weight[3, :5] = -0.0
        m.embed.weight[7, 9] = 3.0e4
        m.embed.weight[8, 1] = 1.0e-40  # FP32 subnormal
        m.layers[1].mlp.fc.bias.zero_()
        m.norm.running_mean.copy_(torch.randn(16))
        m.norm.running_var.copy_(torch.rand(16) + 0.5)
        m.norm.num_batches_tracked.fill_(7)
    return m


def untied(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every tensor its own contiguous storage (what safetensors and DCP store)."""
    return {k: v.detach().clone().contiguous() for k, v in sd.items()}


def unique_storages(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``sd`` with a tied tensor under its first name only."""
    seen: set[tuple[int, int]] = set()
    out = {}
    for k, v in sd.items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset())
        if key not in seen:
            seen.add(key)
            out[k] = v
    return out


def torchrun(n: int, *argv: str) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parents[3]))
    p = subprocess.run([str(TORCHRUN), "--standalone", f"--nproc-per-node={n}", *argv],
                       capture_output=True, text=True, env=env, timeout=300, check=False)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]


def lightning_save(model: torch.nn.Module, path: Path) -> None:
    """A Lightning checkpoint of ``model`` saved by ``Trainer.save_checkpoint`` after a fit of
    one batch whose ``training_step`` skips the step (the weights stay as they were)."""
    import lightning as L

    class Wrap(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: Any, _i: int) -> None:
            return None  # Lightning skips the optimizer step

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(2, 1)))
    trainer = L.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)
    trainer.fit(Wrap(), data)
    trainer.save_checkpoint(path)


@pytest.fixture(scope="session")
def formats(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same weights in every format: torch zip (tied), torch zip (untied), safetensors,
    HF-sharded safetensors, DCP from a 2-rank torchrun world, a Lightning checkpoint (tied)."""
    from safetensors.torch import save_file

    from tests.helpers.makers import hf_sharded

    d = tmp_path_factory.mktemp("same")
    model = tiny_model()
    sd = model.state_dict()
    plain = untied(sd)
    out = {"pt-tied": d / "tied.pt", "pt": d / "plain.pt", "safetensors": d / "model.safetensors",
           "hf-sharded": d / "hf", "dcp": d / "dcp", "lightning": d / "model.ckpt"}
    torch.save(sd, out["pt-tied"])
    torch.save(plain, out["pt"])
    save_file(plain, out["safetensors"])
    out["hf-sharded"].mkdir()
    hf_sharded(out["hf-sharded"], plain, max_shard_size=300_000)
    torchrun(2, str(HELPERS / "dcp_save_sd.py"), str(out["pt"]), str(out["dcp"]))
    with third_party_quiet():
        lightning_save(model, out["lightning"])
    return out


def loaded(kind: str, path: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as its own library's loader gives them, under the names
    ``ckpt`` shows (tied tensors still share storage where the loader keeps them shared)."""
    from safetensors.torch import load_file

    from tests.helpers.loads import safetensors_dir

    if kind in ("pt", "pt-tied"):
        return dict(torch.load(path, weights_only=True))
    if kind == "safetensors":
        return load_file(path)
    if kind == "hf-sharded":
        return safetensors_dir(path)
    if kind == "dcp":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with third_party_quiet():
            dcp_to_torch_save(path, tmp / "dcp.pt")
        return dict(torch.load(tmp / "dcp.pt", weights_only=True))
    if kind == "lightning":
        ckpt = torch.load(path, weights_only=False)
        return {f"state_dict.{k}": v for k, v in ckpt["state_dict"].items()}
    raise AssertionError(kind)


def assert_same(what: str, got: Mapping[str, Any], want: Mapping[str, Any]) -> None:
    """Two reports' figures agree: counts exactly, moments within ``REL``, ``tiny`` too."""
    assert_figures(what, got, want)
    assert got["tiny"] == want["tiny"], f"{what}: tiny {got['tiny']} != {want['tiny']}"


# -- windows -------------------------------------------------------------------------------------


def _small_windows(monkeypatch: pytest.MonkeyPatch, window: int) -> list[int]:
    """Make the engine read in windows of ``window`` bytes (pieces of as many); returns a
    list that collects the size of every window the kernel is given."""
    from ckpt_cli.ops.stats import engine

    monkeypatch.setattr(engine, "_MIN_WINDOW", 64)
    monkeypatch.setattr(engine, "PIECE_BYTES", window)
    sizes: list[int] = []
    real = engine.piece_moments

    def counting(arr: Any) -> Any:
        sizes.append(arr.size)
        return real(arr)

    monkeypatch.setattr(engine, "piece_moments", counting)
    return sizes


# -- optimizer state and other tensors (--all) ---------------------------------------------------

TINY = 2.0 ** -53


def _tiny(t: torch.Tensor) -> int:
    x = t.detach().reshape(-1).to(torch.float64)
    return int(((x != 0) & (x.abs() < TINY) & torch.isfinite(x)).sum())


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The figure cache of this test (never the user's)."""
    d = tmp_path / "cache"
    monkeypatch.setenv("CKPT_CACHE_DIR", str(d))
    return d
