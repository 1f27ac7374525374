"""``diff --all`` between a training checkpoint and its ``convert --to dcp`` output: each of the
source's tensors is met under the name the conversion gives it.

The source is read as ``convert --to dcp`` reads it (the same framework readers: a plain
``torch.save`` dict, an HF Trainer ``checkpoint-N``, a Lightning ``.ckpt``...) and laid out in
the DCP side's layout (``torchtitan`` or ``recipe``, whichever names more of its tensors), so
every tensor of that layout has its DCP key. A tensor the conversion copies from the source
(weights, optimizer moments named by the model's parameter order or the framework's grouping,
the RNG state) reads one stored tensor of the source; the source side's tensor stored at the
same place (file, offset, shape, dtype) is renamed to that key. Nothing is paired by name or
by value: a pair is the same stored bytes, so the values compared are the source's own.

A value the conversion makes rather than copies (torchtitan's ``train_state.step``, an int32
tensor made from the source's step) has no stored counterpart: it is read from the DCP side
and compared with what the conversion would write; equal, it is not a one-sided tensor. The
RNG states' list (``rng_states``), renamed by the conversion, is a note when every RNG tensor
of both sides was paired and is identical. A source tensor that is neither a weight nor
optimizer state and that the conversion does not carry (a Lightning callback's state) is not
compared, counted as out of scope and named in the note. Any other pair of checkpoints is left
as it is.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ckpt_cli.errors import CkptError
from ckpt_cli.model import CheckpointIndex, TensorInfo
from ckpt_cli.ops.diff.result import DiffResult, MetaDiff, OnlyIn
from ckpt_cli.ops.to_dcp import SOURCES, source_format
from ckpt_cli.ops.to_dcp._trees import IndexedLoad
from ckpt_cli.ops.to_dcp.writer import LAYOUTS, layout_state

_CARRIED = ("model", "buffer", "optimizer")
"""Groups whose tensors the conversion carries: one of them on one side only is a difference."""

Where = tuple[Any, ...]
"""Where a tensor's bytes are stored and how they are read: file, offset, storage, shape,
strides, dtype."""


@dataclass
class Converted:
    """A source side matched to its DCP output.

    Attributes:
        note: What was matched, for the result (``DiffResult.optimizer_ids``).
        dcp_side: ``a`` or ``b``: the side that is the DCP output.
        derived: Names (as matched) of the DCP side's tensors the conversion makes rather
            than copies, with the value it would write there.
    """

    note: str
    dcp_side: str
    derived: dict[str, Any] = field(default_factory=dict)

    def settle(self, result: DiffResult) -> None:
        """After the structural match: the derived values that equal what the conversion
        writes are no longer one-sided (those that differ stay, a difference)."""
        from ckpt_cli.tensors.source import TensorSource  # lazy: reads a few scalar values

        ix = result.index_a if self.dcp_side == "a" else result.index_b
        only = result.only_a if self.dcp_side == "a" else result.only_b
        kept: list[OnlyIn] = []
        equal: list[str] = []
        with TensorSource(ix) as src:
            for o in only:
                want = self.derived.get(o.name)
                if want is not None and o.tied_to is None:
                    got = np.asarray(src.read(ix.tensors[o.original]))
                    if got.shape == want.shape and got.dtype == want.dtype and \
                            bool(np.array_equal(got, want)):
                        equal.append(o.name)
                        continue
                kept.append(o)
        only[:] = kept
        if equal:
            self.note += (f"; {', '.join(sorted(equal))} equal{'s' if len(equal) == 1 else ''} "
                          "what the conversion makes of the source's values")
        # What the conversion does not carry by design (a Lightning callback's state, loop
        # counters: neither weights nor optimizer state) is out of the comparison's scope,
        # named here; a weight or a moment left on one side stays a difference.
        src_only = result.only_b if self.dcp_side == "a" else result.only_a
        excluded = result.excluded_b if self.dcp_side == "a" else result.excluded_a
        dropped = [o for o in src_only if o.tied_to is None and o.group not in _CARRIED]
        if dropped:
            src_only[:] = [o for o in src_only if o not in dropped]
            for o in dropped:
                excluded[o.group] = excluded.get(o.group, 0) + 1
            shown = ", ".join(o.name for o in dropped[:3])
            more = f" and {len(dropped) - 3} more" if len(dropped) > 3 else ""
            self.note += (f"; not compared, as the conversion does not carry them: "
                          f"{shown}{more}")
        result.optimizer_ids = self.note

    def mark_rng(self, metadata: list[MetaDiff], result: DiffResult) -> list[MetaDiff]:
        """The ``rng_states`` list marked as following from the tensors when every RNG tensor
        of both sides is paired and identical (the conversion renames them)."""
        paired = {(t.name_a if side == "a" else t.name_b)
                  for t in result.tensors if t.status == "identical" for side in "ab"}
        rng: list[str] = []
        for ix in (result.index_a, result.index_b):
            names = ix.metadata.get("rng_states")
            rng += [n for n in names if n in ix.tensors] if isinstance(names, list) else []
        if not rng or not all(n in paired for n in rng):
            return metadata
        return [dataclasses.replace(m, follows="RNG states renamed by convert --to dcp, "
                                               "each identical")
                if m.key == "rng_states" and m.status == "changed" else m for m in metadata]


def _where(ix: CheckpointIndex, t: TensorInfo) -> Where | None:
    if t.file is None or t.kind != "dense":
        return None
    path = ix.path_of(t.file)
    place = os.path.abspath(path) if not hasattr(path, "store") else str(path)
    return (place, t.offset, t.storage.key if t.storage else None, t.storage_offset,
            tuple(t.shape), t.stride, t.dtype)


def _leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    from ckpt_cli.ops.to_dcp.state import LazyTensor  # lazy: only for a DCP pair

    out: dict[str, Any] = {}
    if isinstance(tree, LazyTensor):
        out[prefix] = tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            out.update(_leaves(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def match_converted(index_a: CheckpointIndex, index_b: CheckpointIndex,
                    names_a: dict[str, str], names_b: dict[str, str]) -> Converted | None:
    """Match a training checkpoint on one side to its ``convert --to dcp`` output on the
    other: renames the source side's tensors (in ``names_a``/``names_b``, original -> matched
    name, changed in place) to the DCP side's names.

    Args:
        index_a: Side A.
        index_b: Side B.
        names_a: A's original -> matched names.
        names_b: B's, likewise.

    Returns:
        What was matched, or None when the pair is not a source and a DCP output that the
        conversion's readers explain (nothing changed).
    """
    # Lazy: the conversion's readers, only for a source/DCP pair.
    if (index_a.format == "dcp") == (index_b.format == "dcp"):
        return None
    side = "a" if index_a.format == "dcp" else "b"
    ix_dcp, names_dcp = (index_a, names_a) if side == "a" else (index_b, names_b)
    ix_src, names_src = (index_b, names_b) if side == "a" else (index_a, names_a)
    try:
        fmt, path, _ = source_format(ix_src.root, None)
        state = SOURCES[fmt](path)
    except CkptError:
        return None  # not a source the conversion reads: compared as it is
    stored: dict[Where, list[str]] = {}
    for t in ix_src.tensors.values():
        w = _where(ix_src, t)
        if w is not None:
            stored.setdefault(w, []).append(t.name)
    hits, layout, leaves = max(((len(ix_dcp.tensors.keys() & leaves.keys()), layout, leaves)
                                for layout in LAYOUTS
                                for leaves in [_leaves(layout_state(state, layout))]),
                               key=lambda x: x[0])
    if not hits:
        return None
    renamed: dict[str, str] = {}
    derived: dict[str, Any] = {}
    for key, lz in leaves.items():
        if key not in ix_dcp.tensors:
            continue
        target = names_dcp[key]
        if not isinstance(lz.load, IndexedLoad):
            if lz.shape == ():  # made by the conversion from a number (the step)
                derived[target] = np.asarray(lz.load())
            continue
        w = _where(lz.load.index, lz.load.info)
        free = [n for n in stored.get(w, []) if n not in renamed] if w is not None else []
        if not free:
            continue  # a tied copy the source keeps once: left to the value ties
        # Tied names of one stored tensor: the one already called so, else the first.
        renamed[next((n for n in free if names_src[n] == target), free[0])] = target
    if not renamed:
        return None
    new = {**names_src, **renamed}
    if len(set(new.values())) != len(new):
        return None  # an unpaired source name already holds a paired one: leave it all
    names_src.update(renamed)
    src, dcp = ("B", "A") if side == "a" else ("A", "B")
    note = (f"{src}'s tensors matched to {dcp}'s names as convert --to dcp writes a {fmt} "
            f"checkpoint ({layout} layout; optimizer ids named by the model's parameter order "
            f"or the framework's grouping): {len(renamed)} tensors paired by the stored bytes "
            "they read")
    return Converted(note, side, derived)
