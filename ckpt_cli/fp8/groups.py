"""Which weights ``convert --to fp8`` quantizes, decided the way the inference engines load
them: Linear weights only, and fused layers all or none.

vLLM and SGLang load several checkpoint Linears into one fused layer (``packed_modules_mapping``
in their model files: ``qkv_proj`` from ``q_proj``/``k_proj``/``v_proj``, ``gate_up_proj``
from ``gate_proj``/``up_proj``, an MoE expert's ``w13`` from ``w1``/``w3``) and refuse a
checkpoint in which some but not all of a fused layer's parts are quantized ("some but not
all shards of qkv_proj are quantized": ``is_layer_skipped`` in vllm
``model_executor/layers/quantization/utils/quant_utils.py`` and sglang
``srt/layers/quantization/utils.py``). So the members of a group are decided together
(:data:`FUSED_GROUPS`): when one cannot be held by the layout, the whole group stays in BF16
and is listed in the ignore list with the reason.

What a layout can hold (:func:`ckpt_cli.fp8.scheme.fit_reason`, :func:`group_fits`):

* ``block`` (128x128 ``weight_scale_inv``): the input dim (K) a multiple of 128: the engines
  quantize activations per token in groups of 128 along K (``per_token_group_quant_fp8``
  asserts ``x.shape[-1] % group_size == 0`` in vllm and sglang ``fp8_kernel``/``fp8_utils``).
  The output dim (N) may end in a partial block (the scale is ``ceil(N/128)`` rows): except
  in a fused layer, where every part but the last must be a multiple of 128
  (``validate_fp8_block_shape`` in both engines' ``fp8_utils.py``, "we allow the last matrix
  to not be a multiple of block size"). These are the rules at tensor parallelism 1; at TP
  ``t`` each rank's slice of N (column parallel) and of K (row parallel) must be a multiple
  of 128 too, which depends on how the model is served and is not checked here.
* ``channel``/``tensor``: both dims multiples of 16 (the FP8 GEMM kernels' rule), every member.

A fused weight already stored as one tensor (``qkv_proj``, ``gate_up_proj``,
``query_key_value``, ``W_pack``) is checked in block layout against its parts' sizes, from
``config.json``'s head counts where it has them (:func:`fused_parts`).

Never quantized whatever their shape: embeddings (by name across the common families, and any
weight tied to one), the output head (``lm_head``, GPT-NeoX's ``embed_out``), norms and MoE
routers (:data:`ckpt_cli.fp8.scheme.SKIP_PATTERNS`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ckpt_cli.fp8.scheme import BLOCK, FLOATS, fit_reason, skip_reason

FUSED_GROUPS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("q_proj", "k_proj", "v_proj"), "qkv_proj"),
    (("gate_proj", "up_proj"), "gate_up_proj"),
    (("w1", "w3"), "w13 (MoE expert gate/up)"),
    (("query", "key", "value"), "qkv"),
)
"""``(members in the fused layer's order, the fused layer's name)``: sibling Linears the
engines load as one layer (vllm/sglang ``packed_modules_mapping``)."""

FUSED_TENSORS = ("qkv_proj", "gate_up_proj", "query_key_value", "W_pack")
"""Module names of weights stored already fused (Phi-3, GPT-NeoX, Falcon, Baichuan)."""


@dataclass(slots=True)
class Choice:
    """What a conversion quantizes.

    Attributes:
        picked: Weight names to quantize, in the order given.
        ignore: Module names of Linear-like weights left unquantized (the ignore list).
        left: ``(weight name, reason)`` for each Linear-like weight left unquantized that is
            not an embedding, norm or output head (what the notes name).
    """

    picked: list[str] = field(default_factory=list)
    ignore: list[str] = field(default_factory=list)
    left: list[tuple[str, str]] = field(default_factory=list)


def group_of(module: str) -> tuple[str, tuple[str, ...], str] | None:
    """``(parent, member names in order, fused name)`` when ``module``'s last part is a
    member of a fused group, else None."""
    parent, _, last = module.rpartition(".")
    for members, fused in FUSED_GROUPS:
        if last in members:
            return parent, members, fused
    return None


def group_fits(parts: list[tuple[str, tuple[int, ...]]], layout: str) -> str | None:
    """Why the fused layer made of ``parts`` (``(name, shape)`` in the fused order) cannot be
    held by ``layout`` (None: it can). Each part must fit on its own; in block layout every
    part but the last must also fill whole 128-row blocks."""
    for name, shape in parts:
        why = fit_reason(shape, layout)
        if why is not None:
            return f"{name}: {why}"
    if layout == "block" and len(parts) > 1:
        for name, shape in parts[:-1]:
            if shape[0] % BLOCK:
                return (f"{name}: output dim {shape[0]} not a multiple of {BLOCK}, and it is "
                        "not the last part of its fused layer")
    return None


def fused_parts(module: str, shape: tuple[int, ...],
                config: Mapping[str, Any] | None) -> list[tuple[str, tuple[int, ...]]] | None:
    """The parts of a weight stored already fused (``qkv_proj``...), as ``(name, shape)`` in
    order; None when ``module`` is not such a weight. Head counts come from ``config``
    (``num_attention_heads``, ``num_key_value_heads``, ``head_dim``); without them the rows
    are split evenly."""
    last = module.rpartition(".")[2]
    if last not in FUSED_TENSORS or len(shape) != 2:
        return None
    rows, cols = shape
    if last == "gate_up_proj":
        sizes = [rows // 2, rows - rows // 2]
    else:
        sizes = _qkv_rows(rows, config)
    return [(f"{module}[{i}]", (n, cols)) for i, n in enumerate(sizes)]


def _qkv_rows(rows: int, config: Mapping[str, Any] | None) -> list[int]:
    cfg = config or {}
    heads = _int(cfg.get("num_attention_heads"))
    hidden = _int(cfg.get("hidden_size"))
    kv = _int(cfg.get("num_key_value_heads")) or heads
    head_dim = _int(cfg.get("head_dim")) or (hidden // heads if hidden and heads else None)
    if heads and kv and head_dim and (heads + 2 * kv) * head_dim == rows:
        return [heads * head_dim, kv * head_dim, kv * head_dim]
    third = rows // 3
    return [third, third, rows - 2 * third]


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 < v < 1 << 40 else None


def choose(weights: Iterable[tuple[str, str, tuple[int, ...]]], layout: str, *,
           tied: Mapping[str, str] | None = None,
           config: Mapping[str, Any] | None = None) -> Choice:
    """Decide which weights to quantize.

    Args:
        weights: ``(name, dtype, shape)`` of the output tensors, in order.
        layout: ``block``, ``channel`` or ``tensor``.
        tied: Weights written once for two names (tied), name -> the other name: never
            quantized (the loader re-ties them, and the other module, an embedding or the
            output head typically, does not read FP8).
        config: ``config.json`` (for the parts of already-fused weights).

    Returns:
        The :class:`Choice`.
    """
    linear: dict[str, tuple[int, ...]] = {}
    out = Choice()
    skipped: dict[str, str] = {}
    for name, dtype, shape in weights:
        if dtype not in FLOATS or not name.endswith(".weight") or len(shape) != 2:
            continue
        module = name[: -len(".weight")]
        reason = skip_reason(module)
        if reason is None and tied and name in tied:
            reason = f"tied to {tied[name]}"
        if reason is not None:
            skipped[module] = reason
            continue
        linear[name] = tuple(shape)
    verdict: dict[str, str | None] = {}
    for name, shape in linear.items():
        if name in verdict:
            continue
        module = name[: -len(".weight")]
        found = group_of(module)
        if found is None:
            parts = fused_parts(module, shape, config)
            verdict[name] = group_fits(parts, layout) if parts else fit_reason(shape, layout)
            continue
        parent, members, fused = found
        prefix = f"{parent}." if parent else ""
        names = [f"{prefix}{m}.weight" for m in members if f"{prefix}{m}.weight" in linear]
        why = group_fits([(n[: -len(".weight")], linear[n]) for n in names], layout)
        for n in names:
            verdict[n] = None if why is None else f"fused {prefix}{fused}: {why}"
    for name in linear:
        why = verdict[name]
        if why is None:
            out.picked.append(name)
        else:
            out.left.append((name, why))
    ignore = {n[: -len(".weight")] for n, _ in out.left}
    # Linear modules left by rule (the output head, MoE routers, a weight tied to another)
    # are listed too; embeddings and norms are not Linear layers.
    ignore.update(m for m, r in skipped.items() if r not in ("embedding", "norm"))
    if not any(m.rpartition(".")[2] == "lm_head" for m in ignore):
        ignore.add("lm_head")
    out.ignore = sorted(ignore)
    return out


def half_quantized(fp8_weights: set[str], weights: Mapping[str, tuple[int, ...]]
                   ) -> list[tuple[str, list[str], list[str]]]:
    """Fused groups with some but not all members quantized: ``(fused layer, quantized,
    unquantized)`` each (what vLLM and SGLang refuse to load).

    Args:
        fp8_weights: Names of the FP8 weights.
        weights: Every 2-D ``*.weight`` of the checkpoint, name -> shape.
    """
    seen: set[tuple[str, str]] = set()
    out: list[tuple[str, list[str], list[str]]] = []
    for name in weights:
        found = group_of(name[: -len(".weight")]) if name.endswith(".weight") else None
        if found is None:
            continue
        parent, members, fused = found
        if (parent, fused) in seen:
            continue
        seen.add((parent, fused))
        prefix = f"{parent}." if parent else ""
        names = [f"{prefix}{m}.weight" for m in members if f"{prefix}{m}.weight" in weights]
        q = [n for n in names if n in fp8_weights]
        if q and len(q) < len(names):
            out.append((f"{prefix}{fused.split()[0]}", q, [n for n in names if n not in q]))
    return out
