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
   but only when that makes more names match. Every rename is reported.
3. **Structure.** Tensors only in A or only in B (a tied alias that one side omits is noted,
   not counted as a difference), shape changes, dtype changes.
4. **Values.** Each common pair is streamed block by block (:mod:`ckpt_cli.ops.diff.compare`). A
   weight stored in FP8 with a scale (``X.weight`` + ``X.weight_scale_inv``/``weight_scale``/
   ``scale_weight``, see :mod:`ckpt_cli.fp8_scheme`) is dequantized first (``w * scale`` in
   FP32), on either side or both, one pair at a time; its scales are not compared on their
   own nor reported as only on one side.
5. **Metadata.** Training facts (step, epoch, lr, hyper-parameters) and non-tensor values.
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import math
import os
import re
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpt_cli import dtypes, fp8_scheme, storage
from ckpt_cli.errors import (
    CkptError,
    OutOfMemoryError,
    UnknownFormatError,
    UnsupportedError,
    UsageError,
)
from ckpt_cli.formats import deepspeed, provenance, read_index
from ckpt_cli.formats.base import refuse_damaged, refuse_incomplete
from ckpt_cli.formats.containers import group_of
from ckpt_cli.formats.provenance import is_provenance
from ckpt_cli.formats.torchfile import role_of
from ckpt_cli.model import CheckpointIndex, TensorInfo
from ckpt_cli.ops.diff.compare import (
    EXACT,
    DiffStats,
    Tolerance,
    compare_arrays,
    compare_values,
    default_tolerance,
)
from ckpt_cli.ops.diff.result import (
    Dequantized,
    DiffResult,
    MetaDiff,
    OnlyIn,
    Rename,
    TensorDiff,
)
from ckpt_cli.ops.diff.result import DiffOptions as DiffOptions  # re-exported: the public name
from ckpt_cli.runs import Followed, follow_pointer, is_run_dir, list_run
from ckpt_cli.streaming import PIECE_BYTES, Meter, default_jobs, memory_budget, run_bounded
from ckpt_cli.tensors.source import TensorSource

if TYPE_CHECKING:
    import numpy as np

WRAPPERS: tuple[str, ...] = ("module.", "_orig_mod.", "model.", "state_dict.",
                             "model_state_dict.")
"""Name prefixes that wrappers and containers add: DDP/DeepSpeed, torch.compile, training dicts,
Lightning, the PyTorch tutorial's ``model_state_dict``."""

WEIGHT_GROUPS: tuple[str, ...] = ("model", "buffer")
"""Groups compared by default."""

STATUSES: tuple[str, ...] = ("identical", "within_tolerance", "changed", "shape_changed",
                             "skipped", "not_compared")
"""Per-tensor outcomes, from best to worst (``not_compared``: values were not asked for)."""

ProgressFn = Callable[[int, int], None]
"""``on_progress(bytes_done, bytes_total)``."""


def diff(a: str | Path, b: str | Path, options: DiffOptions | None = None, *,
         fmt_a: str | None = None, fmt_b: str | None = None,
         on_progress: ProgressFn | None = None, max_memory: int | None = None) -> DiffResult:
    """Compare two checkpoints given by path.

    Args:
        a: Side A: a checkpoint file or directory (any format ckpt reads).
        b: Side B.
        options: What to compare (default :class:`DiffOptions`).
        fmt_a: Force A's format instead of detecting it.
        fmt_b: Force B's format.
        on_progress: Called as values are compared with ``(bytes_done, bytes_total)``.
        max_memory: Memory budget in bytes for the tensors being compared at once (default
            256 MiB; a tensor whose layout is read whole may add its size).

    Returns:
        The :class:`DiffResult`.

    Raises:
        CkptError: For unreadable input; the message starts with ``A:`` or ``B:``.
        UsageError: For contradictory options.
    """
    index_a, followed_a = _read_side(a, fmt_a, "A")
    index_b, followed_b = _read_side(b, fmt_b, "B")
    same = same_checkpoint(index_a, index_b)
    result = diff_indexes(index_a, index_b, options, on_progress=on_progress, same=same,
                          max_memory=max_memory)
    result.followed_a, result.followed_b = followed_a, followed_b
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
    if storage.is_remote(ra) or storage.is_remote(rb):
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
        followed = follow_pointer(storage.locate(path)) if fmt is None else None
        return read_index(followed.path if followed else path, fmt), followed
    except UnknownFormatError as e:
        raise on_side(_run_dir_error(storage.locate(path)) or e, label) from None
    except CkptError as e:
        raise on_side(e, label) from None


