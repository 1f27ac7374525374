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
  in a fused layer, where every part must be a multiple of 128. vLLM allows the last part
  partial (``validate_fp8_block_shape`` in ``layers/quantization/utils/fp8_utils.py``), but
  SGLang checks every part of a merged layer (``Fp8LinearMethod.validate_block_quant_shapes``
  in ``srt/layers/quantization/fp8.py``), so ckpt holds the stricter rule. These are the rules
  at tensor parallelism 1; at TP ``t`` each rank's slice of N (column parallel) and of K (row
  parallel) must be a multiple of 128 too, which depends on how the model is served and is not
  checked here.
* ``channel``/``tensor``: both dims multiples of 16 (the FP8 GEMM kernels' rule), every member.

A fused weight already stored as one tensor (``qkv_proj``, ``gate_up_proj``,
``query_key_value``, ``W_pack``) is checked in block layout against its parts' sizes, from
``config.json``'s head counts where it has them (:func:`fused_parts`).

Families the engines read differently (:func:`family_reason`, :func:`experts_unit`):

* GPT-2's ``Conv1D`` weights (``c_attn``, ``c_proj``, ``c_fc``) are stored ``[in, out]``. The
  ``GPT2LMHeadModel.load_weights`` of vLLM and SGLang (``models/gpt2.py``) transpose every
  name ending in ``.weight`` of those modules and nothing else, so a scale is loaded as
  stored, laid out for the wrong orientation; transformers and compressed-tensors quantize
  ``nn.Linear`` only. They stay BF16 and are listed in the ignore list.
* GPT-NeoX's ``query_key_value`` stores q, k and v interleaved per head; vLLM's and SGLang's
  ``GPTNeoXForCausalLM.load_weights`` (``models/gpt_neox.py``) reorder every parameter with an
  ``output_dim`` (the block scale too) by ``view(num_heads, 3, -1)``. A block scale has
  ``3 * num_heads`` rows only when ``head_dim`` is a multiple of 128 (otherwise the view fails,
  and a 128-row block would mix q, k and v of different heads), so in block layout it is
  quantized only then.
* MoE experts (``...experts.<i>.<proj>``) are one layer per ``experts`` module in the engines
  (``FusedMoE``, quantized by ``Fp8MoEMethod``, which needs the intermediate size a multiple
  of 128 in block layout): all experts of a module are quantized or none, and when none, the
  ignore list names the ``experts`` module itself (SGLang's ``is_layer_skipped`` in
  ``srt/layers/quantization/utils.py`` matches entries exactly; vLLM's, in
  ``quantization/utils/quant_utils.py``, also matches an entry that contains the prefix) as
  well as each projection.

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
        for name, shape in parts:
            if shape[0] % BLOCK:
                return (f"{name}: output dim {shape[0]} not a multiple of {BLOCK} in a fused "
                        "layer (SGLang checks every part)")
    return None


CONV1D_TYPES = ("gpt2", "openai-gpt", "imagegpt", "decision_transformer")
"""``model_type`` of the families whose ``c_attn``/``c_proj``/``c_fc`` are ``Conv1D``."""

CONV1D_NAMES = ("c_attn", "q_attn", "c_proj", "c_fc")

CONV1D_REASON = ("GPT-2 Conv1D weight, stored (in, out): vLLM's and SGLang's gpt2.py transpose "
                 "the weight on load but not its scale; transformers quantizes nn.Linear only")

INTERLEAVED_TYPES = ("gpt_neox",)
"""``model_type`` of the families whose ``query_key_value`` is interleaved per head."""


def _model_type(config: Mapping[str, Any] | None) -> str | None:
    t = (config or {}).get("model_type")
    return t if isinstance(t, str) else None


def conv1d_weights(weights: Mapping[str, tuple[int, ...]],
                   config: Mapping[str, Any] | None) -> set[str]:
    """The names of ``weights`` (name -> shape) that are GPT-2 ``Conv1D`` weights, stored
    ``[in, out]``: by ``config.json``'s ``model_type`` where there is one, else when a
    ``c_attn`` weight is ``[hidden, 3 * hidden]`` (a Linear one is ``[3 * hidden, hidden]``)."""
    kind = _model_type(config)
    named = {n for n in weights if n.endswith(".weight")
             and n[: -len(".weight")].rpartition(".")[2] in CONV1D_NAMES}
    if kind is not None:
        return named if kind in CONV1D_TYPES else set()
    if any(n.endswith("c_attn.weight") and len(weights[n]) == 2
           and weights[n][1] == 3 * weights[n][0] for n in named):
        return named
    return set()


def interleaved_heads(module: str, config: Mapping[str, Any] | None) -> bool:
    """Whether ``module`` is a GPT-NeoX ``query_key_value`` (q, k, v interleaved per head),
    by ``model_type``, else by the ``gpt_neox.`` prefix of its name."""
    if module.rpartition(".")[2] != "query_key_value":
        return False
    kind = _model_type(config)
    return kind in INTERLEAVED_TYPES if kind is not None else module.startswith("gpt_neox.")


def heads_reason(config: Mapping[str, Any] | None) -> str | None:
    """Why an interleaved ``query_key_value`` cannot be block-quantized (None: it can): the
    engines reorder its block scale per head, which needs ``head_dim`` a multiple of 128."""
    cfg = config or {}
    heads, hidden = _int(cfg.get("num_attention_heads")), _int(cfg.get("hidden_size"))
    if not heads or not hidden:
        return ("q/k/v interleaved per head, and config.json gives no head count: vLLM and "
                "SGLang reorder the block scale per head (view(num_heads, 3, -1))")
    head_dim = hidden // heads
    if head_dim % BLOCK:
        return (f"q/k/v interleaved per head with head_dim {head_dim}, not a multiple of "
                f"{BLOCK}: vLLM and SGLang reorder the block scale per head "
                "(view(num_heads, 3, -1)), which its 128-row blocks do not allow")
    return None


def experts_unit(module: str) -> str | None:
    """The ``experts`` module an MoE expert's projection belongs to
    (``model.layers.0.mlp.experts.3.gate_proj`` -> ``model.layers.0.mlp.experts``), else None."""
    parts = module.split(".")
    for i in range(len(parts) - 2, 0, -1):
        if parts[i].isdigit() and parts[i - 1] == "experts":
            return ".".join(parts[:i])
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
    conv1d = conv1d_weights(linear, config)
    for name, shape in linear.items():
        if name in verdict:
            continue
        module = name[: -len(".weight")]
        if name in conv1d:
            verdict[name] = CONV1D_REASON
            continue
        found = group_of(module)
        if found is None:
            parts = fused_parts(module, shape, config)
            why = group_fits(parts, layout) if parts else fit_reason(shape, layout)
            if why is None and layout == "block" and interleaved_heads(module, config):
                why = heads_reason(config)
            verdict[name] = why
            continue
        parent, members, fused = found
        prefix = f"{parent}." if parent else ""
        names = [f"{prefix}{m}.weight" for m in members if f"{prefix}{m}.weight" in linear]
        why = group_fits([(n[: -len(".weight")], linear[n]) for n in names], layout)
        for n in names:
            verdict[n] = None if why is None else f"fused {prefix}{fused}: {why}"
    units = _experts_verdicts(verdict)
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
    ignore.update(units)
    if not any(m.rpartition(".")[2] == "lm_head" for m in ignore):
        ignore.add("lm_head")
    out.ignore = sorted(ignore)
    return out


def _experts_verdicts(verdict: dict[str, str | None]) -> set[str]:
    """Decide each ``experts`` module's weights together (one ``FusedMoE`` layer in the
    engines), in place: when one is left, all are. Returns the modules left."""
    members: dict[str, list[str]] = {}
    for name in verdict:
        unit = experts_unit(name[: -len(".weight")])
        if unit is not None:
            members.setdefault(unit, []).append(name)
    left: set[str] = set()
    for unit, names in members.items():
        why = next((verdict[n] for n in names if verdict[n] is not None), None)
        if why is None:
            continue
        left.add(unit)
        for n in names:
            verdict[n] = f"experts {unit} (one MoE layer): {why}"
    return left


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
