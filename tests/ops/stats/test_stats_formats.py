"""``ckpt stats``' figures against torch's float64 computations, in every format.

Each checkpoint is written by the real library (torch.save, safetensors, huggingface_hub's
sharded writer, torch.distributed.checkpoint from a 2-process torchrun world, Lightning's
Trainer, transformers' Trainer, DeepSpeed ZeRO, ``ckpt convert --to fp8``), and each reference
is computed by torch, in float64, on the tensor as that library's own loader gives it back.
Counts (numel, zeros, NaN, Inf) must be exact; mean, std (``correction=1``), min, max, absmax
and L2 (over the finite values) within 1e-12 relative. The same weights saved in each format
give the same figures, per tensor and per module.
"""

from __future__ import annotations

import json
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
from tests.conftest import HAS_DEEPSPEED, requires_deepspeed, run_cli, third_party_quiet

pytestmark = pytest.mark.requires_torch

TORCHRUN = Path(sys.executable).with_name("torchrun")
HELPERS = Path(__file__).parents[2] / "helpers"
REL = 1e-12
COUNTS = ("numel", "zeros", "nan", "inf")
FLOATS = ("mean", "std", "min", "max", "absmax", "l2")


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing here writes to the user's cache, even a call that forgets ``--no-cache``."""
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
    res = stats(path, StatsOptions(cache=False, **opts))
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


@pytest.fixture(scope="module")
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


LIGHTNING = "state_dict.model."


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


FORMATS = ("pt", "pt-tied", "safetensors", "hf-sharded", "dcp", "lightning")
TIED = {"pt-tied": "", "lightning": LIGHTNING}


@pytest.mark.parametrize("kind", FORMATS)
def test_figures_equal_torch_float64(formats: dict[str, Path], kind: str,
                                     tmp_path: Path) -> None:
    """Per tensor and per module (own module, depth 1 and 2) the figures equal torch's
    float64 ones on what the format's loader returns; a tied name is reported with its
    storage's figures (``same_as``) and counted once in its module."""
    ref = loaded(kind, formats[kind], tmp_path)
    assert len(ref) == 21
    prefix = LIGHTNING if kind == "lightning" else ""
    for depth in (None, 1, 2):
        doc = stats_doc(formats[kind], depth=depth)
        assert doc["format"] == {"pt": "torch", "pt-tied": "torch", "lightning": "torch",
                                 "hf-sharded": "hf-index"}.get(kind, kind)
        assert doc["anomalies"] == [] and doc["scope"] == "weights"
        assert len(doc["tensors"]) == 21
        check_tensors(doc, ref)
        check_modules(doc, unique_storages(ref), depth, prefix)
    tensors = tensor_docs(doc)
    if kind in TIED:
        assert tensors[prefix + "head.weight"]["same_as"] == prefix + "embed.weight"
        assert "head" not in {m["name"].removeprefix(prefix) for m in doc["modules"]}
    else:
        assert all(t["same_as"] is None for t in doc["tensors"])
    # the embedding is larger than 1 MiB; the int64 counter is a buffer read as its value
    assert tensors[prefix + "embed.weight"]["numel"] * 4 > 1 << 20
    counter = tensors[prefix + "norm.num_batches_tracked"]
    assert (counter["dtype"], counter["group"], counter["mean"]) == ("I64", "buffer", 7.0)


def assert_same(what: str, got: Mapping[str, Any], want: Mapping[str, Any]) -> None:
    """Two reports' figures agree: counts exactly, moments within ``REL``, ``tiny`` too."""
    assert_figures(what, got, want)
    assert got["tiny"] == want["tiny"], f"{what}: tiny {got['tiny']} != {want['tiny']}"


