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
from pathlib import Path

import pytest
import torch

from tests.conftest import run_cli
from tests.ops.stats.conftest import (
    _small_windows,
    assert_same,
    check_modules,
    check_tensors,
    loaded,
    module_docs,
    stats_doc,
    tensor_docs,
    tiny_model,
    unique_storages,
    untied,
)

# Every test here has a private stats cache (conftest.py).
pytestmark = [pytest.mark.requires_torch, pytest.mark.usefixtures("_private_cache")]


LIGHTNING = "state_dict.model."


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
