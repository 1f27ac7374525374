"""What an FP8 checkpoint tells its loaders: the ``quantization_config`` ``convert --to fp8``
writes into ``config.json`` (:func:`quantization_config`), and validate's check that the
FP8 weights, their scales and that config agree (:func:`check_quantized`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ckpt_cli.errors import UsageError
from ckpt_cli.fp8 import groups
from ckpt_cli.fp8.scheme import (
    BLOCK,
    FP8_DTYPES,
    pair_scales,
    read_model_config,
    read_quantization_config,
    scale_values_problem,
    skip_reason,
)
from ckpt_cli.model import Finding
from ckpt_cli.tensors.source import TensorSource

ACTIVATIONS = ("dynamic", "none")
"""``--fp8-activations`` choices for the channel/tensor layouts."""

DYNAMIC_TOKEN = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                 "dynamic": True, "group_size": None, "block_structure": None, "actorder": None,
                 "observer": None, "observer_kwargs": {}}
"""Input activations quantized to FP8 per token at run time (llm-compressor's FP8_DYNAMIC):
what sends vLLM and SGLang to their FP8 GEMMs (``CompressedTensorsW8A8Fp8``) rather than
weight-only FP8 (``CompressedTensorsW8A16Fp8``, BF16 matmuls)."""


def quantization_config(layout: str, ignore: list[str],
                        activations: str = "dynamic") -> dict[str, Any]:
    """The ``quantization_config`` for ``config.json``.

    Args:
        layout: ``block``, ``channel`` or ``tensor``.
        ignore: Module names of Linear-like weights left unquantized. Written under every key
            the current loaders read: ``modules_to_not_convert`` (transformers) and
            ``ignored_layers`` (vLLM, SGLang) for the ``fp8`` method, ``ignore`` for
            compressed-tensors.
        activations: ``dynamic`` (per-token FP8 activations at run time: W8A8) or ``none``
            (weight-only, W8A16, for GPUs without FP8 matmuls). The block layout's activations
            are always dynamic (per token, per 128 along K).
    """
    if activations not in ACTIVATIONS:
        raise UsageError(f"fp8_activations must be dynamic or none, not {activations!r}",
                         param="fp8_activations")
    if layout == "block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [BLOCK, BLOCK], "modules_to_not_convert": list(ignore),
                "ignored_layers": list(ignore)}
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": layout,
               "dynamic": False, "group_size": None, "block_structure": None,
               "actorder": None, "observer": "minmax", "observer_kwargs": {}}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {
                "targets": ["Linear"], "weights": weights,
                "input_activations": dict(DYNAMIC_TOKEN) if activations == "dynamic" else None,
                "output_activations": None}},
            "ignore": list(ignore), "kv_cache_scheme": None, "global_compression_ratio": None}


def check_quantized(index: Any) -> tuple[list[Any], str] | None:
    """validate's ``quantization`` check. None: no FP8 tensor.

    - Every FP8 weight that the checkpoint says is quantized with a scale (a
      ``quantization_config``, or scale-named tensors: :func:`ckpt_cli.fp8.scheme.
      scales_expected`) has one scale of a legal shape and dtype, with finite positive values;
      an FP8 tensor nothing claims a scale for is raw FP8 values (a note).
    - ``config.json``'s ``quantization_config`` agrees with the tensors (block size, ignored
      modules unquantized), and where it is there (it addresses vLLM and SGLang as much as
      transformers) what those engines refuse is an error: a fused layer some but not all of
      whose parts are quantized, a quantized embedding or output head, a block-wise weight
      whose input dim is not a multiple of 128 (:mod:`ckpt_cli.fp8.groups`).
    - The families the engines read differently (:func:`_check_families`): a scaled FP8
      GPT-2 ``Conv1D`` weight, a block-wise GPT-NeoX ``query_key_value`` whose head_dim is
      not a multiple of 128, an MoE ``experts`` module partly quantized or left BF16 without
      being named in the ignore list.

    Args:
        index: The :class:`~ckpt_cli.model.CheckpointIndex`.
    """
    tensors = index.tensors
    weights = [t for t in tensors.values() if t.dtype in FP8_DTYPES]
    if not weights:
        return None
    found: list[Finding] = []

    def bad(code: str, msg: str, where: str | None) -> None:
        found.append(Finding("error", code, msg, None, where))

    qc, _source = read_quantization_config(index)
    # The pairing inspect and diff use (one scale of a known shape and dtype per weight); here
    # what it warns of is an error, and the scales' values are read too.
    pairing = pair_scales(tensors, qc)
    raw = 0
    for f in pairing.findings:
        if f.code == "fp8-scale-without-weight":
            continue  # a spare scale misleads no loader of the weights (dequantize refuses it)
        if f.severity == "info":  # raw FP8 values, which nothing claims are quantized
            raw += 1
            found.append(f)
        else:
            bad(f.code, f.message, f.location)
    kinds: dict[str, int] = {}
    reader = TensorSource(index)
    try:
        for p in pairing.pairs.values():
            kinds[p.kind] = kinds.get(p.kind, 0) + 1
            vals = np.asarray(reader.read(p.scale), dtype=np.float32)
            if (why := scale_values_problem(vals, p.scale.dtype)) is not None:
                bad("fp8-scale-values", f"{p.scale.name} {why}", p.scale.name)
    finally:
        reader.close()
    _check_families(index, pairing, qc, bad)
    if isinstance(qc, dict):
        _check_config(qc, weights, kinds, bad, found)
        fp8_names = {w.name for w in weights}
        two_d = {t.name: tuple(t.shape) for t in tensors.values()
                 if t.name.endswith(".weight") and len(t.shape) == 2}
        for fused, q, rest in groups.half_quantized(fp8_names, two_d):
            bad("fp8-fused-partial", f"fused layer {fused}: {', '.join(q)} quantized but "
                f"{', '.join(rest)} not; vLLM and SGLang load them as one layer and refuse "
                "some but not all parts quantized", rest[0])
        for w in weights:
            module = w.name.rpartition(".")[0]
            reason = skip_reason(module) if w.name.endswith(".weight") else None
            if reason in ("embedding", "output head (lm_head)"):
                bad("fp8-not-linear", f"{w.name} is FP8, but it is an {reason}: inference "
                    "engines quantize Linear layers only, so its scale has nowhere to load",
                    w.name)
    summary = (f"{len(weights)} FP8 weight(s), scales: "
               + (", ".join(f"{n} per {k}" for k, n in sorted(kinds.items())) or "none")
               + (f"; {raw} raw FP8 tensor(s) without a scale" if raw else "")
               + ("; quantization_config " + str(qc.get("quant_method")) if isinstance(qc, dict)
                  else "; no quantization_config"))
    return found, summary


def _check_families(index: Any, pairing: Any, qc: dict[str, Any] | None, bad: Any) -> None:
    """What vLLM and SGLang read differently by family (:mod:`ckpt_cli.fp8.groups` has the
    sources): GPT-2 ``Conv1D`` weights (any scaled FP8 one), and where a
    ``quantization_config`` addresses the engines, GPT-NeoX's per-head ``query_key_value``
    in block layout and MoE ``experts`` modules."""
    model = read_model_config(index)
    two_d = {t.name: tuple(t.shape) for t in index.tensors.values()
             if t.name.endswith(".weight") and len(t.shape) == 2}
    # pair_scales pairs a scale of the stored [in, out] shape only (or a per-tensor one)
    for name in sorted(groups.conv1d_weights(two_d, model) & set(pairing.pairs)):
        p = pairing.pairs[name]
        rows, cols = two_d[name]
        how = ("a per-tensor scale survives that" if p.kind == "tensor" else
               "so a square weight loads with its scales transposed" if rows == cols else
               "so its scale, laid out for the stored shape, does not fit the weight")
        bad("fp8-conv1d", f"{name} ({rows}, {cols}) is FP8, but it is a GPT-2 Conv1D weight "
            f"stored (in, out): vLLM's and SGLang's gpt2.py transpose the weight on load but "
            f"not its scale ({how}), and transformers quantizes nn.Linear only; keep Conv1D "
            "weights BF16 (ckpt convert --to fp8 does)", name)
    if not isinstance(qc, dict) or qc.get("quant_method") not in ("fp8", "compressed-tensors"):
        return
    for name, p in pairing.pairs.items():
        module = name[: -len(".weight")]
        if p.kind == "block" and groups.interleaved_heads(module, model):
            why = groups.heads_reason(model)
            if why is not None:
                bad("fp8-fused-heads", f"{name}: block-wise FP8, but {why}", name)
    fp8 = {t.name for t in index.tensors.values() if t.dtype in FP8_DTYPES}
    units: dict[str, list[str]] = {}
    for name in two_d:
        unit = groups.experts_unit(name[: -len(".weight")])
        if unit is not None:
            units.setdefault(unit, []).append(name)
    ignore = qc.get("ignored_layers") or qc.get("modules_to_not_convert") or qc.get("ignore")
    listed = {m.removeprefix("model.") for m in ignore if isinstance(m, str)} if isinstance(
        ignore, list) else set()
    for unit, names in sorted(units.items()):
        q = [n for n in names if n in fp8]
        if q and len(q) < len(names):
            rest = [n for n in names if n not in fp8]
            bad("fp8-experts-partial", f"MoE layer {unit}: {len(q)} expert weight(s) FP8 and "
                f"{len(rest)} not (e.g. {rest[0]}); vLLM and SGLang load all experts of a "
                "module as one FusedMoE layer with one method", rest[0])
        elif (not q and fp8 and qc.get("quant_method") == "fp8"
              and unit.removeprefix("model.") not in listed):
            bad("fp8-experts-ignore", f"MoE layer {unit}: its experts are not FP8, but the "
                f"quantization_config's ignore list does not name {unit} (SGLang matches "
                "ignore entries exactly and would load them with its FP8 MoE method)",
                names[0])


def _check_config(qc: dict[str, Any], weights: list[Any], kinds: dict[str, int], bad: Any,
                  found: list[Any]) -> None:
    """The ``quantization_config`` against the tensors: ignored modules unquantized, the
    block size, and block-wise weights the engines can load."""
    ignore = qc.get("modules_to_not_convert") or qc.get("ignore") or []
    fp8_modules = {w.name.rpartition(".")[0] for w in weights}
    for m in ignore if isinstance(ignore, list) else []:
        if isinstance(m, str) and m in fp8_modules:
            bad("fp8-config-ignored", f"config.json's quantization_config ignores {m}, "
                "but its weight is FP8", f"{m}.weight")
    size = qc.get("weight_block_size")
    if qc.get("quant_method") != "fp8":
        return
    if size not in (None, [BLOCK, BLOCK]):
        found.append(Finding("warning", "fp8-config-block",
                             f"weight_block_size {size}: ckpt checks 128x128 blocks only",
                             "config.json", None))
        return
    if set(kinds) - {"block"}:
        bad("fp8-config-block", "config.json says block-wise FP8, but some scales are "
            f"per {' / '.join(sorted(set(kinds) - {'block'}))}", "config.json")
    for w in weights:
        if len(w.shape) == 2 and w.shape[1] % BLOCK:
            bad("fp8-block-input", f"{w.name} {list(w.shape)}: block-wise FP8 with an input "
                f"dim not a multiple of {BLOCK}; vLLM and SGLang quantize its activations in "
                "groups of 128 along it and refuse the layer", w.name)
