"""FP8 schemes: which tensors a conversion quantizes and how its scales are named and
shaped (the rules :mod:`ckpt_cli.fp8.encode` and ``convert --to fp8`` follow), and what
quantization scheme a checkpoint uses, from its metadata alone (never tensor data).

Which tensors qualify (:func:`qualifies`) is decided by name and shape, and explainable: a
2-D floating ``*.weight`` whose module name does not match :data:`SKIP_PATTERNS`
(embeddings, norms, ``lm_head``, MoE routers/gates) and whose dims suit the layout
(:func:`layout_fits`). Linear weights that do not fit are left in the ``--rest`` dtype and
listed in the config's ignore list.

``inspect`` shows it; ``diff`` uses the same pairing of FP8 weights with their scales.

A scale belongs to the weight of its module: ``X.weight`` (FP8 E4M3/E5M2) with
``X.weight_scale_inv`` (block-wise, DeepSeek-V3 / transformers ``fp8``), ``X.weight_scale``
(compressed-tensors) or ``X.scale_weight``; in every convention the scale is the multiplier
that dequantizes, ``w = q * scale`` (see :mod:`ckpt_cli.fp8`). Activation scales
(``X.input_scale``, ``X.activation_scale``, ``X.output_scale``) belong to ``X`` too.
"""


from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

from ckpt_cli import storage
from ckpt_cli.errors import CkptError
from ckpt_cli.model import QUANT_SCALES, CheckpointIndex, Finding, TensorInfo

FP8_MAX = 448.0
BLOCK = 128
LAYOUTS = ("block", "channel", "tensor")
CHANNEL_MULTIPLE = 16
"""channel/tensor layouts: both dims must be multiples of 16 (the FP8 GEMM kernels' rule)."""

SKIP_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"(^|\.)(embed_tokens|embed_in|embeddings?|wte|wpe|word_embeddings|tok_embeddings)"
     r"(\.|$)", "embedding"),
    (r"(^|\.)(lm_head|output|embed_out)$", "output head (lm_head)"),
    (r"norm|(^|\.)ln_", "norm"),
    (r"(^|\.)(router|gate|shared_expert_gate)$", "MoE router"),
)
"""``(regex on the module name, reason)``: modules never quantized."""

SCALE_NAMES = QUANT_SCALES[:3]
"""Weight scales' last name parts."""


def skip_reason(module: str) -> str | None:
    """Why module ``module`` is never quantized (None: it may be)."""
    for pattern, reason in SKIP_PATTERNS:
        if re.search(pattern, module):
            return reason
    return None


FLOATS = ("F64", "F32", "F16", "BF16")
"""Source dtypes a weight is quantized from."""


def fit_reason(shape: tuple[int, ...], layout: str) -> str | None:
    """Why one weight of ``shape`` cannot be held by ``layout`` on its own (None: it can).

    ``block``: the input dim (K) a multiple of 128, the output dim any (a partial trailing
    block has its own scale row, ``ceil(N/128)``), as vLLM and SGLang load it (see
    :mod:`ckpt_cli.fp8.groups` for the sources and the rules of fused layers).
    ``channel``/``tensor``: both dims multiples of 16 (the FP8 GEMM kernels' rule).
    """
    if len(shape) != 2 or not all(d > 0 for d in shape):
        return f"shape {list(shape)}: not a non-empty 2-D weight"
    if layout == "block":
        if shape[1] % BLOCK:
            return (f"shape {list(shape)}: input dim {shape[1]} not a multiple of {BLOCK} "
                    "(activations are quantized in groups of 128 along it)")
        return None
    if any(d % CHANNEL_MULTIPLE for d in shape):
        return f"shape {list(shape)}: a dim not a multiple of {CHANNEL_MULTIPLE}"
    return None


def layout_fits(shape: tuple[int, ...], layout: str) -> bool:
    """Whether a 2-D weight of ``shape`` can be stored in ``layout`` on its own."""
    return fit_reason(shape, layout) is None


