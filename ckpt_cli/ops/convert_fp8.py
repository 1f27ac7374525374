"""``convert``'s FP8 steps: ``--to fp8`` (quantize) and ``--dequantize``, one call each from
:func:`ckpt_cli.ops.convert.convert`.

The numbers (scales, rounding, which tensors qualify, the ``quantization_config``) are
:mod:`ckpt_cli.fp8`'s; this module rewires a conversion's output tensors and its copied
``config.json``.
"""

from __future__ import annotations

import glob
import json
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from ckpt_cli import fp8
from ckpt_cli.errors import CkptError, UsageError
from ckpt_cli.writers import OutTensor

if TYPE_CHECKING:
    import numpy as np

    from ckpt_cli.tensors.cast import CastPlan

FP8_DTYPES = ("F8_E4M3", "F8_E5M2")


class _Built(Protocol):
    """What these steps use of a conversion's outputs (``convert``'s ``_Built``; declared
    here so that this module does not import another op module)."""

    outs: list[OutTensor]
    aliases: dict[str, str]
    casts: Counter[str]
    plan: CastPlan
    meta: dict[str, str]
    notes: list[str]

    @property
    def close(self) -> Callable[[], None]: ...


B = TypeVar("B", bound=_Built)


def wanted(to: str, layout: str) -> bool:
    """Whether ``--to`` asks for FP8 (then ``layout`` must be one of :data:`fp8.LAYOUTS`)."""
    if to != "fp8":
        return False
    if layout not in fp8.LAYOUTS:
        raise UsageError(f"fp8_layout must be block, channel or tensor, not {layout!r}",
                         param="fp8_layout")
    return True


def check_usage(quant: bool, dequantize: bool, target: str | None, fmt: str) -> None:
    """Refuse FP8 options that do not go together (before any work)."""
    if dequantize and (quant or target is None):
        raise UsageError("dequantize needs to bf16, fp16 or fp32", param=("dequantize", "to"))
    if quant and fmt != "safetensors":
        raise UsageError("to fp8 writes safetensors (an HF directory); not fmt pt",
                         param=("to", "fmt"))


def quantized(built: B, build: Callable[[tuple[str, ...]], B], keep_fp32: tuple[str, ...],
              layout: str, src: Path) -> tuple[B, dict[str, Any]]:
    """The conversion's outputs with the qualifying weights quantized, and the
    ``quantization_config``.

    The weights to quantize are read in FP32 (not rounded to BF16 first): the outputs are
    built again (``build``) with them kept, then each becomes an FP8 weight and its scale.
    ``built`` is closed when replaced (and on error).

    Args:
        built: The outputs built with the ``--to bf16`` plan.
        build: Builds the outputs again with more ``--keep-fp32`` globs.
        keep_fp32: The user's ``--keep-fp32`` globs.
        layout: ``block``, ``channel`` or ``tensor``.
        src: The source, for messages.

    Raises:
        UsageError: The source already holds FP8 tensors.
    """
    held = [o.name for o in built.outs if o.dtype in FP8_DTYPES]
    if held:
        built.close()
        raise UsageError(f"{src} already holds {len(held)} FP8 tensor(s) (e.g. {held[0]})",
                         hint="dequantize first: ckpt convert SRC --to bf16 --dequantize")
    picked, ignore, fp8_notes = _pick(built, layout)
    if picked:
        before = built.casts
        built.close()
        built = build(keep_fp32 + tuple(glob.escape(n) for n in picked))
        for key in [k for k in built.casts if k.endswith("->F32")]:
            # read in FP32 only to be quantized: count the casts --keep-fp32 made
            built.casts[key] = before.get(key, 0)
        built.casts += Counter()  # drops the zero counts
    built.notes.extend(fp8_notes)
    quant_config = _outs(built, picked, ignore, layout)
    built.meta["ckpt.conversion"] = built.meta.get("ckpt.conversion", "").replace(
        "to=bf16", f"to=fp8 ({layout})", 1)
    built.meta["ckpt.quantization_config"] = json.dumps(quant_config, sort_keys=True)
    return built, quant_config


def dequantized(built: _Built, target: str, src: Path) -> None:
    """Replace each FP8 weight and its scale by the dequantized weight, in place (``built``
    is closed on error: a weight without a scale, a scale that fits no convention)."""
    try:
        _dequantized_outs(built, target, src)
    except CkptError:
        built.close()
        raise


def is_scale(name: str, quant_config: dict[str, Any] | None) -> bool:
    """Whether output ``name`` is a scale written by quantization (not a ``--keep-fp32``
    tensor, for the note about the config's dtype)."""
    return quant_config is not None and name.endswith(".weight_scale")


def config_files(side: dict[str, bytes], quant_config: dict[str, Any] | None,
                 dequantize: bool, target: str | None, notes: list[str]) -> None:
    """Set (quantized) or remove (dequantized) the copied ``config.json``'s
    ``quantization_config``; without a ``config.json``, say where the config went."""
    if target is not None and "config.json" in side:
        if quant_config is not None or dequantize:
            side["config.json"] = with_quantization_config(side["config.json"], quant_config)
    elif quant_config is not None:
        notes.append("no config.json beside the source: the quantization_config an engine "
                     "needs in the model's config.json is in the shards' metadata "
                     "(ckpt.quantization_config)")


