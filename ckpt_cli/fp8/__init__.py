"""FP8 (E4M3) weights: which tensors a conversion quantizes, their scales, and both directions.

- ``scheme``: the rules (:func:`qualifies`, :data:`SKIP_PATTERNS`, the scales' names and
  shapes, :func:`scale_kind`) and what scheme a checkpoint uses, from its metadata alone
  (``describe``, ``pair_scales``: what ``inspect`` and ``diff`` show).
- ``encode``: quantizing (:func:`quantize`, :func:`quantize_pieces`, :class:`Quantized`), bit
  for bit torch's ``.to(float8_e4m3fn)``; ``decode``: :func:`dequantize`,
  :func:`dequantize_pieces`; ``rows``: the row passes and cast-thread jobs both share.
- ``config``: the ``quantization_config`` written into ``config.json`` and validate's
  ``quantization`` check (:func:`check_quantized`).

The rules are re-exported here (``ckpt_cli.fp8.qualifies``); the kernels lazily, at first use,
so ``inspect``, which only asks the scheme, loads no more than ``scheme``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ckpt_cli.fp8.scheme import BLOCK as BLOCK
from ckpt_cli.fp8.scheme import CHANNEL_MULTIPLE as CHANNEL_MULTIPLE
from ckpt_cli.fp8.scheme import FP8_MAX as FP8_MAX
from ckpt_cli.fp8.scheme import LAYOUTS as LAYOUTS
from ckpt_cli.fp8.scheme import SCALE_NAMES as SCALE_NAMES
from ckpt_cli.fp8.scheme import SKIP_PATTERNS as SKIP_PATTERNS
from ckpt_cli.fp8.scheme import layout_fits as layout_fits
from ckpt_cli.fp8.scheme import qualifies as qualifies
from ckpt_cli.fp8.scheme import scale_kind as scale_kind
from ckpt_cli.fp8.scheme import scale_name as scale_name
from ckpt_cli.fp8.scheme import scale_shape as scale_shape
from ckpt_cli.fp8.scheme import scale_shape_problem as scale_shape_problem
from ckpt_cli.fp8.scheme import scale_values_problem as scale_values_problem
from ckpt_cli.fp8.scheme import skip_reason as skip_reason

if TYPE_CHECKING:
    from ckpt_cli.fp8.config import check_quantized as check_quantized
    from ckpt_cli.fp8.config import quantization_config as quantization_config
    from ckpt_cli.fp8.decode import dequantize as dequantize
    from ckpt_cli.fp8.decode import dequantize_pieces as dequantize_pieces
    from ckpt_cli.fp8.encode import Quantized as Quantized
    from ckpt_cli.fp8.encode import quantize as quantize
    from ckpt_cli.fp8.encode import quantize_pieces as quantize_pieces
    from ckpt_cli.fp8.encode import scales_only as scales_only

_KERNELS = {"Quantized": "encode", "quantize": "encode", "quantize_pieces": "encode",
            "scales_only": "encode", "dequantize": "decode", "dequantize_pieces": "decode",
            "quantization_config": "config", "check_quantized": "config"}
"""Each lazily re-exported name's submodule."""

if not TYPE_CHECKING:  # mypy sees the imports above

    def __getattr__(name: str) -> Any:
        if name not in _KERNELS:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{__name__}.{_KERNELS[name]}"), name)
        globals()[name] = value
        return value
