"""``diff``: what changed between two checkpoints: names, shapes, dtypes, values and metadata.

Works on any two checkpoints the readers understand (a torch file against safetensors, a DCP
directory against its consolidated file, an HF shard set against a single file) because both
sides are :class:`~ckpt_cli.model.CheckpointIndex` objects. Steps:

1. **Scope.** By default only model weights and buffers are compared (the ``model`` and
   ``buffer`` groups): that is what a safetensors export, a consolidated file and a training
   checkpoint have in common. ``everything=True`` adds optimizer state, RNG state and the rest.
   When neither side has model weights (two optimizer files) everything is compared.
2. **Names.** Explicit prefixes are stripped from both sides first; then, unless turned off,
   well-known wrappers (``module.``, ``_orig_mod.``, ``model.``, ``state_dict.``,
   ``model_state_dict.``) are stripped from the side that carries them on all its weights,
   but only when that makes more names match. Every rename is reported. An optimizer
   named by integer ids on one side and by FQNs on the other (a ``torch.save`` training dict
   and its ``convert --to dcp`` output) is matched by the model's parameter order
   (:mod:`ckpt_cli.ops.diff.optim_ids`), and the result says so.
3. **Structure.** Tensors only in A or only in B (a tied alias that one side omits is noted,
   not counted as a difference), shape changes, dtype changes (:mod:`ckpt_cli.ops.diff.match`).
4. **Values.** Each common pair is streamed block by block (:mod:`ckpt_cli.ops.diff.compare`). A
   weight stored in FP8 with a scale (``X.weight`` + ``X.weight_scale_inv``/``weight_scale``/
   ``scale_weight``, see :mod:`ckpt_cli.fp8.scheme`) is dequantized first (``w * scale`` in
   FP32), on either side or both, one pair at a time; its scales are not compared on their
   own nor reported as only on one side.
5. **Metadata.** Training facts (step, epoch, lr, hyper-parameters) and non-tensor values.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from ckpt_cli import storage
from ckpt_cli.errors import (
    CkptError,
    UnsupportedError,
    UsageError,
)
from ckpt_cli.formats import deepspeed, read_index
from ckpt_cli.formats.base import refuse_damaged, refuse_incomplete
from ckpt_cli.model import CheckpointIndex
from ckpt_cli.ops.diff.converted import match_converted
from ckpt_cli.ops.diff.match import choose_scope, match, pair_quantized
from ckpt_cli.ops.diff.match import renamed as renamed  # re-exported
from ckpt_cli.ops.diff.metadata import diff_metadata, mark_dtype_follows
from ckpt_cli.ops.diff.names import normalise
from ckpt_cli.ops.diff.optim_ids import match_ids
from ckpt_cli.ops.diff.result import DiffOptions as DiffOptions  # re-exported: the public name
from ckpt_cli.ops.diff.result import DiffResult
from ckpt_cli.ops.diff.values import _compare_all, comparable, on_side
from ckpt_cli.progress import Progress
from ckpt_cli.resolve import resolve
from ckpt_cli.runs import Followed
from ckpt_cli.storage.reads import memory_budget

STATUSES: tuple[str, ...] = ("identical", "within_tolerance", "changed", "shape_changed",
                             "skipped", "not_compared")
"""Per-tensor outcomes, from best to worst (``not_compared``: values were not asked for)."""


def diff(a: str | Path, b: str | Path, options: DiffOptions | None = None, *,
         progress: Progress | None = None) -> DiffResult:
    """Compare two checkpoints given by path.

    Args:
        a: Side A: a checkpoint file or directory (any format ckpt reads).
        b: Side B.
        options: What to compare (default :class:`DiffOptions`): ``input_format_a`` and
            ``input_format_b`` force a side's format; ``max_memory`` is the budget in bytes
            for the tensors compared at once (default 256 MiB; a tensor whose layout is read
            whole may add its size).
        progress: Called as values are compared: ``("comparing", bytes_done, bytes_total)``
            (:class:`ckpt_cli.progress.Progress`).

    Returns:
        The :class:`DiffResult`.

    Raises:
        CkptError: For unreadable input; the message starts with ``A:`` or ``B:``.
        UsageError: For contradictory options.
    """
    opts = options or DiffOptions()
    if opts.depth is not None and opts.depth < 1:
        raise UsageError(f"depth must be at least 1, not {opts.depth}", param="depth")
    index_a, followed_a = _read_side(a, opts.input_format_a, "A")
    index_b, followed_b = _read_side(b, opts.input_format_b, "B")
    same = same_checkpoint(index_a, index_b)
    result = diff_indexes(index_a, index_b, opts, progress=progress, same=same,
                          max_memory=opts.max_memory)
    result.followed_a, result.followed_b = followed_a, followed_b
    result.path_a, result.path_b = str(a), str(b)
    return result


def same_checkpoint(index_a: CheckpointIndex, index_b: CheckpointIndex) -> str | None:
    """Why two sides are one checkpoint on disk, or None if they may differ.

    The same path, or the same file or directory reached another way (a symlink, a hard
    link, ``./x`` and ``x``): same device and inode. Two files that merely hold equal bytes
    are not the same checkpoint; their values are compared as usual.

    Args:
        index_a: Side A, as read.
        index_b: Side B, as read.

    Returns:
        A reason in plain words, or None.
    """
    if index_a.format != index_b.format:
        return None  # one file read as two formats (--format-a/--format-b) is two views
    ra, rb = index_a.root, index_b.root
    what = "directory" if ra.is_dir() else "file"
    if not (storage.has_file_system(ra) and storage.has_file_system(rb)):
        # Objects have no inodes: only the same URL is the same checkpoint.
        return f"A and B are the same URL, so the same {what}" if ra == rb else None
    if os.path.normpath(os.path.abspath(ra)) == os.path.normpath(os.path.abspath(rb)):
        return f"A and B are the same path, so the same {what}"
    try:
        sa, sb = ra.stat(), rb.stat()
    except OSError:
        return None
    if (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino):
        return (f"A and B are the same {what} (device {sa.st_dev}, inode {sa.st_ino}: a link "
                "or another name for it)")
    return None


def _read_side(path: str | Path, fmt: str | None,
               label: str) -> tuple[CheckpointIndex, Followed | None]:
    try:
        target = resolve(path, input_format=fmt)
        return read_index(target.checkpoint(), fmt), target.followed
    except CkptError as e:
        raise on_side(e, label) from None


def diff_indexes(index_a: CheckpointIndex, index_b: CheckpointIndex,
                 options: DiffOptions | None = None, *,
                 progress: Progress | None = None, same: str | None = None,
                 max_memory: int | None = None) -> DiffResult:
    """Compare two checkpoints already read (the API other commands use to verify output).

    Args:
        index_a: Side A.
        index_b: Side B.
        options: What to compare (default :class:`DiffOptions`).
        progress: Called as values are compared: ``("comparing", bytes_done, bytes_total)``.
        same: Why both sides are one checkpoint on disk (see :func:`same_checkpoint`): then
            values are not read and every common tensor is ``identical``.
        max_memory: Memory budget in bytes for the tensors being compared at once.

    Returns:
        The :class:`DiffResult`.

    Raises:
        CkptError: When tensor data cannot be read, or a side's readers found damage in the
            files compared (missing shards, truncation); the message starts with ``A:`` or
            ``B:``.
        UsageError: When ``strip_prefix`` would give two tensors of one side the same name,
            or a tolerance is negative.
    """
    opts = options or DiffOptions()
    budget = memory_budget(max_memory)
    for name, val in (("rtol", opts.rtol), ("atol", opts.atol)):
        if val is not None and not (val >= 0 and math.isfinite(val)):
            raise UsageError(f"{name} must be a finite number >= 0, not {val}", param=name)
    for label, ix in (("A", index_a), ("B", index_b)):
        _refuse_zero3(ix, label)
    scope_a, scope_b, scope, note = choose_scope(index_a, index_b, opts.all_tensors)
    names_a, names_b, renames = normalise(index_a, index_b, scope_a, scope_b,
                                          opts.strip_prefix, auto=not opts.exact_names)
    # --all across convert --to dcp: the source's tensors under the names the conversion
    # gives them; else an optimizer's ids met with FQNs by parameter order.
    converted = match_converted(index_a, index_b, names_a, names_b) if scope == "all" \
        else None
    ids_note = converted.note if converted else match_ids(index_a, index_b, names_a,
                                                           names_b, scope_a, scope_b)
    result = DiffResult(index_a, index_b, opts, scope, note, renames, same_checkpoint=same,
                        optimizer_ids=ids_note)
    match(result, names_a, names_b, scope_a, scope_b)
    if converted and not opts.structure_only and not same:
        converted.settle(result)
    pair_quantized(result)
    # A side whose readers found damage in the files being compared (a missing shard, a
    # truncated file) cannot be called equal or different: say what is wrong instead.
    # Structure alone needs no data, but not a side with tensors missing.
    for label, ix, names in (("A", index_a, names_a), ("B", index_b, names_b)):
        in_scope = {n for n in names if n in (scope_a if label == "A" else scope_b)}
        try:
            refuse_incomplete(ix)
            if not opts.structure_only:
                refuse_damaged(ix, in_scope)
        except CkptError as e:
            raise on_side(e, label) from None
    if not opts.structure_only and same:
        # Reading every byte of one file twice can only find it equal to itself.
        # What could not be compared with another checkpoint (no data, meta or sparse
        # tensors) is not called identical to itself either.
        for t in result.tensors:
            if t.status == "shape_changed":
                continue
            why = comparable(index_a.tensors[t.name_a], index_b.tensors[t.name_b])
            t.status, t.reason = ("skipped", why) if why else ("identical", same)
    elif not opts.structure_only:
        _compare_all(result, progress, budget)
    else:
        for t in result.tensors:
            if t.status != "shape_changed":
                t.status = "not_compared"
    if opts.metadata:
        result.metadata = mark_dtype_follows(
            diff_metadata(index_a, index_b, everything=scope == "all"), result.tensors)
        if converted:
            result.metadata = converted.mark_rng(result.metadata, result)
    return result


def _refuse_zero3(index: CheckpointIndex, label: str) -> None:
    """Refuse a DeepSpeed ZeRO-3 side: its model states hold placeholders, not the weights.

    Compared as stored, every parameter would be a ``[0]``-shaped placeholder (once per rank
    file), so a checkpoint would differ from its own consolidation. ZeRO 1/2 keep the whole
    module in the model states and are compared as they are.
    """
    if deepspeed.is_zero3(index):
        raise on_side(UnsupportedError(
            "DeepSpeed ZeRO-3 checkpoint: its model-states files hold empty placeholders for "
            "the partitioned parameters, whose weights are spread over the optimizer files",
            path=index.root,
            hint=f"consolidate it first (ckpt consolidate {index.root} -o OUT) and diff OUT"),
            label)
