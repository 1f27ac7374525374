"""``ckpt stats``' reading: every tensor asked for, in every checkpoint asked for, read once.

Work is one job per tensor name. A job walks the checkpoints that hold that tensor in step
order *in lockstep*: window by window of the tensor's elements (row-major), it takes the
window from each checkpoint in turn, adds it to that checkpoint's figures
(:func:`~ckpt_cli.tensors.moments.piece_moments`) and, when the previous checkpoint's window is
at hand, to the squared norm of the update between them
(:func:`~ckpt_cli.tensors.moments.diff_sumsq`). So each byte of a run is read once, whatever
the number of checkpoints, and a job holds one window per checkpoint: windows are sized so that
the jobs running at once stay within the memory budget (a tensor whose layout is read whole,
a strided view, may add its size, as everywhere in ckpt). Jobs run on the worker threads
(:func:`~ckpt_cli.storage.reads.run_bounded`); the kernels release the GIL.

FP8 weights that carry a scale are read dequantized (``weight * scale`` in FP32, as torch and
the engines compute it), a piece at a time. A ZeRO-3 parameter (:mod:`.scope`) is gathered
whole from the ranks' partitions, then taken window by window.
"""

from __future__ import annotations

import resource
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ckpt_cli import fp8
from ckpt_cli.errors import CkptError
from ckpt_cli.formats.zero import PieceReader
from ckpt_cli.model import CheckpointIndex, TensorInfo
from ckpt_cli.ops.stats.batch import run_batch
from ckpt_cli.ops.stats.plain import run_plain, take_plain
from ckpt_cli.progress import Progress
from ckpt_cli.storage.reads import PIECE_BYTES, Meter, PerThread, run_bounded
from ckpt_cli.tensors.moments import Moments, diff_sumsq, piece_moments
from ckpt_cli.tensors.source import TensorSource, split_pieces

if TYPE_CHECKING:
    import numpy as np

    from ckpt_cli.formats.zero import ParamPlan, PieceReader

_MIN_WINDOW = 1 << 20  # bytes: below this, per-window overhead outweighs the memory saved


@dataclass(slots=True)
class Target:
    """One tensor to read in one checkpoint.

    Attributes:
        tensor: The tensor (for an FP8 weight with a scale, the FP8 weight).
        scale: Its scale when it is read dequantized, else None.
        zero: A ZeRO-3 parameter: how to gather it from the ranks' flat partitions (its
            ``tensor`` then describes the gathered parameter, stored nowhere as one).
    """

    tensor: TensorInfo
    scale: TensorInfo | None = None
    zero: ParamPlan | None = None

    @property
    def numel(self) -> int:
        return self.tensor.numel

    @property
    def nbytes(self) -> int:
        return self.tensor.nbytes + (self.scale.nbytes if self.scale is not None else 0)

    @property
    def read_whole(self) -> bool:
        """Whether its layout is read whole (a strided view; chunks not in row order are
        too, but that is known only once their files are opened)."""
        t = self.tensor
        return t.stride is not None or (t.file is None and not t.chunks)


@dataclass(slots=True)
class Work:
    """One checkpoint's share of the work.

    Attributes:
        index: The checkpoint.
        targets: What can be read of it, by tensor name.
        stats: Names whose figures are wanted.
        updates: Names whose update since the previous checkpoint (of the list given to
            :func:`compute`) is wanted; both must hold them with the same number of values.
        got: Figures computed, by name.
        got_updates: Squared update norms computed, by name (None: a value was not finite).
        errors: Names that could not be read, with why.
    """

    index: CheckpointIndex
    targets: dict[str, Target]
    stats: set[str] = field(default_factory=set)
    updates: set[str] = field(default_factory=set)
    got: dict[str, Moments] = field(default_factory=dict)
    got_updates: dict[str, float | None] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


