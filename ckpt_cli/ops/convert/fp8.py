"""``convert``'s FP8 steps: ``--to fp8`` picks its weights on the plan, before anything is
built (:func:`choose`), and ``--dequantize`` rewires the built outputs (:func:`dequantized`).

The numbers (scales, rounding, which tensors qualify, the ``quantization_config``) are
:mod:`ckpt_cli.fp8`'s; this module decides per tensor (quantize, keep BF16, keep FP32, write
a scale) and rewires a conversion's copied ``config.json``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpt_cli import fp8
from ckpt_cli.errors import CkptError, UsageError
from ckpt_cli.writers import OutTensor

if TYPE_CHECKING:
    import numpy as np

    from ckpt_cli.ops.convert.build import Built
    from ckpt_cli.ops.convert.plan import Plan
    from ckpt_cli.tensors.cast import CastStats

FP8_DTYPES = ("F8_E4M3", "F8_E5M2")


def wanted(to: str, layout: str, activations: str = "dynamic") -> bool:
    """Whether ``--to`` asks for FP8 (then ``layout`` must be one of :data:`fp8.LAYOUTS`, and
    ``activations`` ``dynamic`` or ``none``, ``none`` with channel/tensor only)."""
    if to != "fp8":
        return False
    if layout not in fp8.LAYOUTS:
        raise UsageError(f"fp8_layout must be block, channel or tensor, not {layout!r}",
                         param="fp8_layout")
    if activations not in ("dynamic", "none"):
        raise UsageError(f"fp8_activations must be dynamic or none, not {activations!r}",
                         param="fp8_activations")
    if activations == "none" and layout == "block":
        raise UsageError("fp8_activations none (weight-only FP8) is for the channel and tensor "
                         "layouts; the block layout's activations are always dynamic",
                         param=("fp8_activations", "fp8_layout"))
    return True


def check_usage(quant: bool, dequantize: bool, target: str | None, fmt: str) -> None:
    """Refuse FP8 options that do not go together (before any work)."""
    if dequantize and (quant or target is None):
        raise UsageError("dequantize needs to bf16, fp16 or fp32", param=("dequantize", "to"))
    if quant and fmt != "safetensors":
        raise UsageError("to fp8 writes safetensors (an HF directory); not output_format pt",
                         param=("to", "output_format"))


def choose(plan: Plan, layout: str, src: Path, *, activations: str = "dynamic",
           config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Pick the weights to quantize on the plan, mark them (each read in FP32, not rounded to
    BF16 first, then written as an FP8 weight and its scale), and return the
    ``quantization_config``; the plan's notes and metadata say what was chosen.

    Which weights: :func:`ckpt_cli.fp8.groups.choose` (Linear weights whose fused layer the
    layout can hold whole); the rest is cast as the plan says (BF16, or FP32 where
    ``--keep-fp32`` asked).

    Args:
        plan: The ``--to bf16`` plan (the tensors not quantized are cast to BF16).
        layout: ``block``, ``channel`` or ``tensor``.
        src: The source, for messages.
        activations: ``dynamic`` or ``none`` (see :func:`ckpt_cli.fp8.quantization_config`).
        config: The source's ``config.json`` (the parts of already-fused weights).

    Raises:
        UsageError: The source already holds FP8 tensors.
    """
    # Only --to fp8 picks weights: a plain cast does not load the grouping rules (issue 47).
    from ckpt_cli.fp8 import groups  # lazy: only --to fp8 picks weights

    held = [s.name for s in plan.steps if s.plain in FP8_DTYPES]
    if held:
        raise UsageError(f"{src} already holds {len(held)} FP8 tensor(s) (e.g. {held[0]})",
                         hint="dequantize first: ckpt convert SRC --to bf16 --dequantize")
    tied = {kept: alias for alias, kept in plan.aliases.items()}
    choice = groups.choose(((s.name, s.plain, s.source.shape) for s in plan.steps), layout,
                           tied=tied, config=config)
    # an output head tied to the embedding is written once (as the embedding), and listed
    ignore = sorted(set(choice.ignore) | {
        a[: -len(".weight")] for a in plan.aliases if a.endswith(".weight")
        and fp8.skip_reason(a[: -len(".weight")]) == "output head (lm_head)"})
    picked = choice.picked
    plan.quantize(picked)
    if choice.left:
        shown = "; ".join(f"{n} ({why})" for n, why in choice.left[:3]) + (
            f"; and {len(choice.left) - 3} more" if len(choice.left) > 3 else "")
        plan.notes.append(f"{len(choice.left)} Linear weight(s) left unquantized, listed in "
                          f"the quantization_config's ignore list: {shown}")
    shapes = {s.name: s.source.shape for s in plan.steps}
    partial = [n for n in picked if layout == "block" and shapes[n][0] % fp8.BLOCK]
    if partial:
        plan.notes.append(
            f"{len(partial)} weight(s) end in a partial 128-row block (e.g. {partial[0]}), "
            "scaled per ceil(rows/128) as vLLM, SGLang and DeepSeek-V3's own checkpoints do; "
            "transformers' CPU dequantizing loader derives the block from the scale grid and "
            "refuses or misreads them: load on an FP8 GPU, or convert again with `dequantize`, "
            "or use `fp8_layout=channel`")
    listed = ", ".join(ignore[:5]) + (f" and {len(ignore) - 5} more" if len(ignore) > 5
                                      else "")
    acts = ("weight-only (W8A16)" if activations == "none" else
            "dynamic per-token FP8 activations (W8A8)")
    plan.notes.append(f"quantized {len(picked)} weight(s) to FP8 E4M3 ({layout} layout, "
                      f"{acts}), the rest cast to BF16; ignore list: {listed}")
    quant_config = fp8.quantization_config(layout, ignore, activations)
    plan.meta["ckpt.quantization_config"] = json.dumps(quant_config, sort_keys=True)
    return quant_config