def _run_dir_error(path: Path) -> CkptError | None:
    """A clearer error for a run directory given where one checkpoint is expected."""
    if not is_run_dir(path):
        return None
    entries = [e for e in list_run(path).entries if e.complete]
    hint = (f"name one of its checkpoints, e.g. {path / entries[-1].name} (the newest)"
            if entries else "name one of its checkpoints")
    return UsageError(f"a run directory ({len(entries)} complete checkpoints), not a "
                      "checkpoint", path=path, hint=hint)


def on_side(e: CkptError, label: str) -> CkptError:
    """The same error with its message prefixed by the side it concerns (``A:``/``B:``).

    Args:
        e: The error.
        label: ``A`` or ``B``.

    Returns:
        A copy of ``e`` (same class, path and exit code) with ``side`` set, so that its text
        starts with ``label``.
    """
    if e.side is not None:
        return e  # already labelled (a read inside a read)
    err = copy.copy(e)
    err.side = label
    err.args = (str(err),)
    return err


class _SideSource(TensorSource):
    """A tensor source whose errors say which side they come from."""

    def __init__(self, index: CheckpointIndex, label: str):
        super().__init__(index)
        self.label = label

    def read(self, t: TensorInfo, *, mapped: bool = False) -> np.ndarray:
        try:
            return super().read(t, mapped=mapped)
        except CkptError as e:
            raise on_side(e, self.label) from None

    def read_into(self, rel: str, offset: int, out: memoryview) -> None:
        try:
            super().read_into(rel, offset, out)
        except CkptError as e:
            raise on_side(e, self.label) from None

    def iter_pieces(self, t: TensorInfo, *, piece_bytes: int | None = None,
                    mapped: bool = False) -> Iterator[np.ndarray]:
        try:
            yield from super().iter_pieces(t, piece_bytes=piece_bytes, mapped=mapped)
        except CkptError as e:
            raise on_side(e, self.label) from None


