"""``stats``: the health of the weights, in one checkpoint and across a run.

For one checkpoint (a file, a checkpoint directory, a URL): per tensor and per module, count,
mean, std, min, max, absmax, L2 norm, zeros, NaN and Inf, and a histogram of ``|x|`` by binade
(:mod:`ckpt_cli.tensors.moments` says how they are accumulated, and how accurately). For a run
directory: the same per checkpoint, plus each module's update against the previous checkpoint
(``||W_t - W_{t-1}|| / ||W_{t-1}||``), and the anomalies :mod:`.anomalies` flags.

Values are read once (:mod:`.engine`), on the worker threads, within the memory budget. What is
computed is kept in the user's cache directory (:mod:`.cache`), so that asking again, or asking
after one more checkpoint was saved, reads only what is new. ``part`` splits the tensors over
several processes (or machines sharing the cache directory): each computes its share into the
cache, and the one that finds every figure there reports the whole.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path

from ckpt_cli import dtypes, storage
from ckpt_cli.errors import CkptError, UsageError
from ckpt_cli.formats import allowlist, read_index
from ckpt_cli.formats.base import safety_findings
from ckpt_cli.formats.names import in_progress_reason, is_last_copy
from ckpt_cli.gcpause import collections_paused
from ckpt_cli.model import CheckpointIndex, Finding
from ckpt_cli.ops.stats.anomalies import broken_checkpoint, detect, mismatches, unreadable
from ckpt_cli.ops.stats.cache import Entry, FigureCache, cache_root, identity, is_default, key_of
from ckpt_cli.ops.stats.engine import Work, compute
from ckpt_cli.ops.stats.extent import distinct_bytes, files_bytes
from ckpt_cli.ops.stats.options import StatsOptions
from ckpt_cli.ops.stats.result import (
    WRAPPERS,
    Anomaly,
    CheckpointStats,
    ModuleStats,
    StatsResult,
    TensorStats,
    container_prefix,
    module_of,
)
from ckpt_cli.ops.stats.scope import WEIGHT_GROUPS, Scope, scope_of
from ckpt_cli.parts import assign
from ckpt_cli.progress import Progress
from ckpt_cli.resolve import resolve
from ckpt_cli.runs import list_run
from ckpt_cli.storage.reads import memory_budget, worker_threads
from ckpt_cli.tensors.moments import Moments, moments_kernel

__all__ = ["Anomaly", "CheckpointStats", "ModuleStats", "StatsOptions", "StatsResult",
           "TensorStats", "stats"]


def _check(opts: StatsOptions) -> None:
    for name in ("depth", "every", "last", "jobs"):
        v = getattr(opts, name)
        if v is not None and v < 1:
            raise UsageError(f"{name} must be at least 1, not {v}", param=name)
    if not (math.isfinite(opts.jump) and opts.jump > 1):
        raise UsageError(f"jump must be a number above 1, not {opts.jump}", param="jump")
    if opts.part is not None and opts.no_cache:
        raise UsageError("part cannot run with no_cache: the parts meet in the cache "
                         "directory (give them all the same cache_dir)",
                         param=("part", "no_cache", "cache_dir"))


class _Checkpoint:
    """One checkpoint being worked on."""

    def __init__(self, name: str, path: Path, step: int | None, index: CheckpointIndex,
                 scope: Scope, entry: Entry):
        self.name, self.path, self.step, self.index = name, path, step, index
        self.scope, self.entry = scope, entry


def stats(path: str | Path, options: StatsOptions | None = None, *,
          progress: Progress | None = None) -> StatsResult:
    """Figures of the values of one checkpoint, or of every checkpoint of a run directory.

    Args:
        path: A checkpoint (file, directory, URL) or a run directory.
        options: What to compute (default :class:`StatsOptions`).
        progress: Called as bytes are read: ``(phase, bytes_done, bytes_total)``
            (:class:`ckpt_cli.progress.Progress`).

    Returns:
        The :class:`StatsResult`; its ``exit_code`` is 1 when an anomaly was found.

    Raises:
        CkptError: For unreadable input.
        UsageError: For contradictory options, or a run with no complete checkpoint.
    """
    with collections_paused():  # millions of records, no cycles: see ckpt_cli.gcpause
        return _stats(path, options, progress)


def _stats(path: str | Path, options: StatsOptions | None,
           progress: Progress | None) -> StatsResult:
    t0 = time.perf_counter()
    opts = options or StatsOptions()
    _check(opts)
    allowed = allowlist.parse_names(opts.allow_global)
    where = storage.locate(path)
    target = resolve(where, input_format=opts.input_format)
    run = target.is_run  # with a resume pointer too: every checkpoint of the run is read
    skipped: dict[str, str] = {}
    broken: list[Anomaly] = []
    cache = FigureCache(cache_root(opts.cache_dir) if not opts.no_cache else None,
                        enabled=not opts.no_cache,
                        tighten=is_default(opts.cache_dir))
    ckpts = _run_checkpoints(where, opts, skipped, broken, cache) if run else [
        _one_checkpoint(target.checkpoint(), opts, cache)]
    works = _plan(ckpts, run)
    select = _part_select(ckpts, opts)
    budget = memory_budget(opts.max_memory)
    read = compute(works, budget=budget, threads=opts.jobs or worker_threads(),
                   on_progress=progress, select=select)
    read = min(read, _covered(ckpts, works))  # each byte of the files once
    for c, w in zip(ckpts, works, strict=True):
        _remember(c, w, cache, ckpts)
    part = None
    if opts.part is not None:
        # What every part cached so far, read once: the whole, when nothing is left to read.
        # Tensors that could not be read here are not waited for: no part will cache them.
        reloaded = [_reloaded(c, cache) for c in ckpts]
        left = _plan(reloaded, run)
        complete = all(not (w.stats | w.updates) - c.entry.errors.keys()
                       for c, w in zip(ckpts, left, strict=True))
        part = {"part": opts.part.index, "parts": opts.part.count, "complete": complete,
                "tensors": sum(len(w.got) for w in works)}
        if complete:
            ckpts, works = reloaded, left
    for w in works:  # the names wanted were read: a million of them need not wait for the result
        w.stats, w.updates = set(), set()
    shown = _assemble(ckpts, works, opts, run)
    if part is not None and not part["complete"]:
        for cs in shown:  # this part's share: the others' figures are not known yet
            cs.tensors = [t for t in cs.tensors if t.moments is not None or t.error]
        anomalies: list[Anomaly] = []
    else:
        found = detect(shown, jump=opts.jump)  # one checkpoint: NaN and Inf only
        found += mismatches(shown)
        for cs, ck in zip(shown, ckpts, strict=True):
            found += unreadable(cs, {**ck.scope.damaged, **ck.entry.errors})
        order = {cs.name: i for i, cs in enumerate(shown)}
        found = sorted(found, key=lambda a: order.get(a.checkpoint, 0))  # stable: rules' order
        # A checkpoint that could not be opened goes where its step puts it.
        anomalies = []
        for a in found:
            while broken and _before(broken[0], a):
                anomalies.append(broken.pop(0))
            anomalies.append(a)
        anomalies += broken
    any_scope = ckpts[0].scope if ckpts else None
    return StatsResult(
        path=where, run=run, checkpoints=shown, anomalies=anomalies,
        scope="all" if opts.all_tensors or (any_scope is not None and any_scope.widened)
        else "weights", depth=opts.depth, hist=opts.hist, jump=opts.jump, skipped=skipped,
        bytes_read=read, files_bytes=sum(files_bytes(c.index) for c in ckpts),
        seconds=time.perf_counter() - t0, kernel=moments_kernel(),
        cache_dir=cache.dir if cache.enabled else None, part=part,
        findings=_findings(ckpts, run, allowed))


def _findings(ckpts: list[_Checkpoint], run: bool, allowed: tuple[str, ...]) -> list[Finding]:
    """The safety findings of every checkpoint read (a run's under the checkpoint's name)."""
    out = []
    for c in ckpts:
        for f in allowlist.allow(safety_findings(c.index.findings), allowed):
            if run:
                f = dataclasses.replace(f, file=f"{c.name}/{f.file}" if f.file else c.name)
            out.append(f)
    return out


def _open(path: Path, opts: StatsOptions, cache: FigureCache) -> tuple[CheckpointIndex,
                                                                       Scope, Entry]:
    index = read_index(path, opts.input_format)
    scope = scope_of(index, everything=opts.all_tensors, filter_glob=opts.name_glob)
    entry = cache.load(key_of(identity(index)), index.tensors) if cache.enabled else Entry("")
    return index, scope, entry


def _one_checkpoint(path: Path, opts: StatsOptions, cache: FigureCache) -> _Checkpoint:
    index, scope, entry = _open(path, opts, cache)
    if opts.name_glob is not None and not scope.targets and not scope.skipped \
            and not scope.aliases:
        raise UsageError(f"name_glob {opts.name_glob!r} matches no tensor in scope",
                         param="name_glob", path=path)
    step = index.metadata.get("step")
    return _Checkpoint(path.name, path, step if isinstance(step, int) else index.name_step,
                       index, scope, entry)


def _before(a: Anomaly, b: Anomaly) -> bool:
    return a.step is not None and b.step is not None and a.step < b.step


def _run_checkpoints(where: Path, opts: StatsOptions, skipped: dict[str, str],
                     broken: list[Anomaly], cache: FigureCache) -> list[_Checkpoint]:
    listing = list_run(where, opts.pattern)
    for name in listing.leftovers:
        skipped[name] = in_progress_reason(name) or "a temporary or trash name, not a checkpoint"
    entries = []
    for k, e in enumerate(listing.entries):
        if e.complete:
            entries.append(e)
        elif any(o.complete for o in listing.entries[k + 1:]):
            # A later checkpoint is complete: this one is not still being written, but damaged.
            broken.append(broken_checkpoint(e.name, e.step, CkptError(e.reason or "incomplete")))
        else:
            skipped[e.name] = e.reason or "incomplete"
    for e in list(entries):
        # Lightning's last.ckpt copies the newest save: the same step read twice would be a
        # module that "stopped changing".
        twin = next((o for o in entries if o is not e and o.step == e.step
                     and not is_last_copy(o.name)), None)
        if is_last_copy(e.name) and e.step is not None and twin is not None:
            entries.remove(e)
            skipped[e.name] = f"a copy of step {e.step:,} ({twin.name}), read once as that"
    if opts.every is not None:
        entries = entries[::-1][::opts.every][::-1]
    if opts.last is not None:
        entries = entries[-opts.last:]
    out = []
    for e in entries:
        try:
            index, scope, entry = _open(e.path, opts, cache)
        except CkptError as err:  # complete by its name and markers, yet unreadable: damage
            broken.append(broken_checkpoint(e.name, e.step, err))
            continue
        out.append(_Checkpoint(e.name, e.path, e.step, index, scope, entry))
    if not out:
        why = f" ({broken[0].message})" if broken else ""
        raise UsageError(f"a run directory with no complete checkpoint to read{why}",
                         path=where)
    if opts.name_glob is not None and not any(c.scope.targets for c in out):
        raise UsageError(f"name_glob {opts.name_glob!r} matches no tensor in scope",
                         param="name_glob", path=where)
    return out


def _plan(ckpts: list[_Checkpoint], run: bool) -> list[Work]:
    """What to read of each checkpoint: figures not cached, and (in a run) updates against
    the previous checkpoint not cached, of tensors both hold with as many values."""
    works = []
    for i, c in enumerate(ckpts):
        w = Work(c.index, c.scope.targets)
        w.stats = {n for n in c.scope.targets if n not in c.entry.tensors}
        if run and i:
            prev = ckpts[i - 1]
            have = c.entry.updates.get(prev.entry.key, {})
            w.updates = {n for n, t in c.scope.targets.items()
                         if n in prev.scope.targets and n not in have
                         and tuple(prev.scope.targets[n].tensor.shape)
                         == tuple(t.tensor.shape)}
        works.append(w)
    return works


def _covered(ckpts: list[_Checkpoint], works: list[Work]) -> int:
    """Bytes of the files that the reads of ``works`` cover, each byte once (a storage read
    under several views counts once; never more than a checkpoint's files hold)."""
    total = 0
    for i, (c, w) in enumerate(zip(ckpts, works, strict=True)):
        later = works[i + 1].updates if i + 1 < len(works) else set()
        if not (w.updates or later) and len(w.stats) == len(w.targets):
            read = list(w.targets.values())  # every target (stats are names of targets)
        else:
            names = w.stats | w.updates | (later & set(w.targets))
            # In the targets' order (the index's), not the set's: records visited as they lie.
            read = [t for n, t in w.targets.items() if n in names]
        total += distinct_bytes(c.index, [t.tensor for t in read] + [
            t.scale for t in read if t.scale is not None])
    return total


def _part_select(ckpts: list[_Checkpoint], opts: StatsOptions) -> Callable[[str], bool] | None:
    if opts.part is None:
        return None

    sizes: dict[str, int] = {}
    for c in ckpts:
        for n, t in c.scope.targets.items():
            sizes[n] = sizes.get(n, 0) + t.nbytes
    names = sorted(sizes)
    owners = dict(zip(names, assign([sizes[n] for n in names], opts.part.count), strict=True))
    mine = opts.part.index
    return lambda n: owners.get(n) == mine


def _remember(c: _Checkpoint, w: Work, cache: FigureCache, ckpts: list[_Checkpoint]) -> None:
    """Keep what was computed: in the checkpoint's entry (this run's view) and the cache."""
    keep = cache.enabled and bool(w.got or w.got_updates)
    new = Entry(c.entry.key, tensors=dict(w.got) if keep else {})
    if c.entry.tensors:
        c.entry.tensors.update(w.got)
    else:  # nothing cached: the figures computed are the entry's (a million: not copied)
        c.entry.tensors = w.got
    if w.got_updates:
        i = ckpts.index(c)
        prev = ckpts[i - 1].entry.key
        c.entry.updates.setdefault(prev, {}).update(w.got_updates)
        new.updates[prev] = dict(w.got_updates)
    c.entry.errors.update(w.errors)
    if keep:
        cache.save(new, c.index.tensors)


def _reloaded(c: _Checkpoint, cache: FigureCache) -> _Checkpoint:
    entry = cache.load(c.entry.key, c.index.tensors)
    entry.errors = c.entry.errors
    return _Checkpoint(c.name, c.path, c.step, c.index, c.scope, entry)


def _assemble(ckpts: list[_Checkpoint], works: list[Work], opts: StatsOptions,
              run: bool) -> list[CheckpointStats]:
    out: list[CheckpointStats] = []
    prev_c: _Checkpoint | None = None
    for c, w in zip(ckpts, works, strict=True):
        cs = CheckpointStats(c.name, c.path, c.step, c.index.format)
        mods: dict[str, ModuleStats] = {}
        updates = c.entry.updates.get(prev_c.entry.key, {}) if (run and prev_c) else {}
        mod_sq: dict[str, float | None] = {}
        mod_prev: dict[str, float] = {}
        names_of: dict[str, str] = {}
        prefix = _prefix(c)
        scope = c.scope
        targets, aliases, skipped = scope.targets, scope.aliases, scope.skipped
        got, errors, tensors = c.entry.tensors, c.entry.errors, c.index.tensors
        every = list(targets)
        if aliases or skipped:
            every = list(dict.fromkeys([*every, *aliases, *skipped]))
        # Visited in the order shown (names sorted once: a module's tensors one after the
        # other), so its figures merge in that order too.
        natural = _Natural()
        every.sort(key=natural)
        if natural.ties:  # names equal but for leading zeros: in name order, as always
            every.sort()
            every.sort(key=natural)
        # Nothing cached (the entry's figures are those computed): none came from the cache.
        cs.cached = 0 if c.entry.tensors is w.got else sum(
            1 for n in targets if n not in w.got and n in c.entry.tensors)
        kinds: dict[str, str | None] = {}  # dtype -> its kind (None: not known)
        append = cs.tensors.append
        quick = opts.depth is None and not prefix
        # Modules are met in the order shown unless one holds tensors and a submodule of it
        # too (``a.b.c.w`` sorts before ``a.b.w``), or names tie: then they are sorted.
        nested = not quick or natural.ties
        last_head = last_mod = ""
        # The index's records and the targets are not needed once shown: freed as the result
        # grows (a million of each), unless an alias may still look its target up.
        take = tensors.pop
        take_target = targets.get if aliases else targets.pop
        for name in every:
            t = take(name)
            if quick:
                head = name.rpartition(".")[0] or name  # module_of's, said quickly
                if head == last_head:
                    mod = last_mod
                else:
                    if not nested and last_head.startswith(head) \
                            and last_head[len(head):len(head) + 1] == ".":
                        nested = True
                    # One string per module, not per tensor: the module's own, once made.
                    ms = mods.get(head)
                    mod = last_mod = ms.name if ms is not None else head
                    last_head = head
            else:
                mod = module_of(name, opts.depth, prefix)
                mod = names_of.setdefault(mod, mod)  # one string per module, not per tensor
            alias = aliases.get(name) if aliases else None
            key = alias or name
            target = take_target(key, None)
            m = got.get(key)
            err = (errors.get(key) if errors else None) or (
                skipped.get(name) if skipped else None)
            scale = target.scale.name if target is not None and target.scale is not None \
                else None
            group = t.group
            shape = t.shape if type(t.shape) is tuple else tuple(t.shape)
            append(TensorStats(name, t.dtype, shape, group,
                               m if err is None else None, scale, err, alias, mod))
            if alias is not None or m is None or err is not None:
                continue
            ms = mods.get(mod)
            if ms is None:
                # A module of one tensor has that tensor's figures: its Moments is shared
                # until a second tensor joins (then a copy takes it, merged as always).
                ms = mods[mod] = ModuleStats(mod, 1, m)
            else:
                if ms.tensors == 1:
                    ms.moments = _copy(ms.moments)
                ms.tensors += 1
                ms.moments.merge(m)
            if group == "other":  # callbacks, loop counters: shown, never judged
                ms.state_nan += m.nan
                ms.state_inf += m.inf
                continue
            if group == "buffer":
                ms.masks += m.neginf
            elif group == "optimizer":
                ms.optimizer = True
            if t.dtype in kinds:
                kind = kinds[t.dtype]
            else:
                info = dtypes.DTYPES.get(t.dtype)
                kind = kinds[t.dtype] = None if info is None else info.kind
            # Adam's state.N.step counts steps in a float tensor: a counter, not a weight.
            counter = group == "optimizer" and name.rpartition(".")[2] == "step"
            if kind not in ("int", "uint", "bool") and not counter:
                ms.float_sumsq = (ms.float_sumsq or 0.0) + (
                    m.sumsq_value if m.scale else m.sumsq)  # unscaled: the same value
                if group == "model" and len(t.shape) >= 2 and t.shape[0]:
                    ms.init_sq += t.shape[0] / 3  # numel * (1 / (3 * fan_in)): kaiming's
            if prev_c is not None and name in updates:
                sq = updates[name]
                before = prev_c.entry.tensors.get(name)
                old = mod_sq.get(mod, 0.0)
                mod_sq[mod] = None if sq is None or old is None else old + sq
                mod_prev[mod] = mod_prev.get(mod, 0.0) + (before.sumsq_value if before
                                                          else 0.0)
        for mod, ms in mods.items():
            if mod in mod_sq:
                sq = mod_sq[mod]
                ms.update = math.sqrt(sq) if sq is not None else None
                ms.previous_l2 = math.sqrt(mod_prev[mod])
        tensors.clear()
        targets.clear()
        cs.modules = [mods[k] for k in sorted(mods, key=natural)] if nested else list(
            mods.values())
        cs.computed = len(w.got)
        out.append(cs)
        prev_c = c
    return out


def _prefix(c: _Checkpoint) -> str:
    """:func:`container_prefix` of a checkpoint's weights in scope; a million names are listed
    only when the first of them starts with a prefix that could be everyone's."""
    tensors = c.index.tensors
    containers = [k for k, g in c.index.containers.items() if g == "model"]
    first = next((n for n in c.scope.targets if tensors[n].group in WEIGHT_GROUPS), None)
    if first is None or not any(first.startswith(p) for p in (*containers, *WRAPPERS)):
        return ""  # what container_prefix finds then: no prefix is every name's
    return container_prefix(
        [n for n in c.scope.targets if tensors[n].group in WEIGHT_GROUPS], containers)


def _copy(m: Moments) -> Moments:
    """``m`` merged into empty figures: a module's, from its first tensor's."""
    out = Moments()
    out.merge(m)
    return out


class _Natural(dict[str, str]):
    """Sort key putting ``layers.2`` before ``layers.10``: a string whose plain order is the
    order of the list of ``(0, int(part))`` for a part of digits, ``(1, part)`` for another
    (parts compared in turn, a name that is a prefix of another first; ties keep their order).

    Strings, not lists of tuples: a header of a million tensors sorts a million keys, and
    strings compare in C. A part is tagged ``\x01`` (digits: then its length, then its
    digits without leading zeros) or ``\x02`` (any other, as it is), and parts are joined by
    ``\x00``, below every character a part holds (characters below ``\x03`` in a part are
    escaped, in order, behind ``\x01``). Each part's encoding is made once.
    """

    ties: bool

    def __missing__(self, p: str) -> str:
        k: str | None = None
        if p.isdigit():
            try:
                digits = str(int(p))
                k = f"\x01{chr(0x20 + len(digits))}{digits}"
                self.ties = self.ties or digits != p
            except ValueError:  # a digit int() does not take (a superscript): a word
                pass
        if k is None:
            k = "\x02" + (p if not p or min(p) >= "\x03" else p.translate(_ESCAPE))
        self[p] = k
        return k

    def __init__(self) -> None:
        super().__init__()
        self.ties = False  # a part of digits with leading zeros: two names may tie

    def __call__(self, name: str) -> str:
        return "\x00".join(map(self.__getitem__, name.split(".")))


_ESCAPE = {c: f"\x01{chr(c + 1)}" for c in range(3)}
