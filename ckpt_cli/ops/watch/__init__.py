"""``ckpt watch``: verify each checkpoint of a run as it commits, and record the verdict.

A pass lists the run (:func:`~ckpt_cli.runs.list_run`: commit markers, headers and zip end
records only, never tensor data). A checkpoint is examined once it looks complete (its format's
own commit marker is there: DCP ``.metadata``, an HF index or model file with
``trainer_state.json``, a torch zip's end record, no temporary name) and nothing in it changed
for ``settle`` seconds. It is then validated (structure, or CRC / values), its manifest is
written when it is good, and one line goes to the run ledger (:mod:`ckpt_cli.trust.ledger`).

The ledger is the watcher's only state: a verdict records each file's size, modification time
and inode. After a restart, and whenever a checkpoint's signature (bytes, files, newest change)
differs from the last pass, a good checkpoint's files are stat-ed and those that differ from
the verdict's record are hashed against its manifest: a shard corrupted after its save (the
watcher down or not) turns the verdict bad. A checkpoint committed again after its verdict
(its commit marker rewritten: DCP ``.metadata``, ``trainer_state.json``, a torch file itself; a
run resumed from an earlier step saves those steps again) is a new save: verified afresh (a
single file with ``crc``, so a flipped byte in a torch zip is not taken for one), its new line
superseding the old. A checkpoint that stays incomplete for ``abandon_after`` seconds (a job
killed mid-save) is recorded bad as abandoned, never good.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpt_cli import storage
from ckpt_cli.errors import CkptError, UsageError
from ckpt_cli.formats.names import is_last_copy, is_own_temporary
from ckpt_cli.manifest import compute_manifest, manifest_path, read_manifest, write_manifest
from ckpt_cli.model import RunEntry
from ckpt_cli.ops.options.watch import WatchOptions as WatchOptions
from ckpt_cli.ops.prune import prune, sweep
from ckpt_cli.ops.prune.retention import PrunePolicy
from ckpt_cli.ops.validate import Options, validate_checkpoint
from ckpt_cli.ops.watch.hooks import HookResult, run_on_bad
from ckpt_cli.ops.watch.wake import PollWaker, Waker
from ckpt_cli.optionspec import word
from ckpt_cli.resolve import runs_below
from ckpt_cli.runs import (
    ITSELF,
    holds_final_model,
    is_run_dir,
    list_run,
    run_dir_problem,
    run_entry,
    tree_scan,
    writer_lock,
)
from ckpt_cli.trust import ledger
from ckpt_cli.trust.thinning import pending

ABANDONED = "abandoned"
IGNORED = "ignored"


def retention(opts: WatchOptions) -> PrunePolicy | None:
    """The retention a watcher applies after a pass that verified something: None unless
    ``keep``, ``keep_every`` or thinning is asked for.

    Raises:
        UsageError: A policy that cannot be meant (as :meth:`PrunePolicy.check` says), or an
            empty ``pattern``.
    """
    if (opts.keep, opts.keep_every, opts.thin_after, opts.thin_to,
            opts.keep_full_every) == (None,) * 5:
        return None
    if opts.pattern is not None and not opts.pattern.strip():
        raise UsageError(f"pattern {opts.pattern!r} is empty", param="pattern")
    policy = PrunePolicy(keep=opts.keep, keep_every=opts.keep_every, grace=opts.grace,
                         thin_after=opts.thin_after, thin_to=opts.thin_to,
                         keep_full_every=opts.keep_full_every,
                         keep_abandoned=opts.keep_abandoned)
    policy.check()
    return policy


@dataclass(slots=True)
class WatchEvent:
    """Something the watcher has to say (one JSON line with ``--json``).

    Attributes:
        event: ``verified``, ``abandoned``, ``pruned``, ``error``, ``pending`` or ``ignored``
            (ledger lines passed over: ``path`` names the line's checkpoint, None for
            unreadable lines; ``problems`` says why).
        run: The run directory.
        path: The checkpoint, relative to the run (None for run-level events).
        step: Its step.
        verdict: ``good`` or ``bad`` (verified / abandoned).
        bytes: Its size.
        manifest_digest: SHA-256 of the manifest written with a good verdict.
        problems: Why it is bad; for ``error``, the message.
        deleted: For ``pruned``: what retention deleted.
        thinned: For ``pruned``: what retention rewrote without optimizer state.
        on_bad: For an ``error`` about a failed ``--on-bad`` command: how it ended.
        pending: For ``pending``: ``{"state": "settling" | "locked" | "incomplete",
            "detail": sentence}``, why the checkpoint was not judged in this pass.
    """

    event: str
    run: str
    path: str | None = None
    step: int | None = None
    verdict: str | None = None
    bytes: int | None = None
    manifest_digest: str | None = None
    problems: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    thinned: list[str] = field(default_factory=list)
    on_bad: HookResult | None = None
    pending: dict[str, str] | None = None

    @property
    def bad(self) -> bool:
        """Whether this reports a bad checkpoint (or a failure)."""
        return self.verdict == ledger.BAD or self.event == "error"

    def to_json(self) -> dict[str, Any]:
        """The event as a JSON object."""
        return {"schema_version": 1, "event": self.event, "run": self.run, "path": self.path,
                "step": self.step, "verdict": self.verdict, "bytes": self.bytes,
                "manifest_digest": self.manifest_digest, "problems": list(self.problems),
                "deleted": list(self.deleted), "thinned": list(self.thinned),
                "on_bad": self.on_bad.to_json() if self.on_bad is not None else None,
                "pending": dict(self.pending) if self.pending is not None else None}


Signature = tuple[int, int, float]


def _signature(e: RunEntry) -> Signature:
    return (e.bytes, e.files, max(e.mtime, e.changed))


def verify_checkpoint(run_dir: Path, path: Path, *, crc: bool = False, values: bool = False,
                      step: int | None = None, write: bool = True,
                      fresh: bool = False) -> ledger.LedgerEntry:
    """Validate one checkpoint of a run, write its manifest when good, and return the line.

    Args:
        run_dir: The run directory (the ledger's home).
        path: The checkpoint inside it.
        crc: Full byte-level check rather than structure only.
        values: Scan values too.
        step: Its step when known (else what validation found).
        write: Append the line to the ledger.
        fresh: It was just saved again under the same name (Lightning's ``last.ckpt``, a
            checkpoint re-saved after a resume): a manifest left from the earlier save
            describes other bytes, so it is removed before validating (a good verdict writes
            a new one).

    Returns:
        The :class:`~ckpt_cli.trust.ledger.LedgerEntry` (appended when ``write``).
    """

    rel = _rel(run_dir, path)
    problems: list[str] = []
    digest = None
    stamps: dict[str, ledger.Stamp] = {}
    try:
        if fresh:
            manifest_path(path).unlink(missing_ok=True)
        # Before validating: a file written while it is validated then differs from its record.
        stamps = ledger.stamp(path)
        report = validate_checkpoint(path, Options(quick=not crc, values=values))
        problems = [f"{f.file + ': ' if f.file else ''}{f.message}"
                    for f in report.findings if f.severity == "error"][:5]
        step = step if step is not None else report.step
        if not problems:
            # The stamps go into the manifest too: the witness a forged line cannot copy.
            manifest = compute_manifest(path)[0]
            manifest.stamps = dict(stamps)
            write_manifest(path, manifest=manifest)
            digest = ledger.manifest_digest(path)
    except CkptError as e:
        problems = [str(e)]
    size = tree_scan(path).bytes if not problems or path.exists() else 0
    entry = ledger.LedgerEntry(path=rel, step=step, time=time.time(), event=ledger.VERIFIED,
                               verdict=ledger.BAD if problems else ledger.GOOD, bytes=size,
                               manifest_digest=digest, problems=tuple(problems),
                               files=stamps, committed=ledger.committed_at(stamps))
    if write:
        ledger.append(run_dir, entry)
    return entry


def _secs(t: float) -> str:
    """Seconds for a sentence: ``0.3s``, ``12s``, ``4m05s``."""
    if t < 10:
        return f"{t:.1f}s"
    if t < 60:
        return f"{t:.0f}s"
    m, sec = divmod(int(t), 60)
    return f"{m}m{sec:02d}s"


def _rel(run_dir: Path, path: Path) -> str:
    try:
        return Path(os.path.relpath(str(path), str(run_dir))).as_posix()
    except ValueError:
        return path.name


class RunWatcher:
    """The state of watching one run directory."""

    def __init__(self, root: Path, opts: WatchOptions, emit: Callable[[WatchEvent], None],
                 clock: Callable[[], float] = time.time,
                 policy: PrunePolicy | None = None) -> None:
        self.root = root
        self.opts = opts
        self.policy = policy
        self.emit = emit
        self.clock = clock
        self.seen: dict[str, tuple[Signature, str]] = {}  # name -> (signature, verdict)
        self.known: dict[str, ledger.LedgerEntry] = {}  # the ledger's newest line per path
        self.loaded = False
        self._ledger_stamp: tuple[int, int, int] | None = None
        self._ignored: set[str] = set()  # ledger paths reported as ignored
        self._unreadable = 0  # unreadable ledger lines reported
        # When a checkpoint this pass left settling is due a look (None: nothing settling).
        self.next_due: float | None = None

    def run_pass(self) -> list[WatchEvent]:
        """One look at the run: verify what committed, re-check what changed, apply retention.

        Returns:
            The events of this pass (also given to ``emit``).
        """

        out: list[WatchEvent] = []
        for note in self._refresh_known():
            self._say(note, out)
        listing = list_run(self.root, self.opts.pattern)
        now = self.clock()
        self.next_due = None
        verified_any = examined = False
        for e in listing.entries:
            sig = _signature(e)
            cached = self.seen.get(e.name)
            if cached is not None and cached[0] == sig:
                continue
            ev = self._examine(e, sig, now, cached)
            examined = True
            if ev is not None:
                self._say(ev, out)  # at once, not at the end of the pass
                verified_any = verified_any or ev.verdict == ledger.GOOD
        if verified_any and self.policy is not None:
            ev = self._retain()  # its prune sweeps too
            if ev is not None:
                self._say(ev, out)
        elif (examined or any(is_own_temporary(n) for n in listing.leftovers)) and (
                storage.has_file_system(self.root)):
            # What a killed write left (a thinning's or a manifest's temporary): removed by
            # the sweep every prune starts with, under its lock.
            sweep(self.root)
        return out

    def _refresh_known(self) -> list[WatchEvent]:
        """Read the ledger again when someone else wrote to it since (a prune that thinned
        checkpoints, a training callback): a line cached from before would make a rewritten
        checkpoint look tampered with. Locally a stat tells; on object storage it is re-read
        after this watcher's own retention only.

        Returns:
            An ``ignored`` event for each ledger line passed over that this watcher has not
            reported yet (naming no checkpoint directly in the run, or unreadable).
        """
        stamp = None
        path = ledger.ledger_path(self.root)
        if storage.has_file_system(path):
            try:
                st = os.stat(path)
                stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
            except OSError:
                stamp = (0, 0, 0)
            if stamp != self._ledger_stamp:
                self.loaded = False
        if self.loaded:
            return []
        book = ledger.read_ledger(self.root)
        self.known = book.latest() if book is not None else {}
        self.loaded = True
        self._ledger_stamp = stamp
        out: list[WatchEvent] = []
        for p in book.ignored if book is not None else ():
            if p not in self._ignored:
                self._ignored.add(p)
                out.append(WatchEvent(IGNORED, str(self.root), p, problems=[
                    "the ledger line names no checkpoint directly in the run: ignored"]))
        skipped = book.skipped if book is not None else 0
        if skipped > self._unreadable:
            out.append(WatchEvent(IGNORED, str(self.root), problems=[
                f"{skipped} ledger line{'s' if skipped != 1 else ''} could not be read (torn "
                "by a crash or edited by hand): ignored"]))
        self._unreadable = skipped
        return out

    def _say(self, ev: WatchEvent, out: list[WatchEvent]) -> None:
        out.append(ev)
        self.emit(ev)  # reported first: a slow hook must not delay the report
        if ev.bad and ev.event != "error" and ev.path is not None and self.opts.on_bad:
            hook = run_on_bad(self.opts.on_bad, self.root / ev.path, self.root,
                              timeout=self.opts.on_bad_timeout)
            if not hook.ok:
                failed = WatchEvent("error", str(self.root), ev.path, ev.step,
                                    problems=[hook.describe(self.opts.caller)], on_bad=hook)
                out.append(failed)
                self.emit(failed)

    def _examine(self, e: RunEntry, sig: Signature, now: float,
                 cached: tuple[Signature, str] | None) -> WatchEvent | None:
        rel = _rel(self.root, e.path)
        line = self.known.get(rel)
        if line is not None and (pending(line) or (line.good and not line.manifest_digest)):
            # A thinning was interrupted (whole or thinned), or a good line names no manifest
            # to re-check the files against (a thinning recorded as not done after its
            # manifest went; a thinning of a checkpoint never verified): verify it afresh.
            line = None
        if not e.complete:
            # Its newest modification time: how long ago the writer last wrote to it.
            if now - e.mtime < self.opts.abandon_after:
                # still being written: looked at again next pass
                return self._pending(e, rel, "incomplete",
                                     f"not committed yet ({e.reason or 'no marker'}), last "
                                     f"written {_secs(now - e.mtime)} ago")
            if line is not None and line.bytes == e.bytes and line.verdict == ledger.BAD:
                self.seen[e.name] = (sig, ledger.BAD)
                return None
            reason = f"{ABANDONED}: incomplete for {now - e.mtime:.0f}s ({e.reason or 'no marker'})"
            entry = ledger.LedgerEntry(path=rel, step=e.step, time=now, event=ledger.VERIFIED,
                                       verdict=ledger.BAD, bytes=e.bytes, problems=(reason,))
            ledger.append(self.root, entry)
            self.known[rel] = entry
            self.seen[e.name] = (sig, ledger.BAD)
            return WatchEvent(ABANDONED, str(self.root), rel, e.step, ledger.BAD, e.bytes,
                              problems=[reason])
        if now - sig[2] < self.opts.settle:
            # committed just now: let the writer finish its last touches
            due = sig[2] + self.opts.settle
            self.next_due = due if self.next_due is None else min(self.next_due, due)
            return self._pending(e, rel, "settling",
                                 word(f"changed {_secs(max(0.0, now - sig[2]))} ago, "
                                      f"within `settle={_secs(self.opts.settle)}`",
                                      self.opts.caller))

        lock = writer_lock(e.path)
        if lock is not None:
            # a writer still holds it: looked at again next pass
            return self._pending(e, rel, "locked", f"a writer holds {lock}")
        if (line is not None and line.good and is_last_copy(e.name)
                and e.mtime > line.time and not e.path.is_symlink()):
            # Lightning writes last.ckpt again at every save (a copy, not a link, unless
            # save_last="link"): modified after its verdict, it is a new save, verified afresh
            # (its old manifest describes the previous save), not damage to the old one.
            return self._verify(e, rel, fresh=True)
        if line is not None:
            now_files = ledger.stamp(e.path)
            if line.good:
                # Files whose stamp differs from the verdict's record are hashed again (its
                # inode-change time included, which a write that sets the modification time
                # back cannot restore); all of them when this watcher saw it change, or the
                # line is not the one its manifest was written with. Then the index, read
                # through the allowlist: the checks resume-path makes before trusting a line.
                check = ledger.recheck_trusted(e.path, line, full=cached is not None,
                                                now=now_files)
                problems = check.problems
                if not problems:
                    if now_files and (now_files != dict(line.files) or not check.witnessed):
                        self._restamp(e.path, line, now_files)  # touched or copied, same bytes
                    self.seen[e.name] = (sig, ledger.GOOD)
                    return None
                if not ledger.saved_again(e.path, line, now_files):
                    return self._record_bad(e, sig, rel, problems)
                # committed again since (a run resumed from an earlier step): a new save
                return self._verify(e, rel, fresh=True, crc=not e.path.is_dir())
            again = ledger.saved_again(e.path, line, now_files)
            if line.bytes == e.bytes and not again:
                self.seen[e.name] = (sig, ledger.BAD)
                return None  # reported already (before a restart)
            return self._verify(e, rel, sig=sig, fresh=again, crc=again and not e.path.is_dir())
        return self._verify(e, rel, sig=sig)

    def _restamp(self, path: Path, line: ledger.LedgerEntry,
                 files: dict[str, ledger.Stamp]) -> None:
        """Record a good checkpoint's new stamps once its changed files hashed as verified (a
        copy, a ``touch``), in its manifest and a new ledger line: the verdict, the digests
        and the commit time stay. ``files`` were taken before the hashing, so a write since
        shows as a change next time."""

        digest = line.manifest_digest
        try:
            manifest = read_manifest(path)
            if manifest is not None:
                manifest.stamps = dict(files)
                write_manifest(path, manifest=manifest)
                digest = ledger.manifest_digest(path)
        except CkptError:
            return  # recorded next time: the files are hashed again, nothing is trusted
        entry = dataclasses.replace(line, time=self.clock(), files=files,
                                    manifest_digest=digest)
        ledger.append(self.root, entry)
        self.known[line.path] = entry

    def _verify(self, e: RunEntry, rel: str, *, sig: Signature | None = None,
                fresh: bool = False, crc: bool = False) -> WatchEvent | None:
        entry = verify_checkpoint(self.root, e.path, crc=self.opts.crc or crc,
                                  values=self.opts.values, step=e.step, write=False,
                                  fresh=fresh)
        if not entry.good and not e.path.exists():
            return None  # deleted meanwhile (a cron prune): nothing to judge
        ledger.append(self.root, entry)
        self.known[rel] = entry
        if entry.good or sig is None:
            # As it is now, with its manifest: the next pass must not take that for a change.
            sig = _signature(run_entry(e.path))
        self.seen[e.name] = (sig, entry.verdict)
        return WatchEvent(ledger.VERIFIED, str(self.root), rel, entry.step, entry.verdict,
                          entry.bytes, entry.manifest_digest, list(entry.problems))

    def _pending(self, e: RunEntry, rel: str, state: str, detail: str) -> WatchEvent | None:
        if not self.opts.report_pending:
            return None
        return WatchEvent("pending", str(self.root), rel, e.step, bytes=e.bytes,
                          pending={"state": state, "detail": detail})

    def _record_bad(self, e: RunEntry, sig: Signature, rel: str,
                    problems: list[str]) -> WatchEvent:
        entry = ledger.LedgerEntry(path=rel, step=e.step, time=self.clock(),
                                   event=ledger.VERIFIED, verdict=ledger.BAD, bytes=e.bytes,
                                   problems=tuple(problems))
        ledger.append(self.root, entry)
        self.known[rel] = entry
        self.seen[e.name] = (sig, ledger.BAD)
        return WatchEvent(ledger.VERIFIED, str(self.root), rel, e.step, ledger.BAD, e.bytes,
                          problems=problems)

    def _retain(self) -> WatchEvent | None:
        assert self.policy is not None
        try:
            result = prune(self.root, self.policy, pattern=self.opts.pattern)
        except CkptError as e:
            # Another prune (cron) holds the lock, or the run cannot be pruned now: the next
            # pass that verifies something tries again.
            return WatchEvent("error", str(self.root), problems=[f"retention: {e}"])
        deleted = [d.entry.name for d in result.plan.decisions
                   if d.delete and not (self.root / d.entry.name).exists()]
        thinned = list(result.thinned)
        if thinned:
            self.loaded = False  # its ledger lines are new: read before the next look
        for n in [*deleted, *thinned]:  # a thinned one is looked at afresh (its new manifest)
            self.seen.pop(n, None)
        if not deleted and not thinned and result.ok:
            return None
        return WatchEvent("pruned", str(self.root), deleted=deleted, thinned=thinned,
                          problems=[] if result.ok else ["retention: some deletions failed"])



def run_dirs(root: Path) -> list[Path]:
    """The run directories to watch under ``root``: itself, or the runs it holds.

    Raises:
        UsageError: ``root`` is itself a checkpoint (its ledger and manifests would be
            written inside it); the message names its run directory.
    """

    if is_run_dir(root) or holds_final_model(root):
        return [root]
    problem = run_dir_problem(root)
    if problem is not None and problem.startswith(ITSELF):
        raise UsageError(problem, path=root, hint=f"watch the directory that holds it: "
                                                  f"{root.parent}")
    # The runs below, as every command finds them (a Lightning lightning_logs/version_N/
    # checkpoints/ tree too); none yet: the root is a run before its first save.
    return [root / rel for rel, kind in runs_below(root) if kind == "run"] or [root]


class Watcher:
    """Watch a root: one run directory, or a directory of runs (new runs are picked up).

    Raises:
        UsageError: On construction, for retention options that cannot be meant (see
            :func:`retention`).
    """

    def __init__(self, root: Path, opts: WatchOptions,
                 emit: Callable[[WatchEvent], None]) -> None:
        self.root = root
        self.opts = opts
        self.policy = retention(opts)
        self.emit = emit
        self.runs: dict[str, RunWatcher] = {}

    def run_pass(self) -> list[WatchEvent]:
        """One pass over every run."""
        out: list[WatchEvent] = []
        for run in run_dirs(self.root):
            w = self.runs.get(str(run))
            if w is None:
                w = self.runs[str(run)] = RunWatcher(run, self.opts, self.emit,
                                                     policy=self.policy)
            try:
                out += w.run_pass()
            except CkptError as e:
                ev = WatchEvent("error", str(run), problems=[str(e)])
                self.emit(ev)
                out.append(ev)
        return out

    def next_due(self) -> float | None:
        """The earliest time a checkpoint left settling by the last pass is due a look."""
        dues = [w.next_due for w in self.runs.values() if w.next_due is not None]
        return min(dues) if dues else None

    def loop(self, interval: float, passes: int | None = None,
             waker: Waker | None = None) -> Iterator[list[WatchEvent]]:
        """Passes every ``interval`` seconds (forever, or ``passes`` times).

        With a ``waker`` (:func:`make_waker`), a pass also runs as soon as it reports a change
        under the root, and once a checkpoint left settling is due; ``interval`` stays the
        longest wait between passes.
        """
        waker = waker or PollWaker()
        n = 0
        try:
            while passes is None or n < passes:
                started = time.monotonic()
                yield self.run_pass()
                n += 1
                if passes is not None and n >= passes:
                    break
                wait = max(0.0, interval - (time.monotonic() - started))
                due = self.next_due()
                if due is not None and waker.events:
                    wait = min(wait, max(0.0, due - time.time()))
                waker.wait(wait)
        finally:
            waker.close()