def qualifies(name: str, dtype: str, shape: tuple[int, ...],
              layout: str) -> tuple[bool, str | None]:
    """Whether tensor ``name`` may be quantized on its own, and if not while being a
    Linear-like weight, why. ``convert`` decides fused layers together on top of this
    (:func:`ckpt_cli.fp8.groups.choose`).

    Returns:
        ``(True, None)``: quantize. ``(False, reason)``: a 2-D ``*.weight`` left unquantized
        (its module goes in the ignore list). ``(False, None)``: not a candidate at all.
    """
    if dtype not in FLOATS or not name.endswith(".weight"):
        return False, None
    if len(shape) != 2:
        return False, None
    module = name[: -len(".weight")]
    reason = skip_reason(module) or fit_reason(shape, layout)
    return reason is None, reason


def scale_name(layout: str) -> str:
    """The scale tensor's last name part in ``layout``."""
    return "weight_scale_inv" if layout == "block" else "weight_scale"


def scale_shape(shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
    """The scale's shape for a weight of ``shape`` in ``layout``."""
    if layout == "block":
        return (math.ceil(shape[0] / BLOCK), math.ceil(shape[1] / BLOCK))
    if layout == "channel":
        return (shape[0], 1)
    return (1,)


def scale_kind(weight: tuple[int, ...], scale: tuple[int, ...],
               block: bool = False) -> str | None:
    """Which convention a scale of shape ``scale`` follows for ``weight`` (None: none).

    Args:
        weight: The weight's shape.
        scale: The scale's shape.
        block: The scale is block-wise by name or config (``weight_scale_inv``, a
            ``weight_block_size``): a weight of one block row and column then has a block scale
            ``[1, 1]``, not a per-tensor one (the same numbers, told apart for the layout).
    """
    if len(weight) != 2:
        return None
    block_shape = (math.ceil(weight[0] / BLOCK), math.ceil(weight[1] / BLOCK))
    if block and scale == block_shape:
        return "block"
    if scale in ((), (1,), (1, 1)):
        return "tensor"
    if scale in ((weight[0], 1), (weight[0],)):
        return "channel"
    if scale == block_shape:
        return "block"
    return None


class Shaped(Protocol):
    """A tensor's name, dtype and shape (a :class:`TensorInfo`, an output tensor)."""

    @property
    def name(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...


def scale_shape_problem(weight: Shaped, scale: Shaped,
                        config: dict[str, Any] | None) -> tuple[str | None, str | None]:
    """The scale rule ``validate`` and ``convert --dequantize`` share, on shapes and dtypes.

    Args:
        weight: The FP8 weight.
        scale: Its scale.
        config: The ``quantization_config``, if any (block-wise by config).

    Returns:
        ``(kind, None)`` for a scale of a known convention (:func:`scale_kind`), else
        ``(None, why)``: a 0-d scale where block-wise scales are declared (by the name
        ``weight_scale_inv`` or the config) is refused, not read as one per tensor.
    """
    block = is_block_scale(scale.name, config)
    if block and len(scale.shape) == 0 and len(weight.shape) == 2:
        return None, (f"{scale.name} is a 0-d scale, but its scales are block-wise (by its "
                      f"name or the quantization_config): {weight.name} {list(weight.shape)} "
                      f"needs one per {BLOCK}x{BLOCK} block")
    kind = scale_kind(tuple(weight.shape), tuple(scale.shape), block)
    if kind is None or scale.dtype not in _SCALE_DTYPES:
        return None, (f"{scale.name} ({scale.dtype} {list(scale.shape)}) fits no scale "
                      f"convention for {weight.name} {list(weight.shape)}")
    return kind, None


SMALLEST_NORMAL = {"F32": 2.0 ** -126, "BF16": 2.0 ** -126, "F16": 2.0 ** -14}
"""The smallest normal value of each scale dtype: a scale below it is subnormal."""


def scale_values_problem(values: Any, dtype: str) -> str | None:
    """The scale rule ``validate`` and ``convert --dequantize`` share, on values.

    Args:
        values: The scale's values as FP32 (a numpy array).
        dtype: The scale's stored dtype (``F32``, ``BF16``, ``F16``).

    Returns:
        None when every value is finite, positive and at least the smallest normal of
        ``dtype`` (a subnormal scale is no quantizer's output: damage, or values that lose
        their precision), else what is wrong, counted.
    """
    import numpy as np  # heavy: numpy

    v = np.asarray(values, dtype=np.float32)
    with np.errstate(invalid="ignore"):
        counts = {"NaN": int(np.isnan(v).sum()), "inf": int(np.isinf(v).sum()),
                  "zero": int((v == 0).sum()), "negative": int((v < 0).sum())}
        if any(counts.values()):
            return ("holds non-finite, zero or negative scales ("
                    + ", ".join(f"{n} {k}" for k, n in counts.items() if n) + ")")
        low = int((v < SMALLEST_NORMAL.get(dtype, 2.0 ** -126)).sum())
    if low:
        return (f"holds {low} subnormal scale(s), below the smallest normal {dtype} "
                f"({SMALLEST_NORMAL.get(dtype, 2.0 ** -126):.4g})")
    return None


def is_block_scale(scale_name: str, config: dict[str, Any] | None = None) -> bool:
    """Whether a scale is block-wise by its name (``weight_scale_inv``) or by the config
    (``weight_block_size`` of the ``fp8`` method, a ``block`` strategy in compressed-tensors)."""
    if scale_name.rpartition(".")[2] == "weight_scale_inv":
        return True
    if not isinstance(config, dict):
        return False
    if isinstance(config.get("weight_block_size"), list):
        return True
    groups = config.get("config_groups")
    return isinstance(groups, dict) and any(
        isinstance(g, dict) and isinstance(g.get("weights"), dict)
        and g["weights"].get("strategy") == "block" for g in groups.values())


FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
"""Storage dtypes of FP8 weights."""

ACTIVATION_SCALES = QUANT_SCALES[3:]
"""Per-module scales of activations (static FP8 schemes): paired with the module, not a weight."""

CONVENTIONS = {
    "weight_scale_inv": "weight_scale_inv: w = q x scale_inv, one per 128x128 block "
                        "(DeepSeek-V3, transformers fp8)",
    "weight_scale": "weight_scale: w = q x scale (compressed-tensors)",
    "scale_weight": "scale_weight: w = q x scale",
}
"""Each scale name's convention, in words."""

_SCALE_DTYPES = ("F32", "BF16", "F16")
_BF16_BYTES = 2


@dataclass(slots=True)
class Pair:
    """One FP8 weight and its scale (both tensors of one checkpoint)."""

    weight: TensorInfo
    scale: TensorInfo
    kind: str
    """``block``, ``channel`` or ``tensor`` (:func:`ckpt_cli.fp8.scale_kind`)."""


@dataclass(slots=True)
class Pairing:
    """FP8 weights paired with their scales, and what could not be paired."""

    pairs: dict[str, Pair] = field(default_factory=dict)
    """By weight name."""
    activation_scales: list[str] = field(default_factory=list)
    """Activation scales of quantized modules (not weights, not scales of one)."""
    findings: list[Finding] = field(default_factory=list)
    """A weight without a scale, with several, a scale of no known shape, a scale without
    its weight (warnings)."""

    def scale_names(self) -> set[str]:
        """Every tensor that is a scale of a paired weight, activation scales included."""
        return {p.scale.name for p in self.pairs.values()} | set(self.activation_scales)


def is_scale_name(name: str) -> bool:
    """Whether ``name``'s last part names a weight or activation scale."""
    return name.rpartition(".")[2] in SCALE_NAMES + ACTIVATION_SCALES


def scales_expected(tensors: dict[str, TensorInfo], config: dict[str, Any] | None) -> bool:
    """Whether the checkpoint says its FP8 weights carry scales: a ``quantization_config``,
    or a scale-named tensor anywhere in it (the naming convention of the file). Without
    either, an FP8 tensor is raw FP8 values, read as they are (a CUDA run's ``float8_e5m2``
    state, say). Which FP8 tensor that claim covers: :func:`claimed_dtypes`."""
    return config is not None or any(n.rpartition(".")[2] in SCALE_NAMES for n in tensors)


def claimed_dtypes(tensors: dict[str, TensorInfo], config: dict[str, Any] | None
                   ) -> tuple[str, ...]:
    """The FP8 dtypes the checkpoint claims are quantized with a scale: every FP8 dtype under
    a ``quantization_config``; without one, those of the weights that have a scale beside
    them (an E5M2 tensor with no scale next to scaled E4M3 weights is raw FP8 values, not a
    weight missing its scale); none without either."""
    if config is not None:
        return FP8_DTYPES
    return tuple(sorted({t.dtype for t in tensors.values() if t.dtype in FP8_DTYPES and any(
        f"{t.name.rpartition('.')[0]}.{n}" in tensors for n in SCALE_NAMES)}))


def no_scale(t: TensorInfo, expected: bool) -> Finding:
    """The finding for FP8 tensor ``t`` without a scale: a warning where scales are expected
    (:func:`scales_expected`; validate makes it an error), else a note."""
    if expected:
        return Finding("warning", "fp8-no-scale", f"{t.name} ({t.dtype} {list(t.shape)}) has "
                       f"no scale ({', '.join(SCALE_NAMES)}): a loader ignoring that reads "
                       "garbage", None, t.name)
    return Finding("info", "fp8-raw", f"{t.name} ({t.dtype} {list(t.shape)}) has no scale and "
                   "nothing says it is quantized with one: raw FP8 values, read as they are",
                   None, t.name)


def pair_scales(tensors: dict[str, TensorInfo],
                config: dict[str, Any] | None = None) -> Pairing:
    """Pair each FP8 ``X.weight`` of ``tensors`` with its scale, by name and shape.

    Args:
        tensors: A checkpoint's tensors by name (metadata only).
        config: The ``quantization_config``, if any (block-wise scales of one block, and
            whether FP8 tensors without a scale are a problem: :func:`scales_expected`).

    Returns:
        The :class:`Pairing`; nothing is raised for what does not pair, it is a finding.
    """
    out = Pairing()

    def warn(code: str, msg: str, where: str) -> None:
        out.findings.append(Finding("warning", code, msg, None, where))

    claimed = claimed_dtypes(tensors, config) if scales_expected(tensors, config) else ()
    used: set[str] = set()
    fp8_modules: set[str] = set()
    for t in tensors.values():
        if t.dtype not in FP8_DTYPES:
            continue
        module, _, last = t.name.rpartition(".")
        fp8_modules.add(module)
        scales = [tensors[f"{module}.{n}"] for n in SCALE_NAMES if f"{module}.{n}" in tensors]
        used.update(s.name for s in scales)
        if last != "weight" or not scales:
            out.findings.append(no_scale(t, t.dtype in claimed))
            continue
        if len(scales) > 1:
            warn("fp8-scale-ambiguous",
                 f"{t.name} has several scales: {', '.join(s.name for s in scales)}", t.name)
            continue
        s = scales[0]
        kind, problem = scale_shape_problem(t, s, config)
        if kind is None:
            warn("fp8-scale-shape", problem or "", s.name)
            continue
        out.pairs[t.name] = Pair(t, s, kind)
    for t in tensors.values():
        module, _, last = t.name.rpartition(".")
        if last in ACTIVATION_SCALES and module in fp8_modules:
            out.activation_scales.append(t.name)
        elif last in SCALE_NAMES and t.name not in used:
            weight = tensors.get(f"{module}.weight")
            what = (f"its weight {weight.name} is {weight.dtype}, not FP8" if weight is not None
                    else f"there is no {module}.weight")
            warn("fp8-scale-without-weight", f"{t.name} ({t.dtype} {list(t.shape)}) is a "
                 f"scale, but {what}", t.name)
    return out


def read_quantization_config(index: CheckpointIndex) -> tuple[dict[str, Any] | None, str | None]:
    """The ``quantization_config`` of ``config.json`` beside the weights, else the one ckpt
    records in safetensors metadata (``ckpt.quantization_config``), and where it came from.

    Reads a small side file, never tensor data; an unreadable one counts as absent.
    """
    try:
        config = index.base / "config.json"
        if index.base.is_dir() and config.is_file():
            qc = storage.load_side_json(config, "config").get("quantization_config")
            if isinstance(qc, dict):
                return qc, "config.json"
    except (ValueError, AttributeError, OSError, CkptError):
        pass
    meta = index.metadata.get("safetensors_metadata")
    raw = meta.get("ckpt.quantization_config") if isinstance(meta, dict) else None
    if isinstance(raw, str):
        try:
            qc = storage.parse_json(raw, what="ckpt.quantization_config", path=None)
        except CkptError:
            return None, None
        if isinstance(qc, dict):
            return qc, "metadata (ckpt.quantization_config)"
    return None, None


def read_model_config(index: CheckpointIndex) -> dict[str, Any] | None:
    """``config.json`` beside the weights (the family's ``model_type``, head counts), or None.
    Reads a small side file, never tensor data; an unreadable one counts as absent."""
    try:
        config = index.base / "config.json"
        if index.base.is_dir() and config.is_file():
            doc = storage.load_side_json(config, "config")
            return doc if isinstance(doc, dict) else None
    except (ValueError, AttributeError, OSError, CkptError):
        pass
    return None


def config_summary(qc: dict[str, Any], source: str) -> dict[str, Any]:
    """The parts of a ``quantization_config`` that say what the tensors should be."""
    ignore = qc.get("modules_to_not_convert")
    if ignore is None:
        ignore = qc.get("ignore")
    out: dict[str, Any] = {"source": source, "quant_method": qc.get("quant_method"),
                           "format": qc.get("format") or qc.get("fmt"),
                           "activation_scheme": qc.get("activation_scheme"),
                           "weight_block_size": qc.get("weight_block_size"),
                           "strategy": None, "targets": None,
                           "ignore": [m for m in ignore if isinstance(m, str)]
                           if isinstance(ignore, list) else []}
    groups = qc.get("config_groups")
    if isinstance(groups, dict):
        strategies: list[str] = []
        targets: list[str] = []
        for g in groups.values():
            if not isinstance(g, dict):
                continue
            w = g.get("weights")
            if isinstance(w, dict) and isinstance(w.get("strategy"), str):
                strategies.append(w["strategy"])
                if w.get("type") == "float" and w.get("num_bits") == 8 and not out["format"]:
                    out["format"] = "float-quantized"
            if isinstance(g.get("targets"), list):
                targets.extend(str(x) for x in g["targets"])
        out["strategy"] = ", ".join(dict.fromkeys(strategies)) or None
        out["targets"] = list(dict.fromkeys(targets)) or None
    return out


def _ignored(module: str, ignore: list[str]) -> bool:
    """Whether an ignore list names ``module`` (plainly, by last part, or as ``re:REGEX``)."""
    for m in ignore:
        if m.startswith("re:"):
            try:
                if re.fullmatch(m[3:], module):
                    return True
            except re.error:
                continue
        elif m == module or module.endswith("." + m):
            return True
    return False


def describe(index: CheckpointIndex) -> dict[str, Any] | None:
    """The quantization scheme of a checkpoint: ``inspect``'s ``quantization`` object.

    Metadata only (tensor names, dtypes and shapes, and ``config.json``); never tensor data.

    Args:
        index: The checkpoint.

    Returns:
        None when the checkpoint holds no FP8 tensor, no scale-named tensor and no
        ``quantization_config``; else the object documented in docs/json-schema.md.
    """
    tensors = index.tensors
    has_fp8 = any(t.dtype in FP8_DTYPES for t in tensors.values())
    scale_named = any(is_scale_name(n) for n in tensors)
    # A config.json the reader listed is read again only where that is cheap (not over a
    # network) unless the tensors look quantized.
    listed = any(f.path == "config.json" for f in index.files) and storage.reads_are_cheap(
        index.base)
    qc, source = read_quantization_config(index) if has_fp8 or scale_named or listed else (
        None, None)
    if not has_fp8 and qc is None and not scale_named:
        return None
    pairing = pair_scales(tensors, qc)
    kinds: dict[str, int] = {}
    names: dict[str, int] = {}
    scale_dtypes: dict[str, int] = {}
    weight_dtypes: dict[str, int] = {}
    fp8_bytes = scale_bytes = bf16_bytes = 0
    for p in pairing.pairs.values():
        kinds[p.kind] = kinds.get(p.kind, 0) + 1
        last = p.scale.name.rpartition(".")[2]
        names[last] = names.get(last, 0) + 1
        scale_dtypes[p.scale.dtype] = scale_dtypes.get(p.scale.dtype, 0) + 1
    for t in tensors.values():
        if t.dtype in FP8_DTYPES:
            weight_dtypes[t.dtype] = weight_dtypes.get(t.dtype, 0) + 1
            fp8_bytes += t.nbytes
            bf16_bytes += t.numel * _BF16_BYTES
    scale_set = pairing.scale_names()
    scale_bytes = sum(tensors[n].nbytes for n in scale_set)
    layout = None if not kinds else next(iter(kinds)) if len(kinds) == 1 else "mixed"
    block_size = None
    if "block" in kinds:
        block_size = [BLOCK, BLOCK]
    summary = config_summary(qc, source) if qc is not None and source is not None else None
    if summary is not None and isinstance(summary["weight_block_size"], list):
        block_size = summary["weight_block_size"]
    ignore = summary["ignore"] if summary is not None else []
    fp8_modules = {t.name.rpartition(".")[0] for t in tensors.values() if t.dtype in FP8_DTYPES}
    unquantized: list[str] = []
    findings = list(pairing.findings)
    for t in tensors.values():
        if (t.dtype in FP8_DTYPES or not t.is_floating or len(t.shape) != 2
                or not t.name.endswith(".weight")):
            continue
        module = t.name[: -len(".weight")]
        unquantized.append(t.name)
        if (summary is not None and fp8_modules and skip_reason(module) is None
                and not _ignored(module, ignore)):
            findings.append(Finding(
                "warning", "fp8-not-ignored", f"{t.name} is {t.dtype}, not FP8, but the "
                "quantization_config does not list it as ignored: a loader expects it quantized",
                None, t.name))
    # a config whose ignore list names every Linear-like weight left (ckpt's output of a model
    # none of whose Linears an engine reads quantized: GPT-2's Conv1D) misleads no loader
    if qc is not None and not has_fp8 and not (unquantized and all(
            skip_reason(n[: -len(".weight")]) is not None or _ignored(n[: -len(".weight")],
                                                                      ignore)
            for n in unquantized)):
        findings.append(Finding("warning", "fp8-config-without-fp8", "the config has a "
                                "quantization_config but no tensor is FP8: a loader expects "
                                "quantized weights (a dequantized copy should drop it)",
                                source, None))
    findings.extend(Finding("warning", "fp8-config-ignored", f"the quantization_config "
                            f"ignores {m}, but its weight is FP8", None, f"{m}.weight")
                    for m in ignore if m in fp8_modules)
    conventions = sorted(names)
    return {
        "layout": layout,
        "layouts": kinds,
        "block_size": block_size,
        "scale_names": names,
        "scale_convention": (CONVENTIONS[conventions[0]] if len(conventions) == 1 else
                             None if not conventions else "several: " + ", ".join(conventions)),
        "scale_dtypes": scale_dtypes,
        "weight_dtypes": weight_dtypes,
        "quantized": len(pairing.pairs),
        "fp8_tensors": sum(weight_dtypes.values()),
        "scales": len({p.scale.name for p in pairing.pairs.values()}),
        "activation_scales": len(pairing.activation_scales),
        "unquantized_weights": len(unquantized),
        "unquantized_ignored": sum(_ignored(n[: -len(".weight")], ignore) for n in unquantized),
        "other_tensors": len(tensors) - sum(weight_dtypes.values()) - len(scale_set)
        - len(unquantized),
        "ignore": ignore,
        "fp8_bytes": fp8_bytes,
        "scale_bytes": scale_bytes,
        "bf16_bytes": bf16_bytes,
        "bytes_saved": bf16_bytes - fp8_bytes - scale_bytes,
        "bf16_total_bytes": index.total_bytes - fp8_bytes - scale_bytes + bf16_bytes,
        "config": summary,
        "pairs": [{"weight": p.weight.name, "scale": p.scale.name, "layout": p.kind,
                   "scale_dtype": p.scale.dtype, "scale_shape": list(p.scale.shape)}
                  for p in pairing.pairs.values()],
        "problems": [f.to_dict() for f in findings],
    }


def expected_error(layout: str | None) -> float:
    """The relative L2 error bound of one E4M3 round trip the README states for a layout."""
    return {"block": 0.045, "channel": 0.045}.get(layout or "", 0.06)


def fraction(x: float) -> str:
    """``0.0264`` -> ``2.64%``."""
    return "-" if not math.isfinite(x) else f"{100 * x:.2f}%"
