"""FP8 (E4M3) weight quantization for deployment, and its inverse.

Layouts (what inference engines load from an HF directory):

* ``block``: DeepSeek-V3 / transformers ``"fp8"`` method. ``weight`` is ``float8_e4m3fn``;
  ``weight_scale_inv`` is FP32 ``[ceil(out/128), ceil(in/128)]``, one value per 128x128 block
  (a partial block at the edge has its own scale, which is how the engines pad); despite its
  name it is the *multiplier* that dequantizes: ``w = q * weight_scale_inv``.
* ``channel`` / ``tensor``: compressed-tensors ``float-quantized``. ``weight`` FP8,
  ``weight_scale`` FP32 ``[out, 1]`` (channel) or ``[1]`` (tensor); ``w = q * weight_scale``.

Scales are ``amax / 448`` (448: E4M3's largest finite value) over the block, row or tensor
(an all-zero group gets scale 1.0); values are divided by their scale, clamped to ±448
(saturating) and rounded to nearest even (torch's ``.to(float8_e4m3fn)``).

Which tensors qualify (:func:`qualifies`) is decided by name and shape, and explainable: a
2-D floating ``*.weight`` whose module name does not match :data:`SKIP_PATTERNS`
(embeddings, norms, ``lm_head``, MoE routers/gates) and whose dims suit the layout
(:func:`layout_fits`). Linear weights that do not fit are left in the ``--rest`` dtype and
listed in the config's ignore list.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ckpt_cli.errors import CkptError

if TYPE_CHECKING:
    import numpy as np

FP8_MAX = 448.0
BLOCK = 128
LAYOUTS = ("block", "channel", "tensor")
CHANNEL_MULTIPLE = 16
"""channel/tensor layouts: both dims must be multiples of 16 (the FP8 GEMM kernels' rule)."""

SKIP_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"(^|\.)(embed_tokens|embeddings?|wte|wpe|word_embeddings|tok_embeddings)(\.|$)",
     "embedding"),
    (r"(^|\.)(lm_head|output|embed_out)$", "output head (lm_head)"),
    (r"norm|(^|\.)ln_", "norm"),
    (r"(^|\.)(router|gate)$", "MoE router"),
)
"""``(regex on the module name, reason)``: modules never quantized."""

SCALE_NAMES = ("weight_scale_inv", "weight_scale", "scale_weight")


def skip_reason(module: str) -> str | None:
    """Why module ``module`` is never quantized (None: it may be)."""
    for pattern, reason in SKIP_PATTERNS:
        if re.search(pattern, module):
            return reason
    return None


def layout_fits(shape: tuple[int, ...], layout: str) -> bool:
    """Whether a 2-D weight of ``shape`` can be stored in ``layout``."""
    if len(shape) != 2:
        return False
    if layout == "block":
        return all(d % BLOCK == 0 and d > 0 for d in shape)
    return all(d % CHANNEL_MULTIPLE == 0 and d > 0 for d in shape)


def qualifies(name: str, dtype: str, shape: tuple[int, ...],
              layout: str) -> tuple[bool, str | None]:
    """Whether tensor ``name`` is quantized, and if not while being a Linear-like weight,
    why (for the ignore list and the notes).

    Returns:
        ``(True, None)``: quantize. ``(False, reason)``: a 2-D ``*.weight`` left unquantized
        (its module goes in the ignore list). ``(False, None)``: not a candidate at all.
    """
    if dtype not in ("F64", "F32", "F16", "BF16") or not name.endswith(".weight"):
        return False, None
    if len(shape) != 2:
        return False, None
    module = name[: -len(".weight")]
    reason = skip_reason(module)
    if reason is not None:
        return False, reason
    if not layout_fits(shape, layout):
        rule = f"a dim not a multiple of {BLOCK if layout == 'block' else CHANNEL_MULTIPLE}"
        return False, f"shape {list(shape)}: {rule}"
    return True, None


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


def _torch() -> Any:
    import torch
    return torch


def _as_f32(arr: np.ndarray) -> Any:
    import numpy as np
    return _torch().from_numpy(np.ascontiguousarray(arr, dtype=np.float32))