def diff_indexes(index_a: CheckpointIndex, index_b: CheckpointIndex,
                 options: DiffOptions | None = None, *,
                 on_progress: ProgressFn | None = None, same: str | None = None,
                 max_memory: int | None = None) -> DiffResult:
    """Compare two checkpoints already read (the API other commands use to verify output).

    Args:
        index_a: Side A.
        index_b: Side B.
        options: What to compare (default :class:`DiffOptions`).
        on_progress: Called as values are compared with ``(bytes_done, bytes_total)``.
        same: Why both sides are one checkpoint on disk (see :func:`same_checkpoint`): then
            values are not read and every common tensor is ``identical``.
        max_memory: Memory budget in bytes for the tensors being compared at once.

    Returns:
        The :class:`DiffResult`.

    Raises:
        CkptError: When tensor data cannot be read, or a side's readers found damage in the
            files compared (missing shards, truncation); the message starts with ``A:`` or
            ``B:``.
        UsageError: When ``strip_prefixes`` would give two tensors of one side the same name,
            or a tolerance is negative.
    """
    opts = options or DiffOptions()
    budget = memory_budget(max_memory)
    for label, val in (("--rtol", opts.rtol), ("--atol", opts.atol)):
        if val is not None and not (val >= 0 and math.isfinite(val)):
            raise UsageError(f"{label} must be a finite number >= 0, not {val}")
    for label, ix in (("A", index_a), ("B", index_b)):
        _refuse_zero3(ix, label)
    scope_a, scope_b, scope, note = _scope(index_a, index_b, opts.everything)
    names_a, names_b, renames = normalise(index_a, index_b, scope_a, scope_b,
                                          opts.strip_prefixes, auto=opts.auto_names)
    result = DiffResult(index_a, index_b, opts, scope, note, renames, same_checkpoint=same)
    _match(result, names_a, names_b, scope_a, scope_b)
    _pair_quantized(result)
    # A side whose readers found damage in the files being compared (a missing shard, a
    # truncated file) cannot be called equal or different: say what is wrong instead.
    # Structure alone needs no data, but not a side with tensors missing.
    for label, ix, names in (("A", index_a, names_a), ("B", index_b, names_b)):
        in_scope = {n for n in names if n in (scope_a if label == "A" else scope_b)}
        try:
            refuse_incomplete(ix)
            if opts.values:
                refuse_damaged(ix, in_scope)
        except CkptError as e:
            raise on_side(e, label) from None
    if opts.values and same:
        # Reading every byte of one file twice can only find it equal to itself.
        # What could not be compared with another checkpoint (no data, meta or sparse
        # tensors) is not called identical to itself either.
        for t in result.tensors:
            if t.status == "shape_changed":
                continue
            why = comparable(index_a.tensors[t.name_a], index_b.tensors[t.name_b])
            t.status, t.reason = ("skipped", why) if why else ("identical", same)
    elif opts.values:
        _compare_all(result, on_progress, budget)
    else:
        for t in result.tensors:
            if t.status != "shape_changed":
                t.status = "not_compared"
    if opts.metadata:
        result.metadata = diff_metadata(index_a, index_b, everything=scope == "all")
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


def _scope(a: CheckpointIndex, b: CheckpointIndex,
           everything: bool) -> tuple[set[str], set[str], str, str | None]:
    """Names of each side inside the scope, the scope's name, and a note when it widened."""
    def weights(ix: CheckpointIndex) -> set[str]:
        return {n for n, t in ix.tensors.items() if t.group in WEIGHT_GROUPS}

    if everything:
        return set(a.tensors), set(b.tensors), "all", None
    wa, wb = weights(a), weights(b)
    if not wa and not wb and (a.tensors or b.tensors):
        return (set(a.tensors), set(b.tensors), "all",
                "neither side has model weights, so every tensor is compared")
    return wa, wb, "weights", None


# --- names -----------------------------------------------------------------------------------

def _strip(names: dict[str, str], prefix: str) -> tuple[dict[str, str], int] | None:
    """Remove ``prefix`` from every current name carrying it; None if two names would merge."""
    out: dict[str, str] = {}
    changed = 0
    for orig, cur in names.items():
        if cur.startswith(prefix) and len(cur) > len(prefix):
            out[orig] = cur[len(prefix):]
            changed += 1
        else:
            out[orig] = cur
    if len(set(out.values())) != len(out):
        return None
    return out, changed


def _chain(names: dict[str, str], key: set[str]) -> list[tuple[str, dict[str, str], int]]:
    """The wrappers a side carries, outermost first: each prefixes every name in ``key``."""
    chain: list[tuple[str, dict[str, str], int]] = []
    current = names
    for _ in range(8):  # wrappers nest a few levels at most (module._orig_mod.model.)
        cur = [current[o] for o in key]
        prefix = next((w for w in WRAPPERS
                       if cur and all(n.startswith(w) and len(n) > len(w) for n in cur)), None)
        if prefix is None:
            break
        stripped = _strip(current, prefix)
        if stripped is None:
            break
        current, count = stripped
        chain.append((prefix, current, count))
    return chain


