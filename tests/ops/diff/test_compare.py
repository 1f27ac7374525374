"""Value comparison and the symmetry of ``diff``, property-tested on real files."""

from __future__ import annotations

import math
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from ckpt_cli.formats import read_index
from ckpt_cli.ops.diff import DiffOptions, diff
from ckpt_cli.ops.diff.compare import EXACT, compare_values, default_tolerance, work_dtype
from ckpt_cli.ops.diff.result import DiffResult
from ckpt_cli.tensors.source import TensorSource

pytestmark = pytest.mark.requires_torch

_SETTINGS = settings(max_examples=100, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])


def test_default_tolerances() -> None:
    assert default_tolerance("F32", "F32") == EXACT
    assert default_tolerance("BF16", "BF16") == EXACT
    f16 = default_tolerance("F32", "F16")
    assert (f16.rtol, f16.atol, f16.source) == (2.0 ** -10, 2.0 ** -24, "dtype:F16")
    assert default_tolerance("F16", "F32") == f16
    bf = default_tolerance("BF16", "F32")
    assert bf.rtol == 2.0 ** -7 and bf.source == "dtype:BF16"
    # FP16 vs BF16: BF16's precision, FP16's (larger) subnormal floor.
    mixed = default_tolerance("F16", "BF16")
    assert mixed.rtol == 2.0 ** -7 and mixed.atol == 2.0 ** -24
    assert default_tolerance("F32", "F8_E4M3").rtol == 0.125
    # The user's values replace the defaults one by one; integers stay exact regardless.
    assert default_tolerance("F32", "F16", rtol=0.1) == type(f16)(0.1, 2.0 ** -24, "user")
    assert default_tolerance("F32", "F32", atol=1e-6).rtol == 0.0
    assert default_tolerance("I64", "I32", rtol=1.0, atol=1.0) == EXACT
    assert work_dtype("BF16", "F32") == "F32" and work_dtype("F32", "F64") == "F64"
    assert work_dtype("I64", "F16") == "F64" and work_dtype("C64", "F32") == "C128"


_KINDS = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16,
          "i64": torch.int64, "bool": torch.bool}
_FATES = ("same", "nudge", "big", "nan", "half", "reshape", "only_a", "only_b")


