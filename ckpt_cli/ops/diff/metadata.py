"""``diff`` of what is not a tensor: the training facts (step, epoch, learning rate,
hyper-parameters) of each side, compared by canonical name."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import TYPE_CHECKING, Any

from ckpt_cli.formats import provenance
from ckpt_cli.formats.containers import group_of
from ckpt_cli.formats.provenance import is_provenance
from ckpt_cli.formats.torchfile import role_of
from ckpt_cli.model import CheckpointIndex
from ckpt_cli.ops.diff.result import (
    MetaDiff,
)

if TYPE_CHECKING:
    from ckpt_cli.ops.diff.result import TensorDiff

_CANONICAL = {"step": "step", "global_step": "step", "epoch": "epoch",
              provenance.STEP: "step", provenance.EPOCH: "epoch"}


def facts(index: CheckpointIndex, *, everything: bool = False) -> dict[str, Any]:
    """The non-tensor values of a checkpoint that ``diff`` compares, by flattened key.

    Training metadata (``step``, ``epoch``, ``lr``, versions; nested dicts such as
    ``hyper_parameters`` flattened one level) plus the checkpoint's non-tensor leaves. Leaves
    under optimizer, scheduler, RNG and loop-state keys, or read from such files (DeepSpeed's
    ``*_optim_states.pt``, ``rng_state.pth``), are left out unless ``everything``.

    Args:
        index: The checkpoint.
        everything: Keep optimizer/RNG/scheduler leaves too.

    Returns:
        Values by key.
    """
    out: dict[str, Any] = {}
    meta = index.metadata
    for k, v in meta.items():
        if isinstance(v, dict):
            for k2, v2 in v.items():
                # A safetensors header's (or ckpt's) step/epoch is already the canonical
                # step/epoch.
                if k in provenance.METADATA_DICTS and _CANONICAL.get(k2) in meta:
                    continue
                out[f"{k}.{k2}"] = v2
        else:
            out[k] = v
    for k, v in index.objects.items():
        if everything or _training_state(k) is None:
            out.setdefault(k, v)
    return out


def _training_state(key: str) -> str | None:
    """``optimizer`` or ``other`` for a non-tensor leaf holding optimizer/scheduler/RNG/loop
    state, judged by its top-level key or the file stem naming it (``optimizer.``,
    ``zero_pp_rank_0_mp_rank_00_optim_states.``, ``rng_state.``); None otherwise."""
    head = key.split(".", 1)[0]
    group = group_of((head,), None, "meta")
    if group in ("optimizer", "other"):
        return group
    role = role_of(head + ".pt")
    return {"optimizer": "optimizer", "scheduler": "other", "rng": "other",
            "other": "other"}.get(role)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) != isinstance(b, bool):
        return False
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return bool(a == b)


def diff_metadata(index_a: CheckpointIndex, index_b: CheckpointIndex, *,
                  everything: bool = False) -> list[MetaDiff]:
    """The non-tensor values that differ between two checkpoints.

    Args:
        index_a: Side A.
        index_b: Side B.
        everything: Include optimizer/RNG/scheduler values (see :func:`facts`).

    Returns:
        Differences in A's key order, then B-only keys in B's order; provenance keys
        (:func:`ckpt_cli.formats.provenance.is_provenance`) are marked.
    """
    fa, fb = facts(index_a, everything=everything), facts(index_b, everything=everything)
    out: list[MetaDiff] = []
    for k, va in fa.items():
        if k not in fb:
            out.append(MetaDiff(k, va, None, "only_in_a", is_provenance(k)))
        elif not _same(va, fb[k]):
            out.append(MetaDiff(k, va, fb[k], "changed", is_provenance(k)))
    out.extend(MetaDiff(k, None, vb, "only_in_b", is_provenance(k))
               for k, vb in fb.items() if k not in fa)
    return out


_DTYPE_NAMES = {"float64": "F64", "double": "F64", "float32": "F32", "float": "F32",
                "float16": "F16", "half": "F16", "bfloat16": "BF16"}
"""A config's ``dtype``/``torch_dtype`` values, as dtype codes."""


def mark_dtype_follows(metadata: list[MetaDiff], tensors: list[TensorDiff]) -> list[MetaDiff]:
    """Mark a config's changed ``dtype``/``torch_dtype`` that changed exactly as the tensors'
    dtypes did (most tensors whose dtype changed, FP8 ones aside, went from the config's A
    dtype to its B dtype: what ``convert --to`` writes). Such a value is a note, not a
    difference; any other config change still is one.

    Args:
        metadata: The non-tensor differences (:func:`diff_metadata`).
        tensors: The compared tensors.

    Returns:
        ``metadata`` with those entries' ``follows`` set.
    """

    # FP8 weights are quantized, not cast: the config's dtype names what the rest became
    pairs = Counter((t.dtype_a, t.dtype_b) for t in tensors if t.dtype_changed
                    and not t.dtype_a.startswith("F8_") and not t.dtype_b.startswith("F8_"))
    if not pairs:
        return metadata
    (common, _n), = pairs.most_common(1)
    out: list[MetaDiff] = []
    for m in metadata:
        last = m.key.rpartition(".")[2]
        if (m.status == "changed" and last in ("dtype", "torch_dtype")
                and m.key.split(".", 1)[0] == "config"
                and isinstance(m.a, str) and isinstance(m.b, str)
                and (_DTYPE_NAMES.get(m.a), _DTYPE_NAMES.get(m.b)) == common):
            m = dataclasses.replace(m, follows=f"{common[0]} -> {common[1]}")
        out.append(m)
    return out