def normalise(index_a: CheckpointIndex, index_b: CheckpointIndex, scope_a: Iterable[str],
              scope_b: Iterable[str], strip_prefixes: Iterable[str] = (), *,
              auto: bool = True) -> tuple[dict[str, str], dict[str, str], list[Rename]]:
    """Map each side's tensor names to the names they are matched by.

    ``strip_prefixes`` are removed from both sides first (from every name that starts with
    one). Then, with ``auto``, the wrapper prefixes of :data:`WRAPPERS` that a side carries on
    all its in-scope model weights are candidates for removal; the combination that makes the
    most in-scope names match wins, provided it beats removing nothing (so ``model.`` is only
    stripped when one side has it and the other does not).

    Args:
        index_a: Side A.
        index_b: Side B.
        scope_a: A's names inside the comparison's scope.
        scope_b: B's names inside the scope.
        strip_prefixes: Prefixes to remove on both sides.
        auto: Whether to strip wrapper prefixes automatically.

    Returns:
        ``(A's original -> normalised, B's original -> normalised, renames applied)``.

    Raises:
        UsageError: If a requested prefix would give two tensors of one side the same name.
    """
    sa, sb = set(scope_a), set(scope_b)
    names = {"a": {n: n for n in index_a.tensors}, "b": {n: n for n in index_b.tensors}}
    renames: list[Rename] = []
    for prefix in strip_prefixes:
        if not prefix:
            continue
        for side in ("a", "b"):
            stripped = _strip(names[side], prefix)
            if stripped is None:
                raise UsageError(f"stripping {prefix!r} from {side.upper()}'s names would give "
                                 "two tensors the same name")
            names[side], count = stripped
            if count:
                renames.append(Rename(side, prefix, count, "option"))
    if not auto:
        return names["a"], names["b"], renames

    def key(scope: set[str], ix: CheckpointIndex) -> set[str]:
        # Wrappers are judged on the weights: in --all, optimizer state sits beside them.
        weights = {n for n in scope if ix.tensors[n].group in WEIGHT_GROUPS}
        return weights or scope

    chain_a = _chain(names["a"], key(sa, index_a))
    chain_b = _chain(names["b"], key(sb, index_b))

    def score(i: int, j: int) -> int:
        ma = chain_a[i - 1][1] if i else names["a"]
        mb = chain_b[j - 1][1] if j else names["b"]
        return len({ma[n] for n in sa} & {mb[n] for n in sb})

    base = score(0, 0)
    options = [(score(i, j), i, j) for i in range(len(chain_a) + 1)
               for j in range(len(chain_b) + 1)]
    # Most matches first, then the fewest prefixes removed, then by the prefixes' names: keys
    # that do not depend on which side is A, so diff(B, A) mirrors diff(A, B).
    options.sort(key=lambda o: (-o[0], o[1] + o[2], max(o[1], o[2]),
                                sorted([p for p, _, _ in chain_a[:o[1]]]
                                       + [p for p, _, _ in chain_b[:o[2]]])))
    best, i, j = options[0]
    if best <= base:
        return names["a"], names["b"], renames
    renames += [Rename("a", p, c, "auto") for p, _, c in chain_a[:i]]
    renames += [Rename("b", p, c, "auto") for p, _, c in chain_b[:j]]
    return (chain_a[i - 1][1] if i else names["a"], chain_b[j - 1][1] if j else names["b"],
            renames)


# --- structure -------------------------------------------------------------------------------

def _aliases(index: CheckpointIndex) -> dict[str, list[str]]:
    """Tensor -> the other tensors viewing exactly the same stored bytes (tied weights)."""
    groups: dict[tuple[Any, ...], list[str]] = {}
    for t in index.tensors.values():
        if t.storage is not None:
            sig = (t.storage.file, t.storage.key, t.storage_offset, t.shape, t.stride, t.dtype)
            groups.setdefault(sig, []).append(t.name)
    return {n: [m for m in names if m != n] for names in groups.values() if len(names) > 1
            for n in names}


def _recorded_copies(index: CheckpointIndex) -> dict[str, str]:
    """``{dropped: kept}`` that safetensors' ``save_model`` writes into ``__metadata__``."""
    meta = index.metadata.get("safetensors_metadata")
    if not isinstance(meta, dict):
        return {}
    return {k: v for k, v in meta.items() if isinstance(v, str) and v in index.tensors
            and k not in index.tensors}