class _Sources:
    """One :class:`TensorSource` (and for ZeRO-3 parameters one
    :class:`~ckpt_cli.formats.zero.PieceReader`) per checkpoint per worker thread: open files
    are not shared between threads, and a reader checks each zip record's CRC-32 once, not
    once per parameter whose share it holds."""

    def __init__(self, works: list[Work]):
        self.sources: PerThread[int, TensorSource] = PerThread(
            lambda i: TensorSource(works[i].index))
        self.gatherers: PerThread[int, PieceReader] = PerThread(lambda _: _piece_reader())

    def close(self) -> None:
        self.sources.close()
        self.gatherers.close()


def _piece_reader() -> PieceReader:
    return PieceReader()


class _Window:
    """Takes a tensor's values ``n`` at a time from its stream of pieces."""

    def __init__(self, pieces: Iterator[np.ndarray]):
        self.pieces = pieces
        self.rest: np.ndarray | None = None

    def take(self, n: int) -> np.ndarray:
        import numpy as np  # heavy: numpy

        parts: list[np.ndarray] = []
        have = 0
        while have < n:
            if self.rest is None or self.rest.size == 0:
                nxt = next(self.pieces, None)
                if nxt is None:
                    raise CkptError(f"values end after {have:,} of {n:,} expected")
                self.rest = nxt.reshape(-1)
            piece = self.rest[:n - have]
            self.rest = self.rest[n - have:]
            parts.append(piece)
            have += piece.size
        if len(parts) == 1:
            return parts[0]
        if len({p.dtype for p in parts}) > 1:
            parts = [p.astype(np.float64) for p in parts]
        return np.concatenate(parts)


def _pieces(sources: _Sources, i: int, target: Target,
            piece_bytes: int) -> Iterator[np.ndarray]:
    t = target.tensor
    if target.zero is not None:
        yield from _gathered(sources.gatherers.get(i), target.zero, piece_bytes)
        return
    src = sources.sources.get(i)
    if target.scale is None:
        yield from src.iter_pieces(t, piece_bytes=piece_bytes, mapped=True)
        return

    scale = src.read(target.scale)
    yield from fp8.dequantize_pieces(src.iter_pieces(t, piece_bytes=piece_bytes, mapped=True),
                                     scale, t.shape, "F32")


def _gathered(reader: PieceReader, plan: ParamPlan,
              piece_bytes: int) -> Iterator[np.ndarray]:
    """A ZeRO-3 parameter's values, gathered whole from the ranks' partitions (positioned
    reads of its pieces, padding trimmed: as ``consolidate`` and zero_to_fp32 rebuild it)."""

    yield from split_pieces(reader.read(plan), piece_bytes)