def _tensor(kind: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    if kind == "bool":
        return torch.rand(shape, generator=g) > 0.5
    if kind == "i64":
        return torch.randint(-5, 5, shape, generator=g)
    return torch.randn(shape, generator=g).to(_KINDS[kind])


@st.composite
def checkpoint_pairs(draw: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Two state dicts sharing some tensors, each shared one changed in some way."""
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 16)))
    a: dict[str, torch.Tensor] = {}
    b: dict[str, torch.Tensor] = {}
    for i in range(draw(st.integers(0, 6))):
        name = f"layers.{i}.{draw(st.sampled_from(['weight', 'bias', 'running_mean']))}"
        kind = draw(st.sampled_from(sorted(_KINDS)))
        shape = draw(st.sampled_from([(), (5,), (3, 4)]))
        t = _tensor(kind, shape, g)
        fate = draw(st.sampled_from(_FATES))
        floating = t.is_floating_point()
        u = t.clone()
        if fate == "nudge" and floating:
            u = t * (1 + 1e-3 * torch.randn(shape, generator=g)).to(t.dtype)
        elif fate == "big":
            u = ~t if kind == "bool" else t * 2 + 1
        elif fate == "nan" and floating and t.numel():
            t.view(-1)[0] = float("nan")
            if draw(st.booleans()):
                u.view(-1)[0] = float("nan")
            if t.numel() > 1 and draw(st.booleans()):
                t.view(-1)[-1] = u.view(-1)[-1] = float("inf")
        elif fate == "half" and floating:
            u = t.half() if t.dtype != torch.float16 else t.float()
        elif fate == "reshape":
            u = t.reshape(-1) if t.dim() != 1 else t.reshape(1, -1)
        if fate != "only_b":
            a[name] = t
        if fate != "only_a":
            b[name] = u.contiguous()
    pa, pb = draw(st.sampled_from([("", ""), ("module.", ""), ("", "model."),
                                   ("model.", "model.")]))
    return {pa + k: v for k, v in a.items()}, {pb + k: v for k, v in b.items()}


def _mirror(text: str) -> str:
    return text.replace("only in A", "@").replace("only in B", "only in A").replace(
        "@", "only in B")


def _assert_mirrored(r1: DiffResult, r2: DiffResult) -> None:
    assert r1.equal == r2.equal
    assert sorted(_mirror(d) for d in r1.differences()) == sorted(r2.differences())

    def only(items: list[Any]) -> list[tuple[Any, ...]]:
        return [(o.name, o.dtype, o.shape, o.tied_to) for o in items]

    assert only(r1.only_a) == only(r2.only_b) and only(r1.only_b) == only(r2.only_a)
    flip = {"a": "b", "b": "a"}
    assert sorted((flip[x.side], x.prefix, x.tensors, x.source) for x in r1.renames) == sorted(
        (x.side, x.prefix, x.tensors, x.source) for x in r2.renames)
    t1, t2 = {t.name: t for t in r1.tensors}, {t.name: t for t in r2.tensors}
    assert t1.keys() == t2.keys()
    for name, x in t1.items():
        y = t2[name]
        assert (x.status, x.tolerance, x.reason) == (y.status, y.tolerance, y.reason), name
        assert (x.dtype_a, x.shape_a, x.dtype_b, x.shape_b) == (y.dtype_b, y.shape_b,
                                                                y.dtype_a, y.shape_a)
        if x.stats is None:
            assert y.stats is None
            continue
        s, u = x.stats, y.stats
        assert u is not None
        assert (s.elements, s.changed, s.outside, s.nonfinite_mismatches,
                s.nonfinite_matched) == (u.elements, u.changed, u.outside,
                                         u.nonfinite_mismatches, u.nonfinite_matched)
        assert (s.max_abs, s.mean_abs, s.norm_diff) == (u.max_abs, u.mean_abs, u.norm_diff)
        assert (s.norm_a, s.norm_b) == (u.norm_b, u.norm_a)
        assert s.rel_l2 == u.rel_l2 or (math.isnan(s.rel_l2) and math.isnan(u.rel_l2))
    status = {"changed": "changed", "only_in_a": "only_in_b", "only_in_b": "only_in_a"}
    assert sorted((m.key, repr(m.b), repr(m.a), status[m.status]) for m in r1.metadata) == \
        sorted((m.key, repr(m.a), repr(m.b), m.status) for m in r2.metadata)


@_SETTINGS
@given(pair=checkpoint_pairs(), everything=st.booleans(), values=st.booleans(),
       tol=st.sampled_from([(None, None), (1e-2, None), (None, 0.5), (0.0, 0.0)]))
def test_diff_is_symmetric(pair: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]],
                           everything: bool, values: bool,
                           tol: tuple[float | None, float | None]) -> None:
    a, b = pair
    opts = DiffOptions(all_tensors=everything, structure_only=not values, rtol=tol[0],
                       atol=tol[1], block=3)
    with tempfile.TemporaryDirectory() as d:
        pa, pb = Path(d) / "a.pt", Path(d) / "b.safetensors"
        torch.save({**a, "step": 1}, pa)
        save_file(b, str(pb), metadata={"step": "2"})
        r1, r2 = diff(pa, pb, opts), diff(pb, pa, opts)
    _assert_mirrored(r1, r2)
    common = {t.name for t in r1.tensors}
    assert common | {o.name for o in r1.only_a} == common | {o.name for o in r2.only_b}


@_SETTINGS
@given(kind_a=st.sampled_from(sorted(_KINDS)), kind_b=st.sampled_from(sorted(_KINDS)),
       n=st.integers(0, 40), seed=st.integers(0, 2 ** 16), block=st.integers(1, 9),
       specials=st.booleans())
def test_blocks_do_not_change_the_result(kind_a: str, kind_b: str, n: int, seed: int,
                                         block: int, specials: bool) -> None:
    g = torch.Generator().manual_seed(seed)
    x = _tensor(kind_a, (n,), g)
    y = (x.to(_KINDS[kind_b]) if kind_b != "bool" else x != 0).clone()
    if y.is_floating_point() and n:
        y += (torch.rand(n, generator=g) > 0.7).to(y.dtype)
        if specials:
            y[0] = float("nan")
            if x.is_floating_point():
                x[n // 2] = y[n // 2] = float("inf")
    with tempfile.TemporaryDirectory() as d:
        save_file({"x": x}, str(Path(d) / "a.safetensors"))
        save_file({"y": y}, str(Path(d) / "b.safetensors"))
        ia, ib = read_index(Path(d) / "a.safetensors"), read_index(Path(d) / "b.safetensors")
        tol = default_tolerance(ia.tensors["x"].dtype, ib.tensors["y"].dtype)
        with TensorSource(ia) as sa, TensorSource(ib) as sb:
            whole = compare_values(sa, ia.tensors["x"], sb, ib.tensors["y"], tol, block=1 << 20)
            parts = compare_values(sa, ia.tensors["x"], sb, ib.tensors["y"], tol, block=block)
    assert (whole.changed, whole.outside, whole.nonfinite_mismatches, whole.max_abs) == (
        parts.changed, parts.outside, parts.nonfinite_mismatches, parts.max_abs)
    for field in ("mean_abs", "norm_a", "norm_b", "norm_diff"):
        assert getattr(parts, field) == pytest.approx(getattr(whole, field), rel=1e-6)
    # Independent check of the verdict with torch, element by element.
    xd, yd = x.double(), y.double()
    both_nan = xd.isnan() & yd.isnan()
    same = (xd == yd) | both_nan
    assert whole.changed == int((~same).sum())


def test_values_compared_chunk_by_chunk_from_dcp(sample_run: Path, tmp_path: Path) -> None:
    # Chunked DCP tensors are streamed (or assembled whole), then walked in blocks.
    # A copy: the same directory on both sides would be answered without reading.
    copy = tmp_path / "copy"
    shutil.copytree(sample_run / "step_000400", copy)
    r = diff(sample_run / "step_000400", copy, DiffOptions(all_tensors=True, block=100))
    assert r.equal and all(t.status == "identical" for t in r.tensors)
    assert any(len(r.index_a.tensors[t.name_a].chunks) > 1 for t in r.tensors)