def _match(result: DiffResult, names_a: dict[str, str], names_b: dict[str, str],
           scope_a: set[str], scope_b: set[str]) -> None:
    ia, ib = result.index_a, result.index_b
    rev_b = {v: k for k, v in names_b.items()}
    # A name is in scope if either side puts it there: groups are guessed from paths, and a
    # weight one reader calls "other" must still meet its counterpart.
    in_scope = {names_a[n] for n in scope_a} | {names_b[n] for n in scope_b}
    glob = result.options.filter_glob
    if glob:
        in_scope = {n for n in in_scope if fnmatch.fnmatchcase(n, glob)}
        if not in_scope:
            raise UsageError(f"--filter {glob!r} matches no tensor on either side")
    for ix, names, excluded in ((ia, names_a, result.excluded_a),
                                (ib, names_b, result.excluded_b)):
        for orig, norm in names.items():
            if norm not in in_scope:
                g = ix.tensors[orig].group
                excluded[g] = excluded.get(g, 0) + 1
    for orig, norm in names_a.items():
        if norm not in in_scope:
            continue
        ta = ia.tensors[orig]
        ob = rev_b.get(norm)
        if ob is None:
            continue
        tb = ib.tensors[ob]
        group = ta.group if ta.group != "other" else tb.group
        td = TensorDiff(norm, orig, ob, group, ta.dtype, tb.dtype, ta.shape, tb.shape)
        if ta.shape != tb.shape:
            td.status = "shape_changed"
        result.tensors.append(td)
    common = {t.name for t in result.tensors}
    for side, ix, names, other in (("a", ia, names_a, ib), ("b", ib, names_b, ia)):
        aliases = _aliases(ix)
        # The other side may record the copies it dropped ({dropped: kept}, in its own names).
        peer = "b" if side == "a" else "a"
        copies = {renamed(k, result.renames, peer): renamed(v, result.renames, peer)
                  for k, v in _recorded_copies(other).items()}
        only = result.only_a if side == "a" else result.only_b
        for orig, norm in names.items():
            if norm not in in_scope or norm in common:
                continue
            t = ix.tensors[orig]
            shared = [names[m] for m in aliases.get(orig, []) if names[m] in common]
            tied, how = (shared[0], "storage") if shared else (copies.get(norm), "recorded")
            if tied in common:
                only.append(OnlyIn(norm, orig, t.dtype, t.shape, t.group, tied, how))
            else:
                only.append(OnlyIn(norm, orig, t.dtype, t.shape, t.group))


def renamed(name: str, renames: Iterable[Rename], side: str) -> str:
    """Apply one side's renames to any name (for names that are not tensors of the index).

    Args:
        name: A name as that side writes it.
        renames: The renames of a :class:`DiffResult`.
        side: ``a`` or ``b``.

    Returns:
        The name as it is matched.
    """
    for r in renames:
        if r.side == side and name.startswith(r.prefix) and len(name) > len(r.prefix):
            name = name[len(r.prefix):]
    return name