def _window_elems(window_bytes: int) -> int:
    return max(1, window_bytes // 4)


def compute(works: list[Work], *, budget: int, threads: int,
            on_progress: Progress | None = None,
            select: Callable[[str], bool] | None = None) -> int:
    """Compute what each :class:`Work` asks for, filling its ``got``/``got_updates``/``errors``.

    Args:
        works: The checkpoints in step order (updates are between neighbours of this list).
        budget: Memory budget in bytes for the windows of the jobs running at once.
        threads: Jobs at once (at most; the budget may allow fewer).
        on_progress: Progress callback (label ``values``), in bytes read.
        select: Compute only the names it accepts (``--part``).

    Returns:
        Bytes of tensor data read (what was there to read: not what a damaged index declares).
    """
    sources = _Sources(works)
    try:
        return _compute(works, sources, budget=budget, threads=threads,
                        on_progress=on_progress, select=select)
    finally:
        sources.close()


def _compute(works: list[Work], sources: _Sources, *, budget: int, threads: int,
             on_progress: Progress | None,
             select: Callable[[str], bool] | None) -> int:
    # Small plain tensors: by runs. Each fits the smallest window a one-checkpoint job gets
    # (with as many threads as asked for; the engine may use fewer, and larger windows).
    smallest = max(_MIN_WINDOW, min(PIECE_BYTES, budget // (max(1, threads) * 2)))
    taken, runs = take_plain(works, sources, select, smallest)
    names: dict[str, tuple[int, ...]] = {}
    shared: dict[tuple[int, ...], tuple[int, ...]] = {}  # a million names share a few chains
    for i, w in enumerate(works):
        wanted = (w.stats - taken[i]) | w.updates
        if i + 1 < len(works):
            wanted |= works[i + 1].updates & set(w.targets)
        for n in wanted:
            chain = (*names.get(n, ()), i)
            names[n] = shared.setdefault(chain, chain)
    if select is not None:
        names = {n: c for n, c in names.items() if select(n)}
    order = sorted(names)
    chains = [names[n] for n in order]  # each in increasing order, once each (see above)
    threads = max(1, min(threads, len(order) + len(runs) or 1))
    sizes: list[int] = []
    costs: list[int] = []
    windows: list[int] = []
    per_len: dict[int, int] = {}
    for n, chain in zip(order, chains, strict=True):
        per = per_len.get(len(chain))
        if per is None:
            per = max(_MIN_WINDOW, min(PIECE_BYTES, budget // (threads * 2 * len(chain))))
            per_len[len(chain)] = per
        windows.append(per)
        if len(chain) == 1:
            t = works[chain[0]].targets[n]
            sizes.append(t.nbytes)
            costs.append(_cost(t, per))
        else:
            sizes.append(sum(works[i].targets[n].nbytes for i in chain))
            costs.append(sum(_cost(works[i].targets[n], per) for i in chain))
    _enough_files(threads * sum(min(64, len(w.index.files) or 1) for w in works))
    done = [0] * len(order)  # bytes read, per job (each writes its own slot)
    plain_done = [0] * len(runs)
    one = max(_MIN_WINDOW, min(PIECE_BYTES, budget // (threads * 2)))

    def plain(r: int) -> Callable[[Meter], None]:
        def some(meter: Meter) -> None:
            if meter.stop.is_set():
                return
            run = runs[r]
            got = run_plain(works, sources, run, meter)
            if got is not None:
                plain_done[r] = got
            # Unreadable as a run (or, of DCP items, those not recognised): tensor by tensor,
            # each error in its words.
            for n in run.names if got is None else run.rest:
                if meter.stop.is_set():
                    return
                plain_done[r] += _run(works, n, (run.work,), one, sources, meter)
        return some

    def job(first: int, end: int) -> Callable[[Meter], None]:
        def some(meter: Meter) -> None:
            todo: Iterable[int] = range(first, end)
            if end - first > 1:  # small tensors: read by runs of adjacent byte ranges
                todo = run_batch(works, order, chains, windows, sources, meter, done, first,
                                 end)
            for k in todo:
                if meter.stop.is_set():
                    return
                done[k] = _run(works, order[k], chains[k], windows[k], sources, meter)
        return some

    batches = _batches(sizes)
    run_bounded([plain(r) for r in range(len(runs))] + [job(*b) for b in batches],
                [2 * (r.hi - r.lo) for r in runs]
                + [max(costs[b[0]:b[1]]) for b in batches],
                budget=budget, threads=threads, total=sum(r.nbytes for r in runs) + sum(sizes),
                label="values", on_progress=on_progress)
    return sum(done) + sum(plain_done)


_SMALL_JOB = 64 << 10
"""Bytes below which a tensor's job joins its neighbours' (one after another, on one thread):
handing a job to a thread costs more than reading a small tensor; a header of a million tiny
tensors made a million hand-overs."""
_BATCH_BYTES = 1 << 20
_BATCH_JOBS = 256


def _batches(sizes: list[int]) -> list[tuple[int, int]]:
    """Consecutive jobs grouped (``(first, end)`` each): a large one alone, small ones
    together (see :data:`_SMALL_JOB`), in order."""
    out: list[tuple[int, int]] = []
    start = total = 0
    for k, size in enumerate(sizes):
        small = size < _SMALL_JOB
        if k > start and (not small or total + size > _BATCH_BYTES
                          or k - start >= _BATCH_JOBS or sizes[k - 1] >= _SMALL_JOB):
            out.append((start, k))
            start, total = k, 0
        total += size
    if start < len(sizes):
        out.append((start, len(sizes)))
    return out


def _run(works: list[Work], name: str, chain: tuple[int, ...], window_bytes: int, sources: _Sources,
         meter: Meter) -> int:
    """One tensor through the checkpoints of ``chain``, in lockstep (see the module notes);
    returns the bytes read."""
    streams: dict[int, _Window] = {}
    figures: dict[int, Moments | None] = {}
    sq: dict[int, float | None] = {}
    read = 0
    for i in chain:
        target = works[i].targets[name]
        try:
            streams[i] = _Window(_pieces(sources, i, target, window_bytes))
        except CkptError as e:
            works[i].errors[name] = e.message
        figures[i] = None  # the first window's figures, then merged into
        sq[i] = 0.0
    step = _window_elems(window_bytes)
    longest = max(works[i].targets[name].numel for i in chain)
    for start in range(0, longest, step):
        prev: tuple[int, np.ndarray] | None = None
        for i in chain:
            w = works[i]
            n = min(step, w.targets[name].numel - start)
            if n <= 0 or i not in streams:
                prev = None
                continue
            try:
                arr = streams[i].take(n)
            except CkptError as e:
                w.errors[name] = e.message
                del streams[i]
                prev = None
                continue
            except ValueError as e:  # a dequantization that cannot be (scale shape)
                w.errors[name] = str(e)
                del streams[i]
                prev = None
                continue
            got_bytes = arr.nbytes if w.targets[name].scale is None else n
            meter.add(got_bytes)
            read += got_bytes
            if name in w.stats:
                have = figures[i]
                if have is None:
                    figures[i] = piece_moments(arr)
                else:
                    have.merge(piece_moments(arr))
            if name in w.updates and prev is not None and prev[0] == i - 1:
                got = sq[i]
                if got is not None:
                    d = diff_sumsq(prev[1], arr)
                    sq[i] = None if d != d else got + d  # NaN: a value was not finite
            prev = (i, arr)
        if meter.stop.is_set():
            return read
        if not streams:  # every read failed: no values left to take (the bytes present bound
            break        # the loop, never the numel a damaged index declares)
    for i in chain:
        w = works[i]
        if name in w.errors:
            continue
        scale = w.targets[name].scale
        read += scale.nbytes if scale is not None else 0
        if name in w.stats:
            have = figures[i]
            w.got[name] = have if have is not None else Moments()
        if name in w.updates and (i - 1) in streams and i - 1 in chain:
            w.got_updates[name] = sq[i]
    for s in streams.values():
        close = getattr(s.pieces, "close", None)
        if close is not None:
            close()  # a generator stopped early releases its file mapping now
    return read


def _cost(t: Target, window: int) -> int:
    """Memory one checkpoint's share of a job holds: its piece and the window cut from it (a
    copy only where a window straddles two pieces), or the whole tensor twice where its layout
    is read whole; an FP8 weight adds its scale and the FP32 values of a window."""
    held = t.tensor.nbytes * 2 if t.read_whole else min(t.tensor.nbytes, window) * 2
    if t.scale is not None:
        held += t.scale.nbytes + 4 * min(t.numel, window)
    return held


def _enough_files(needed: int) -> None:
    """Raise the soft limit on open files to what the jobs may hold (each thread keeps each
    checkpoint's files open while it reads them in lockstep), as far as the hard limit allows."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = needed + 256
        if soft != resource.RLIM_INFINITY and soft < want:
            top = want if hard == resource.RLIM_INFINITY else min(want, hard)
            resource.setrlimit(resource.RLIMIT_NOFILE, (top, hard))
    except (ImportError, ValueError, OSError):
        return  # the open files of the jobs then fail one by one, each a named error
