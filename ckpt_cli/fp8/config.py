"""What an FP8 checkpoint tells its loaders: the ``quantization_config`` ``convert --to fp8``
writes into ``config.json`` (:func:`quantization_config`), and validate's check that the
FP8 weights, their scales and that config agree (:func:`check_quantized`).
"""

from __future__ import annotations

from typing import Any

from ckpt_cli.errors import CkptError
from ckpt_cli.fp8.scheme import BLOCK, SCALE_NAMES, scale_kind


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
    import numpy as np

    from ckpt_cli import storage
    from ckpt_cli.model import Finding
    from ckpt_cli.tensors.source import TensorSource

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
            qc = storage.load_side_json(config, "config").get("quantization_config")
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