def _pair_quantized(result: DiffResult) -> None:
    """Mark the common tensors stored in FP8 with a scale (either side or both) to be compared
    dequantized, and take their scales out of the tensors compared and the one-sided lists."""
    pairings = []
    for ix in (result.index_a, result.index_b):
        has = any(t.dtype in fp8_scheme.FP8_DTYPES for t in ix.tensors.values())
        pairings.append(fp8_scheme.pair_scales(ix.tensors) if has else None)
    pa, pb = pairings
    if pa is None and pb is None:
        return
    taken: tuple[set[str], set[str]] = (set(), set())
    for td in result.tensors:
        qa = pa.pairs.get(td.name_a) if pa is not None else None
        qb = pb.pairs.get(td.name_b) if pb is not None else None
        for label, q, pairing, name, dtype in (("A", qa, pa, td.name_a, td.dtype_a),
                                               ("B", qb, pb, td.name_b, td.dtype_b)):
            if q is None and pairing is not None and dtype in fp8_scheme.FP8_DTYPES:
                module = name.rpartition(".")[0]
                why = next((f.message for f in pairing.findings if f.location is not None
                            and f.location.rpartition(".")[0] == module), None)
                result.fp8_unpaired.append(f"{label}: {why or name + ' has no usable scale'}; "
                                           "compared as stored")
        if (qa is None and qb is None) or td.status == "shape_changed":
            continue
        result.dequantized[td.name] = Dequantized(
            qa.scale.name if qa else None, qa.kind if qa else None,
            qb.scale.name if qb else None, qb.kind if qb else None)
        for side, q, pairing in ((0, qa, pa), (1, qb, pb)):
            if q is None or pairing is None:
                continue
            module = q.weight.name.rpartition(".")[0]
            taken[side].add(q.scale.name)
            taken[side].update(n for n in pairing.activation_scales
                               if n.rpartition(".")[0] == module)
    if not result.dequantized:
        return
    result.tensors = [td for td in result.tensors
                      if td.name_a not in taken[0] and td.name_b not in taken[1]]
    result.scales_a = [n for n in result.index_a.tensors if n in taken[0]]
    result.scales_b = [n for n in result.index_b.tensors if n in taken[1]]
    result.only_a = [o for o in result.only_a if o.original not in taken[0]]
    result.only_b = [o for o in result.only_b if o.original not in taken[1]]


def _dequantized_values(src: TensorSource, t: TensorInfo,
                        scale: TensorInfo | None) -> tuple[np.ndarray, float]:
    """A tensor's values in float32 (``weight * scale`` for an FP8 weight with its scale),
    and its largest scale (0 when not quantized)."""
    import numpy as np

    from ckpt_cli import fp8

    if scale is None:
        return np.asarray(src.read(t), dtype=np.float32), 0.0
    s = src.read(scale)
    values = fp8.dequantize(src.read(t), s, "F32")
    return values, float(np.asarray(s, dtype=np.float32).max(initial=0.0))


def fp8_tolerance(ta: TensorInfo, tb: TensorInfo, max_scale: float, *,
                  rtol: float | None = None, atol: float | None = None) -> Tolerance:
    """The tolerance of a comparison of dequantized FP8 values: one unit in the last place
    of the FP8 dtype (E4M3: ``rtol`` 2**-3) relative to the larger value, and its smallest
    subnormal times the largest scale as ``atol`` (values below it round to 0 or a
    subnormal); ``rtol``/``atol`` given by the user replace them one by one.

    Args:
        ta: The tensor in A.
        tb: The tensor in B.
        max_scale: The largest scale of the quantized side(s).
        rtol: A user-given relative tolerance, or None.
        atol: A user-given absolute tolerance, or None.

    Returns:
        The :class:`Tolerance` (source ``fp8:<CODE>``, or ``user``).
    """
    import ml_dtypes

    codes = [t.dtype for t in (ta, tb) if t.dtype in fp8_scheme.FP8_DTYPES]
    infos = [(ml_dtypes.finfo(dtypes.numpy_dtype(c)), c)  # type: ignore[no-untyped-call]
             for c in codes]
    fi, code = max(infos, key=lambda x: float(x[0].eps))
    base = Tolerance(float(fi.eps), float(fi.smallest_subnormal) * max_scale, f"fp8:{code}")
    if rtol is None and atol is None:
        return base
    return Tolerance(base.rtol if rtol is None else rtol, base.atol if atol is None else atol,
                     "user")


# --- values ----------------------------------------------------------------------------------

def _why_not(t: TensorInfo, label: str) -> str | None:
    if t.kind != "dense":
        return f"{label} holds a {t.kind} tensor"
    if not t.chunks and (t.file is None or t.offset is None):
        return f"{label} has no data for it"
    return None