def _pick(built: _Built, layout: str) -> tuple[list[str], list[str], list[str]]:
    """The output names to quantize, the ignore list (modules of Linear-like weights left
    unquantized; ``lm_head`` always, tied or not), and notes naming what was left."""
    picked: list[str] = []
    notes: list[str] = []
    ignore: list[str] = []
    for o in built.outs:
        ok, reason = fp8.qualifies(o.name, o.dtype, o.shape, layout)
        if ok:
            picked.append(o.name)
        elif reason is not None and reason not in ("embedding", "norm"):
            ignore.append(o.name[: -len(".weight")])
            if not reason.startswith("output head"):
                notes.append(f"{o.name} ({reason})")
    ignore.extend(a[: -len(".weight")] for a in built.aliases if a.endswith(".weight")
                  and fp8.skip_reason(a[: -len(".weight")]) == "output head (lm_head)")
    if not any(m.rpartition(".")[2] == "lm_head" for m in ignore):
        ignore.append("lm_head")
    if notes:
        shown = "; ".join(notes[:3]) + (f"; and {len(notes) - 3} more" if len(notes) > 3
                                         else "")
        notes = [f"{len(notes)} Linear weight(s) left unquantized, listed in the "
                 f"quantization_config's ignore list: {shown}"]
    return picked, sorted(set(ignore)), notes


def _outs(built: _Built, picked: list[str], ignore: list[str],
              layout: str) -> dict[str, Any]:
    """Replace each picked output (read in FP32) by its FP8 weight and scale, in place."""
    chosen = set(picked)
    outs: list[OutTensor] = []
    for o in built.outs:
        if o.name not in chosen:
            outs.append(o)
            continue
        q = fp8.Quantized(o.load, layout, o.name, pieces=o.pieces, shape=o.shape)
        module = o.name[: -len(".weight")]
        outs.append(OutTensor(o.name, "F8_E4M3", o.shape, q.weight, q.weight_pieces))
        outs.append(OutTensor(f"{module}.{fp8.scale_name(layout)}", "F32",
                              fp8.scale_shape(o.shape, layout), q.scale))
    built.outs[:] = outs
    if picked:
        built.casts["->F8_E4M3"] = len(picked)
    listed = ", ".join(ignore[:5]) + (f" and {len(ignore) - 5} more" if len(ignore) > 5
                                      else "")
    built.notes.append(f"quantized {len(picked)} weight(s) to FP8 E4M3 ({layout} layout), "
                       f"the rest cast to BF16; ignore list: {listed}")
    return fp8.quantization_config(layout, ignore)


def with_quantization_config(data: bytes, qc: dict[str, Any] | None) -> bytes:
    """``config.json`` with ``quantization_config`` set to ``qc`` (None: removed;
    re-serialized)."""
    try:
        doc = json.loads(data)
    except ValueError:
        return data
    if not isinstance(doc, dict):
        return data
    if qc is None:
        if "quantization_config" not in doc:
            return data
        del doc["quantization_config"]
    else:
        doc["quantization_config"] = qc
    return (json.dumps(doc, indent=2, ensure_ascii=False) + "\n").encode()


def _dequantized_outs(built: _Built, target: str, src: Path) -> None:
    """Replace each FP8 weight and its scale by the dequantized weight, in place; refuse
    (nothing written) a weight without a scale or a scale that fits no convention."""
    by_name = {o.name: o for o in built.outs}
    drop: set[str] = set()
    new: dict[str, OutTensor] = {}
    problems: list[str] = []
    for o in built.outs:
        if o.dtype not in FP8_DTYPES:
            continue
        module, _, last = o.name.rpartition(".")
        found = [f"{module}.{n}" for n in fp8.SCALE_NAMES if f"{module}.{n}" in by_name]
        if last != "weight" or not found:
            problems.append(f"{o.name} ({o.dtype} {list(o.shape)}) has no scale "
                            f"({', '.join(fp8.SCALE_NAMES)})")
            continue
        if len(found) > 1:
            problems.append(f"{o.name} has several scales: {', '.join(found)}")
            continue
        sc = by_name[found[0]]
        if sc.dtype not in ("F32", "BF16", "F16") or fp8.scale_kind(o.shape, sc.shape) is None:
            problems.append(f"{sc.name} ({sc.dtype} {list(sc.shape)}) fits no scale convention "
                            f"for {o.name} {list(o.shape)}")
            continue
        drop.add(sc.name)
        for extra in ("input_scale", "activation_scale"):
            if f"{module}.{extra}" in by_name:
                drop.add(f"{module}.{extra}")

        def load(w: OutTensor = o, s: OutTensor = sc) -> np.ndarray:
            return fp8.dequantize(w.load(), s.load(), target)

        def pieces(w: OutTensor = o, s: OutTensor = sc) -> Iterator[np.ndarray]:
            codes = w.pieces() if w.pieces is not None else iter((w.load(),))
            return fp8.dequantize_pieces(codes, s.load(), w.shape, target)

        new[o.name] = OutTensor(o.name, target, o.shape, load, pieces)
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more"
                                           if len(problems) > 5 else "")
        raise CkptError(f"{src}: cannot dequantize: {shown}")
    built.outs[:] = [new.get(o.name, o) for o in built.outs if o.name not in drop]
    if new:
        built.casts[f"F8->{target} (dequantized)"] = len(new)
        built.plan.kept.clear()
        built.plan.kept_scales.clear()
        built.notes.append(f"dequantized {len(new)} FP8 weight(s); dropped {len(drop)} "
                           "scale tensor(s) and the config's quantization_config")