def test_same_weights_same_figures_in_every_format(formats: dict[str, Path]) -> None:
    """One state dict saved as a torch zip, safetensors, HF shards, DCP (2 ranks), a tied
    torch zip and a Lightning checkpoint: the same figures per tensor, and per module at
    depth 1 and 2 (the tied ones among themselves: their head is counted once)."""
    base = {d: stats_doc(formats["pt"], depth=d) for d in (1, 2)}
    tied_base = {d: stats_doc(formats["pt-tied"], depth=d) for d in (1, 2)}
    for kind in FORMATS:
        prefix = LIGHTNING if kind == "lightning" else ""
        for d in (1, 2):
            doc = stats_doc(formats[kind], depth=d)  # the container prefix is no component
            want_t = tensor_docs(base[d])
            got_t = {k.removeprefix(prefix): v for k, v in tensor_docs(doc).items()}
            assert set(got_t) == set(want_t), kind
            for name, fig in got_t.items():
                assert_same(f"{kind}: {name}", fig, want_t[name])
            mods = module_docs(tied_base[d] if kind in TIED else base[d])
            got_m = {k.removeprefix(prefix): v for k, v in module_docs(doc).items()}
            assert set(got_m) == set(mods), (kind, d)
            for name, fig in got_m.items():
                assert fig["tensors"] == mods[name]["tensors"], (kind, name)
                assert_same(f"{kind}: module {name} (depth {d})", fig, mods[name])
    # the tie matters only to the roll-up: 'head' at depth 1 is missing where it is tied
    assert "head" in module_docs(base[1]) and "head" not in module_docs(tied_base[1])
    # and to what is read: the tied embedding's bytes once
    assert base[1]["read"]["bytes"] - tied_base[1]["read"]["bytes"] == 640 * 512 * 4


def test_cli_json_is_the_library_document(formats: dict[str, Path], tmp_path: Path) -> None:
    """``ckpt stats --json`` prints ``stats()``'s document (figures included), exit 0 on
    clean weights; the cache goes to the directory given, never elsewhere."""

    r = run_cli("stats", formats["dcp"], "--json", "--depth", "2", "--cache-dir",
                tmp_path / "cache")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    want = stats_doc(formats["dcp"], depth=2)
    for k in ("tensors", "modules", "anomalies", "format", "scope", "depth"):
        assert doc[k] == want[k], k
    assert any((tmp_path / "cache").rglob("*")), "nothing cached in --cache-dir"


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


@pytest.mark.parametrize("kind", ["pt", "dcp", "hf-sharded", "lightning"])
def test_small_windows_change_no_figure(formats: dict[str, Path], kind: str,
                                        monkeypatch: pytest.MonkeyPatch,
                                        tmp_path: Path) -> None:
    """Read in windows of 12,004 bytes (3,001 values: not a divisor of a row, of DCP's
    per-rank chunk or of anything else) within the smallest memory budget: the embedding
    takes 110 windows, each straddling pieces and chunk boundaries, and no figure changes
    beyond rounding (tensors and modules), still equal to torch's."""
    from ckpt_cli.storage.reads import MIN_MEMORY

    prefix = LIGHTNING if kind == "lightning" else ""
    depth = 2
    whole = stats_doc(formats[kind], depth=depth)
    sizes = _small_windows(monkeypatch, 12_004)
    doc = stats_doc(formats[kind], depth=depth, max_memory=MIN_MEMORY)
    doc_t = {k.removeprefix(prefix): v for k, v in tensor_docs(doc).items()}
    for name, fig in tensor_docs(whole).items():
        assert_same(f"{kind} in small windows: {name}", doc_t[name.removeprefix(prefix)], fig)
    got_m = {k.removeprefix(prefix): v for k, v in module_docs(doc).items()}
    for name, fig in module_docs(whole).items():
        assert_same(f"{kind} in small windows: module {name}", got_m[name.removeprefix(prefix)],
                    fig)
    check_tensors(doc, loaded(kind, formats[kind], tmp_path))
    embed = 640 * 512
    assert sizes.count(3001) >= embed // 3001, sizes[:20]
    assert max(sizes) == 3001