def quantize(arr: np.ndarray, layout: str) -> tuple[np.ndarray, np.ndarray]:
    """Quantize a 2-D array to E4M3 in ``layout``.

    Returns:
        ``(weight, scale)``: the FP8 values (numpy ``float8_e4m3fn``) and the FP32 scales.
    """
    import ml_dtypes
    torch = _torch()
    w = _as_f32(arr)
    rows, cols = w.shape
    if layout == "block":
        r, c = math.ceil(rows / BLOCK), math.ceil(cols / BLOCK)
        padded = torch.zeros(r * BLOCK, c * BLOCK, dtype=torch.float32)
        padded[:rows, :cols] = w
        blocks = padded.view(r, BLOCK, c, BLOCK)
        amax = blocks.abs().amax(dim=(1, 3))
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        q = (blocks / scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX)
        q8 = q.to(torch.float8_e4m3fn).view(r * BLOCK, c * BLOCK)[:rows, :cols].contiguous()
    else:
        if layout == "channel":
            amax = w.abs().amax(dim=1, keepdim=True)
        else:
            amax = w.abs().amax().reshape(1)
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        q8 = (w / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    if bool(torch.isnan(w).any()) or bool(torch.isinf(w).any()):
        raise CkptError("non-finite values cannot be quantized to FP8")
    out = q8.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    return out, scale.contiguous().numpy()


def dequantize(weight: np.ndarray, scale: np.ndarray, dst: str) -> np.ndarray:
    """``weight * scale`` in FP32 (the scale broadcast per tensor, row or 128x128 block),
    rounded once to ``dst`` (``BF16``, ``F16``, ``F32``)."""
    import numpy as np

    from ckpt_cli import dtypes
    torch = _torch()
    w = _as_f32(weight)
    s = _as_f32(scale)
    kind = scale_kind(tuple(weight.shape), tuple(scale.shape))
    if kind == "block":
        s = s.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[: w.shape[0], : w.shape[1]]
    elif kind == "channel":
        s = s.reshape(-1, 1)
    elif kind == "tensor":
        s = s.reshape(())
    else:
        raise CkptError(f"scale shape {list(scale.shape)} fits no convention for a weight of "
                        f"shape {list(weight.shape)}")
    out = w * s
    tdt = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}[dst]
    res = out.to(tdt)
    if dst == "BF16":
        return np.asarray(res.view(torch.int16).numpy().view(dtypes.numpy_dtype("BF16")))
    return np.asarray(res.numpy())


def scale_kind(weight: tuple[int, ...], scale: tuple[int, ...]) -> str | None:
    """Which convention a scale of shape ``scale`` follows for ``weight`` (None: none)."""
    if len(weight) != 2:
        return None
    if scale in ((), (1,), (1, 1)):
        return "tensor"
    if scale in ((weight[0], 1), (weight[0],)):
        return "channel"
    if scale == (math.ceil(weight[0] / BLOCK), math.ceil(weight[1] / BLOCK)):
        return "block"
    return None


class Quantized:
    """Quantizes one tensor once, for its two outputs (weight and scale), whichever the
    writer asks for first; each result is released once taken."""

    def __init__(self, load: Callable[[], np.ndarray], layout: str, name: str) -> None:
        self._load, self._layout, self._name = load, layout, name
        self._lock = threading.Lock()
        self._result: list[np.ndarray | None] | None = None

    def _get(self, i: int) -> np.ndarray:
        with self._lock:
            if self._result is None:
                try:
                    w, s = quantize(self._load(), self._layout)
                except CkptError as e:
                    raise CkptError(f"{self._name}: {e}") from None
                self._result = [w, s]
            got = self._result[i]
            if got is None:  # asked twice (a retried write): quantize again
                w, s = quantize(self._load(), self._layout)
                got = (w, s)[i]
            self._result[i] = None
            return got

    def weight(self) -> np.ndarray:
        """The FP8 weight."""
        return self._get(0)

    def scale(self) -> np.ndarray:
        """The FP32 scale."""
        return self._get(1)