def comparable(ta: TensorInfo, tb: TensorInfo) -> str | None:
    """Why the values of two same-shaped tensors cannot be compared, or None if they can.

    Args:
        ta: The tensor in A.
        tb: The tensor in B.

    Returns:
        A short reason, or None.
    """
    why = _why_not(ta, "A") or _why_not(tb, "B")
    if why:
        return why
    decodable = [dtypes.DTYPES[t.dtype].numpy_name is not None for t in (ta, tb)]
    if not all(decodable) and (any(decodable) or ta.dtype != tb.dtype):
        return f"{ta.dtype} and {tb.dtype} cannot be compared (no numeric decoding)"
    return None


def _compare_all(result: DiffResult, on_progress: ProgressFn | None, budget: int) -> None:
    """Compare the values of every comparable pair, several pairs at once (as many as the
    cores and the memory budget allow), each on a thread with its own readers."""
    opts = result.options
    todo: list[tuple[TensorDiff, TensorInfo, TensorInfo]] = []
    for td in result.tensors:
        if td.status == "shape_changed":
            continue
        ta, tb = result.index_a.tensors[td.name_a], result.index_b.tensors[td.name_b]
        why = comparable(ta, tb)
        if why:
            td.status, td.reason = "skipped", why
            continue
        todo.append((td, ta, tb))
    total = sum(ta.nbytes + tb.nbytes for _, ta, tb in todo)
    sides: list[tuple[_SideSource, _SideSource]] = []
    local = threading.local()
    lock = threading.Lock()

    def sources() -> tuple[_SideSource, _SideSource]:
        pair: tuple[_SideSource, _SideSource] | None = getattr(local, "pair", None)
        if pair is None:
            pair = local.pair = (_SideSource(result.index_a, "A"),
                                 _SideSource(result.index_b, "B"))
            with lock:
                sides.append(pair)
        return pair

    def dequantized_job(td: TensorDiff, ta: TensorInfo, tb: TensorInfo,
                        ) -> Callable[[Meter], tuple[DiffStats, Tolerance]]:
        dq = result.dequantized[td.name]
        sa = result.index_a.tensors[dq.scale_a] if dq.scale_a else None
        sb = result.index_b.tensors[dq.scale_b] if dq.scale_b else None

        def run(meter: Meter) -> tuple[DiffStats, Tolerance]:
            src_a, src_b = sources()
            try:
                xa, ma = _dequantized_values(src_a, ta, sa)
                xb, mb = _dequantized_values(src_b, tb, sb)
            except MemoryError:
                raise OutOfMemoryError(
                    f"out of memory dequantizing tensor {td.name!r} ({ta.numel:,} elements): "
                    "an FP8 weight is compared whole, in FP32 on both sides",
                    hint="free memory or raise the limit (ulimit -v)") from None
            except CkptError as e:
                raise CkptError(f"{td.name}: {e}") from None
            tol = fp8_tolerance(ta, tb, max(ma, mb), rtol=opts.rtol, atol=opts.atol)
            stats = compare_arrays(xa, xb, tol, block=opts.block)
            meter.add(ta.nbytes + tb.nbytes)
            return stats, tol
        return run

    def job(td: TensorDiff, ta: TensorInfo, tb: TensorInfo,
            ) -> Callable[[Meter], tuple[DiffStats, Tolerance]]:
        if td.name in result.dequantized:
            return dequantized_job(td, ta, tb)

        def run(meter: Meter) -> tuple[DiffStats, Tolerance]:
            src_a, src_b = sources()
            tol = default_tolerance(ta.dtype, tb.dtype, rtol=opts.rtol, atol=opts.atol)
            try:
                stats = compare_values(src_a, ta, src_b, tb, tol, block=opts.block,
                                       on_block=meter.add)
            except MemoryError:
                raise OutOfMemoryError(
                    f"out of memory comparing tensor {td.name!r} ({ta.nbytes:,} + "
                    f"{tb.nbytes:,} bytes): ckpt compares in blocks of "
                    f"{opts.block:,} elements from pieces of at most {PIECE_BYTES >> 20} "
                    "MiB, but reads strided views and DCP chunks split along other "
                    "dimensions whole",
                    hint="free memory or raise the limit (ulimit -v)") from None
            return stats, tol
        return run

    def progress(_label: str, done: int, all_bytes: int) -> None:
        if on_progress is not None:
            on_progress(min(done, all_bytes), all_bytes)

    try:
        outcomes = run_bounded([job(*x) for x in todo],
                               [_held(ta, opts.block) + _held(tb, opts.block)
                                + 7 * 8 * opts.block if td.name not in result.dequantized
                                else ta.nbytes + tb.nbytes + 20 * ta.numel
                                for td, ta, tb in todo],
                               budget=budget, threads=default_jobs(), total=total,
                               label="values", on_progress=progress)
    finally:
        for a, b in sides:
            a.close()
            b.close()
    for (td, ta, tb), (stats, tol) in zip(todo, outcomes, strict=True):
        kinds = {dtypes.DTYPES[ta.dtype].kind, dtypes.DTYPES[tb.dtype].kind}
        if not kinds & {"float", "complex"}:
            tol = EXACT
        td.stats, td.tolerance = stats, tol
        td.status = ("identical" if stats.identical else
                     "within_tolerance" if stats.within_tolerance else "changed")
    with _SideSource(result.index_a, "A") as src_a, _SideSource(result.index_b, "B") as src_b:
        result.only_a = _value_ties(result.only_a, result, src_a, "a")
        result.only_b = _value_ties(result.only_b, result, src_b, "b")