def test_small_windows_rechunk_16_bit_pieces(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """BF16 values read in pieces of ``window`` bytes hold twice the values a window takes:
    the windows re-cut the pieces (the ``_Window``), with the same figures as torch's."""
    from safetensors.torch import save_file

    sd = {k: v.to(torch.bfloat16) if v.is_floating_point() else v
          for k, v in untied(tiny_model().state_dict()).items()}
    save_file(sd, tmp_path / "bf16.safetensors")
    torch.save(sd, tmp_path / "bf16.pt")
    sizes = _small_windows(monkeypatch, 10_006)
    for f in ("bf16.safetensors", "bf16.pt"):
        doc = stats_doc(tmp_path / f, depth=1)
        check_tensors(doc, sd)
        check_modules(doc, sd, 1)
    assert max(sizes) == 2501 and sizes.count(2501) >= 2 * (640 * 512 // 2501)


# -- dtypes, non-finite values, integers ------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_weights(tmp_path: Path, dtype: torch.dtype) -> None:
    """BF16 and FP16 weights (from ``model.to(dtype)``): figures of the stored values widened
    exactly, the same from the torch zip and from safetensors, per tensor and module."""
    from safetensors.torch import load_file, save_file

    model = tiny_model().to(dtype)
    torch.save(model.state_dict(), tmp_path / "m.pt")
    save_file(untied(model.state_dict()), tmp_path / "m.safetensors")
    ref = load_file(tmp_path / "m.safetensors")
    assert ref["embed.weight"].dtype == dtype
    for f in ("m.pt", "m.safetensors"):
        doc = stats_doc(tmp_path / f, depth=2)
        want = "BF16" if dtype == torch.bfloat16 else "F16"
        assert tensor_docs(doc)["embed.weight"]["dtype"] == want
        check_tensors(doc, ref)
        check_modules(doc, unique_storages(torch.load(tmp_path / f, weights_only=True)), 2)
    # 1e-40 stays a (subnormal) BF16 value but underflows to zero in FP16
    assert tensor_docs(doc)["embed.weight"]["zeros"] == (1 if dtype == torch.float16 else 0)


def _poisoned(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's weights with NaN, +Inf and -Inf put into real tensors, and one tensor
    entirely NaN (no finite value at all)."""
    sd = {k: v.to(dtype) if v.is_floating_point() else v
          for k, v in untied(tiny_model().state_dict()).items()}
    w = sd["layers.1.mlp.fc.weight"]
    w[0, 0] = w[5, 3] = w[23, 15] = float("nan")
    w[1, 1] = w[2, 2] = float("inf")
    w[3, 3] = float("-inf")
    sd["embed.weight"][600, 100] = float("-inf")
    sd["layers.0.attn.q_proj.bias"].fill_(float("nan"))
    return sd


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_finite_values_are_counted_and_left_out(tmp_path: Path,
                                                    dtype: torch.dtype) -> None:
    """NaN and ±Inf are counted exactly and kept out of mean/std/min/max/absmax/L2 (torch's
    figures of the finite values); a tensor with no finite value has no moments; the CLI
    exits 1 with a ``nan`` and an ``inf`` anomaly naming the modules, and 0 on clean weights."""

    from safetensors.torch import save_file

    sd = _poisoned(dtype)
    save_file(sd, tmp_path / "bad.safetensors")
    torch.save(sd, tmp_path / "bad.pt")
    for f in ("bad.safetensors", "bad.pt"):
        doc = stats_doc(tmp_path / f)
        check_tensors(doc, sd)
        check_modules(doc, sd, None)
    fc = tensor_docs(doc)["layers.1.mlp.fc.weight"]
    assert (fc["nan"], fc["inf"], fc["numel"]) == (3, 3, 400)
    gone = tensor_docs(doc)["layers.0.attn.q_proj.bias"]
    assert gone["nan"] == 16 and gone["mean"] is None and gone["std"] is None
    r = run_cli("stats", tmp_path / "bad.safetensors", "--json", "--no-cache")
    assert r.exit_code == 1, r.output
    flagged = {(a["kind"], a["module"]) for a in json.loads(r.stdout)["anomalies"]}
    assert flagged == {("nan", "layers.1.mlp.fc"), ("inf", "layers.1.mlp.fc"),
                       ("nan", "layers.0.attn.q_proj"), ("inf", "embed")}
    save_file(untied(tiny_model().state_dict()), tmp_path / "good.safetensors")
    r = run_cli("stats", tmp_path / "good.safetensors", "--json", "--no-cache")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["anomalies"] == []


def test_filter_selects_by_glob(formats: dict[str, Path]) -> None:
    """``--filter`` keeps exactly the names the glob matches (fnmatch, ``*`` across dots),
    and the modules of those; one matching nothing is an input error (exit 2)."""
    import fnmatch

    names = list(tensor_docs(stats_doc(formats["safetensors"])))
    for glob in ("layers.*.mlp.*", "*.bias", "layers.1.*", "embed.weight"):
        r = run_cli("stats", formats["safetensors"], "--filter", glob, "--json", "--no-cache")
        assert r.exit_code == 0, r.output
        doc = json.loads(r.stdout)
        want = {n for n in names if fnmatch.fnmatchcase(n, glob)}
        assert want and set(tensor_docs(doc)) == want, glob
        assert {m["name"] for m in doc["modules"]} == {module_of(n, None) for n in want}
    r = run_cli("stats", formats["safetensors"], "--filter", "nothing.*", "--no-cache")
    assert r.exit_code == 2 and "nothing.*" in r.output


# -- optimizer state and other tensors (--all) ---------------------------------------------------

TINY = 2.0 ** -53


def _tiny(t: torch.Tensor) -> int:
    x = t.detach().reshape(-1).to(torch.float64)
    return int(((x != 0) & (x.abs() < TINY) & torch.isfinite(x)).sum())


def test_all_adds_adam_state_of_a_real_step(tmp_path: Path) -> None:
    """A training checkpoint after one real Adam step (torch.save of model, optimizer and an
    int32 counter): by default only the model's tensors and buffers; with ``everything``
    (``--all``) the optimizer's exp_avg / exp_avg_sq / step too, each equal to torch's figures
    of the loaded tensor. The embedding's exp_avg_sq holds exact zeros (rows no token used)
    and ``tiny`` values (a gradient of 1e-9 squared), counted as torch counts them."""

    model = tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ids = torch.tensor([3, 5, 5, 600])
    x = model.embed(ids)
    loss = x.sum() * 1e-9 + model.layers[0].mlp.fc(torch.randn(3, 16)).pow(2).sum()
    loss.backward()
    opt.step()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1,
                "counter": torch.arange(-5, 1000, dtype=torch.int32)}, tmp_path / "train.pt")
    ck = torch.load(tmp_path / "train.pt", weights_only=True)
    weights = {f"model.{k}": v for k, v in ck["model"].items()}
    state = {f"optimizer.state.{i}.{k}": v for i, s in ck["optimizer"]["state"].items()
             for k, v in s.items()}
    assert len(state) == 3 * 3  # the parameters the loss reached: exp_avg, exp_avg_sq, step

    doc = stats_doc(tmp_path / "train.pt")  # the integer counter is grouped as a buffer
    assert doc["scope"] == "weights" and set(tensor_docs(doc)) == set(weights) | {"counter"}
    assert tensor_docs(doc)["counter"]["group"] == "buffer"
    check_tensors(doc, weights)

    r = run_cli("stats", tmp_path / "train.pt", "--all", "--json", "--no-cache")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["scope"] == "all"
    assert set(tensor_docs(doc)) == set(weights) | set(state) | {"counter"}
    check_tensors(doc, {**weights, **state, "counter": ck["counter"]})
    embed = [k for k, v in state.items() if k.endswith("exp_avg_sq") and v.shape == (640, 512)]
    sq = state[embed[0]]
    got = tensor_docs(doc)[embed[0]]
    assert got["zeros"] == int((sq == 0).sum()) == 637 * 512
    assert got["tiny"] == _tiny(sq) == 3 * 512
    assert got["max"] == float(sq.max().double())
    counter = tensor_docs(doc)["counter"]
    assert (counter["dtype"], counter["min"], counter["max"]) == ("I32", -5.0, 999.0)


def test_hf_trainer_checkpoint_with_all(hf_trainer_dir: Path) -> None:
    """An HF Trainer checkpoint (transformers' own save: model.safetensors, optimizer.pt,
    rng_state.pth): model weights equal to safetensors' load, and with ``everything`` AdamW's
    state (per parameter index) and the RNG state's uint8 bytes equal to torch.load's."""
    from safetensors.torch import load_file

    ck = hf_trainer_dir / "checkpoint-4"
    model = load_file(ck / "model.safetensors")
    doc = stats_doc(ck, depth=3)
    assert set(tensor_docs(doc)) == set(model)
    check_tensors(doc, model)
    check_modules(doc, model, 3)
    opt = torch.load(ck / "optimizer.pt", weights_only=True)
    state = {f"optimizer.state.{i}.{k}": v for i, s in opt["state"].items()
             for k, v in s.items()}
    rng = torch.load(ck / "rng_state.pth", weights_only=False)
    full = stats_doc(ck, everything=True)
    assert full["scope"] == "all"
    check_tensors(full, {**model, **state, "rng_state.cpu": rng["cpu"]})
    sq = {k: v for k, v in state.items() if k.endswith("exp_avg_sq")}
    got = tensor_docs(full)
    assert sum(got[k]["zeros"] for k in sq) == sum(int((v == 0).sum()) for v in sq.values())
    assert sum(got[k]["tiny"] for k in sq) == sum(_tiny(v) for v in sq.values())


# -- FP8 ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fp8_outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``ckpt convert --to fp8`` of a tiny Llama (transformers' save) in the block, channel
    and tensor layouts (block leaves the 400-wide MLP in BF16: not whole 128-blocks)."""
    from tests.helpers.fp8 import convert_each_layout
    from tests.helpers.makers import tiny_llama

    with third_party_quiet():
        src = tiny_llama(tmp_path_factory.mktemp("llama") / "src", 400)
    return convert_each_layout(src, tmp_path_factory.mktemp("fp8"), "--max-shard-size",
                               "100KB")  # some scales in another shard than their weight


def dequantized(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``w.float() * scale`` in FP32, the scale broadcast per 128x128 block (a 2-D scale of
    more than one column), per row (``[rows, 1]``) or per tensor."""
    s = scale.float()
    if s.dim() == 2 and s.shape[1] != 1:
        s = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
    return w.float() * s


def fp8_reference(out: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The checkpoint's values as ckpt should read them: FP8 weights dequantized with their
    scale, scales not on their own; and which scale each FP8 weight was dequantized with."""
    from tests.helpers.loads import safetensors_dir

    raw = safetensors_dir(out)
    ref: dict[str, torch.Tensor] = {}
    scales: dict[str, str] = {}
    for name, t in raw.items():
        if name.endswith(("_scale", "_scale_inv")):
            continue
        if t.dtype == torch.float8_e4m3fn:
            key = next(name + s for s in ("_scale_inv", "_scale") if name + s in raw)
            ref[name] = dequantized(t, raw[key])
            scales[name] = key
        else:
            ref[name] = t
    return ref, scales


@pytest.mark.parametrize("layout", ["block", "channel", "tensor"])
def test_fp8_figures_are_of_the_dequantized_values(fp8_outputs: dict[str, Path], layout: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """FP8 outputs of ``ckpt convert --to fp8``: each FP8 weight's figures are those of
    ``w.float() * scale`` (broadcast per block, row or tensor; FP32, then float64), the scale
    named in ``dequantized_with`` and not reported on its own; modules roll up the dequantized
    values; reading in windows of 1,000 bytes (250 values: across rows, blocks and pieces)
    changes nothing."""
    out = fp8_outputs[layout]
    ref, scales = fp8_reference(out)
    assert len(scales) == (8 if layout == "block" else 14)
    where = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    split = any(where[w] != where[s] for w, s in scales.items())
    assert split == (layout != "block")  # the block layout's writer keeps the pairs together
    doc = stats_doc(out, depth=3)
    got = tensor_docs(doc)
    assert set(got) == set(ref)
    check_tensors(doc, ref)
    check_modules(doc, ref, 3)
    for name, t in got.items():
        assert t["dequantized_with"] == scales.get(name), name
        assert t["dtype"] == ("F8_E4M3" if name in scales else "BF16"), name
    sizes = _small_windows(monkeypatch, 1000)
    small = stats_doc(out, depth=3)
    assert max(sizes) == 250 and len(sizes) > 4 * 128 * 256 // 250
    for name, fig in tensor_docs(small).items():
        assert_same(f"{layout} in small windows: {name}", fig, got[name])
    for name, fig in module_docs(small).items():
        assert_same(f"{layout} in small windows: module {name}", fig, module_docs(doc)[name])


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
    full = stats_doc(tag, everything=True)
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
    doc = stats_doc(tmp_path / "d.safetensors", everything=True)
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
    doc = stats(run, StatsOptions(cache=False)).json_body()
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