def quantization_config(layout: str, ignore: list[str]) -> dict[str, Any]:
    """The ``quantization_config`` for ``config.json``.

    Args:
        layout: ``block``, ``channel`` or ``tensor``.
        ignore: Module names of Linear-like weights left unquantized.
    """
    if layout == "block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [BLOCK, BLOCK], "modules_to_not_convert": ignore}
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": layout,
               "dynamic": False, "group_size": None, "block_structure": None,
               "actorder": None, "observer": "minmax", "observer_kwargs": {}}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None,
                                          "output_activations": None}},
            "ignore": ignore, "kv_cache_scheme": None, "global_compression_ratio": None}


def check_quantized(index: Any) -> tuple[list[Any], str] | None:
    """validate's ``quantization`` check: every FP8 weight has one scale of a legal shape and
    dtype, with finite positive values, and ``config.json``'s ``quantization_config`` agrees
    with the tensors (block size, ignored modules unquantized). None: no FP8 tensor.

    Args:
        index: The :class:`~ckpt_cli.model.CheckpointIndex`.
    """
    import json

    import numpy as np

    from ckpt_cli.model import Finding
    from ckpt_cli.tensors import TensorSource

    tensors = index.tensors
    weights = [t for t in tensors.values() if t.dtype in ("F8_E4M3", "F8_E5M2")]
    if not weights:
        return None
    found: list[Finding] = []

    def bad(code: str, msg: str, where: str | None) -> None:
        found.append(Finding("error", code, msg, None, where))

    kinds: dict[str, int] = {}
    reader = TensorSource(index)
    try:
        for w in weights:
            module, _, last = w.name.rpartition(".")
            scales = [tensors[f"{module}.{n}"] for n in SCALE_NAMES
                      if f"{module}.{n}" in tensors]
            if last != "weight" or not scales:
                bad("fp8-no-scale", f"{w.name} ({w.dtype} {list(w.shape)}) has no scale "
                    f"({', '.join(SCALE_NAMES)}): a loader ignoring that reads garbage", w.name)
                continue
            if len(scales) > 1:
                bad("fp8-scale-ambiguous", f"{w.name} has several scales: "
                    f"{', '.join(s.name for s in scales)}", w.name)
                continue
            s = scales[0]
            kind = scale_kind(tuple(w.shape), tuple(s.shape))
            if kind is None or s.dtype not in ("F32", "BF16", "F16"):
                bad("fp8-scale-shape", f"{s.name} ({s.dtype} {list(s.shape)}) fits no scale "
                    f"convention for {w.name} {list(w.shape)}", s.name)
                continue
            kinds[kind] = kinds.get(kind, 0) + 1
            vals = np.asarray(reader.read(s), dtype=np.float32)
            if not (np.isfinite(vals).all() and (vals > 0).all()):
                bad("fp8-scale-values", f"{s.name} holds non-finite, zero or negative "
                    "scales", s.name)
    finally:
        reader.close()
    qc = None
    try:
        config = index.base / "config.json"
        if index.base.is_dir() and config.is_file():
            qc = json.loads(config.read_bytes()).get("quantization_config")
    except (ValueError, AttributeError, OSError, CkptError):
        qc = None
    if isinstance(qc, dict):
        ignore = qc.get("modules_to_not_convert") or qc.get("ignore") or []
        fp8_modules = {w.name.rpartition(".")[0] for w in weights}
        for m in ignore if isinstance(ignore, list) else []:
            if isinstance(m, str) and m in fp8_modules:
                bad("fp8-config-ignored", f"config.json's quantization_config ignores {m}, "
                    "but its weight is FP8", f"{m}.weight")
        size = qc.get("weight_block_size")
        if qc.get("quant_method") == "fp8" and size not in (None, [BLOCK, BLOCK]):
            found.append(Finding("warning", "fp8-config-block",
                                 f"weight_block_size {size}: ckpt checks 128x128 blocks only",
                                 "config.json", None))
        elif qc.get("quant_method") == "fp8" and set(kinds) - {"block"}:
            bad("fp8-config-block", "config.json says block-wise FP8, but some scales are "
                f"per {' / '.join(sorted(set(kinds) - {'block'}))}", "config.json")
    summary = (f"{len(weights)} FP8 weight(s), scales: "
               + (", ".join(f"{n} per {k}" for k, n in sorted(kinds.items())) or "none")
               + ("; quantization_config " + str(qc.get("quant_method")) if isinstance(qc, dict)
                  else "; no quantization_config"))
    return found, summary