def _held(t: TensorInfo, block: int) -> int:
    """Bytes a comparison holds of one side: a block of a tensor stored as one byte range;
    the whole tensor for other layouts (an upper bound: DCP chunks split along the first
    dimension stream in pieces)."""
    if t.chunks or t.stride is not None or t.file is None:
        return t.nbytes
    return min(t.nbytes, block * dtypes.DTYPES[t.dtype].itemsize)


_MAX_TIE_CANDIDATES = 8
# Names of the tensors models tie (output heads and embeddings): only these are taken for tied
# copies on equal values alone, so a missing bias that happens to equal another (all zeros)
# still counts as missing.
_TIEABLE = re.compile(r"(^|\.)(lm_head|embed_out|output|head|decoder|proj_out|wte|"
                      r"word_embeddings|embed_tokens|tok_embeddings|embedding|embeddings|"
                      r"shared)(\.|$)")


def _value_ties(only: list[OnlyIn], result: DiffResult, src: TensorSource,
                side: str) -> list[OnlyIn]:
    """Mark one-sided weights that hold exactly the values of a common tensor of their side.

    A DCP or plain torch save keeps a tied ``lm_head.weight`` as its own entry, so storage
    sharing cannot reveal the tie; identical values can. Only model weights and buffers are
    checked, against at most a few common tensors of the same dtype and shape.
    """
    ix = result.index_a if side == "a" else result.index_b
    by_sig: dict[tuple[str, tuple[int, ...]], list[tuple[str, TensorInfo]]] = {}
    for td in result.tensors:
        if td.status in ("identical", "within_tolerance"):
            t = ix.tensors[td.name_a if side == "a" else td.name_b]
            by_sig.setdefault((t.dtype, t.shape), []).append((td.name, t))
    out: list[OnlyIn] = []
    for o in only:
        if o.tied_to is None and o.group in WEIGHT_GROUPS and _TIEABLE.search(o.name):
            t = ix.tensors[o.original]
            for name, u in by_sig.get((t.dtype, t.shape), [])[:_MAX_TIE_CANDIDATES]:
                if comparable(t, u) is None and compare_values(
                        src, t, src, u, EXACT, block=result.options.block).identical:
                    o = dataclasses.replace(o, tied_to=name, tie="values")
                    break
        out.append(o)
    return out


# --- metadata --------------------------------------------------------------------------------

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