def dequantized(built: Built, target: str, src: Path, stats: CastStats,
                clamp: bool = False, config: dict[str, Any] | None = None) -> None:
    """Replace each FP8 weight and its scale by the dequantized weight, in place.

    Refused before anything is written (``built`` closed, :class:`CkptError` naming the
    tensors): an FP8 weight without a scale, several scales or one that fits no convention;
    a scale holding non-finite, zero or negative values; a scale without an FP8 weight (its
    weight missing, or not FP8). To FP16, values beyond its range are counted into ``stats``
    (the conversion then refuses them before committing, as a plain ``--to fp16`` does) or,
    with ``clamp``, clamped to ±65504. ``config`` is the source's ``quantization_config``:
    the scale rule is validate's (:func:`ckpt_cli.fp8.scheme.scale_shape_problem`,
    :func:`~ckpt_cli.fp8.scheme.scale_values_problem`).
    """
    try:
        _dequantized_outs(built, target, src, stats, clamp, config)
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


def _dequantized_outs(built: Built, target: str, src: Path, stats: CastStats,
                      clamp: bool, config: dict[str, Any] | None) -> None:
    """Replace each FP8 weight and its scale by the dequantized weight, in place; refuse
    (nothing written) what would write a wrong model (see :func:`dequantized`)."""
    import numpy as np  # heavy: numpy

    # The decoder (and its row workers) load only for --dequantize, as fp8/__init__ defers them.
    from ckpt_cli.fp8.decode import Overflow  # lazy: only --dequantize decodes FP8

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
        drop.add(sc.name)
        # validate's rule (fp8.scheme): shape and dtype under the config, then the values.
        kind, problem = fp8.scale_shape_problem(o, sc, config)
        if kind is None:
            problems.append(problem or sc.name)
            continue
        values = np.asarray(sc.load(), dtype=np.float32)  # small: one per block, row or tensor
        if (why := fp8.scale_values_problem(values, sc.dtype)) is not None:
            problems.append(f"{sc.name} {why}")
            continue
        for extra in ("input_scale", "activation_scale"):
            if f"{module}.{extra}" in by_name:
                drop.add(f"{module}.{extra}")
        over = Overflow(o.name, stats, clamp) if target == "F16" else None

        def load(w: OutTensor = o, s: np.ndarray = values,
                 ov: Overflow | None = over) -> np.ndarray:
            return fp8.dequantize(w.load(), s, target, ov)

        def pieces(w: OutTensor = o, s: np.ndarray = values,
                   ov: Overflow | None = over) -> Iterator[np.ndarray]:
            codes = w.pieces() if w.pieces is not None else iter((w.load(),))
            return fp8.dequantize_pieces(codes, s, w.shape, target, ov)

        new[o.name] = OutTensor(o.name, target, o.shape, load, pieces)
    for o in built.outs:
        module, _, last = o.name.rpartition(".")
        if last in fp8.SCALE_NAMES and o.name not in drop:
            weight = by_name.get(f"{module}.weight")
            problems.append(f"{o.name} is a scale, but " + (
                f"its weight {weight.name} is {weight.dtype}, not FP8" if weight is not None
                else f"there is no {module}.weight"))
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more"
                                           if len(problems) > 5 else "")
        raise CkptError(f"{src}: cannot dequantize: {shown}; nothing written")
    built.outs[:] = [new.get(o.name, o) for o in built.outs if o.name not in drop]
    if new:
        built.casts[f"F8->{target} (dequantized)"] = len(new)
        built.plan.kept.clear()
        built.plan.kept_scales.clear()
        built.notes.append(f"dequantized {len(new)} FP8 weight(s); dropped {len(drop)} "
                           "scale tensor(s) and the config's quantization_config")
