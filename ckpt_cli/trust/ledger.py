"""The run ledger: what ckpt verified about each checkpoint of a run, one JSON line each.

``ckpt-ledger.jsonl`` sits at the root of a run directory (or object-store prefix). Every time a
checkpoint is verified (``ckpt watch``, the training callbacks) or rewritten (thinning), one
line is appended: which checkpoint, its step, when, the verdict, its bytes and the digest of the
manifest written for it. The newest line about a checkpoint is what holds; retention and
resumption trust a checkpoint only when that line says ``good`` and its manifest still matches.

The file is the only state of the watcher, so it must survive crashes: a line is written with one
``write`` on a descriptor opened ``O_APPEND`` and fsynced, under an advisory lock so that two
writers (a watcher and a cron prune) never interleave. A line torn by a crash is skipped when read
(and counted), never trusted. On object storage an object cannot be appended to; the whole object
is rewritten with one PUT (it appears whole or not at all) - one writer per run is assumed there.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from ckpt_cli import storage
from ckpt_cli.errors import CkptError, DestinationError
from ckpt_cli.formats import first_error
from ckpt_cli.formats.dcp import metadata_file
from ckpt_cli.formats.names import is_last_copy
from ckpt_cli.manifest import (
    HashStats,
    checkpoint_files,
    hash_files,
    read_manifest,
    verify_manifest,
)
from ckpt_cli.manifest import manifest_digest as manifest_digest
from ckpt_cli.model import CheckpointIndex
from ckpt_cli.storage.atomic import open_append
from ckpt_cli.trust.thinning.base import lone_torch_file, thinned_line

Stamp = tuple[int, ...]
"""A file as verified: ``(size, mtime_ns, inode, change)`` (:func:`ckpt_cli.storage.file_stamp`);
lines of older ledgers hold the first three only."""

LEDGER_NAME = "ckpt-ledger.jsonl"
SCHEMA_VERSION = 1

GOOD = "good"
BAD = "bad"
VERDICTS = (GOOD, BAD)

VERIFIED = "verified"
THINNED = "thinned"
EVENTS = (VERIFIED, THINNED)


@dataclass(frozen=True)
class LedgerEntry:
    """One line of the ledger.

    Args:
        path: The checkpoint's name relative to the run root (POSIX separators).
        step: Its training step, where known.
        time: When the line was written (Unix seconds).
        event: ``verified`` (validated as it landed, or again) or ``thinned`` (rewritten without
            optimizer state; ``detail`` says what was dropped).
        verdict: ``good`` or ``bad``.
        bytes: The checkpoint's size in bytes when the line was written.
        manifest_digest: SHA-256 (hex) of the checkpoint's ``ckpt-manifest.json`` as written
            with this verdict, or None when no manifest was written.
        problems: For a bad verdict, the first findings, one line each.
        detail: Event-specific facts (thinning: ``dropped``, ``dtype``, ``bytes_before``).
        files: What its files were when verified: ``{name: (size, mtime_ns, inode, change)}``
            (:func:`ckpt_cli.storage.file_stamp`: the inode-change time locally, the version
            id or ETag on object storage; in JSON the change field is a ``change`` map beside
            the 3-integer ``files``, which older ckpt versions read), names relative to the
            checkpoint (the manifest and
            ckpt's temporaries left out); empty where not recorded (older ledgers, bad and
            thinned lines). A file whose stamp differs, or a line of an older ledger without
            the change field, is hashed against the manifest again before the verdict holds.
        committed: When the verified save was committed (Unix seconds: the newest
            modification time of its files then), or None. A file only touched since keeps
            it; a new save under the same name gets a new one. :func:`abandoned` orders saves
            by it.
    """

    path: str
    step: int | None
    time: float
    event: str
    verdict: str
    bytes: int
    manifest_digest: str | None = None
    problems: tuple[str, ...] = ()
    detail: Mapping[str, Any] = field(default_factory=dict)
    files: Mapping[str, Stamp] = field(default_factory=dict)
    committed: float | None = None

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, not {self.verdict!r}")
        if self.event not in EVENTS:
            raise ValueError(f"event must be one of {EVENTS}, not {self.event!r}")
        if not self.path:
            raise ValueError("path must name a checkpoint of the run")

    @property
    def good(self) -> bool:
        """Whether this line trusts the checkpoint."""
        return self.verdict == GOOD

    def to_json(self) -> dict[str, Any]:
        """The line as a JSON object (``schema_version`` included)."""
        return {
            "schema_version": SCHEMA_VERSION,
            "path": self.path,
            "step": self.step,
            "time": self.time,
            "event": self.event,
            "verdict": self.verdict,
            "bytes": self.bytes,
            "manifest_digest": self.manifest_digest,
            "problems": list(self.problems),
            "detail": dict(self.detail),
            # (size, mtime_ns, inode) as every ledger has held them, so an older ckpt still
            # reads the line; the change field beside them, which an older ckpt ignores.
            "files": {k: list(v[:3]) for k, v in sorted(self.files.items())},
            "change": {k: v[3] for k, v in sorted(self.files.items()) if len(v) > 3},
            "committed": self.committed,
        }

    @classmethod
    def from_json(cls, doc: Any) -> LedgerEntry:
        """Parse one line's object.

        Raises:
            ValueError: If a field is missing or of the wrong type.
        """
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
        step = doc.get("step")
        digest = doc.get("manifest_digest")
        problems = doc.get("problems", [])
        detail = doc.get("detail", {})
        files = doc.get("files") or {}
        change = doc.get("change") or {}
        committed = doc.get("committed")
        ok = (
            isinstance(doc.get("path"), str)
            and (step is None or (isinstance(step, int) and not isinstance(step, bool)))
            and isinstance(doc.get("time"), int | float)
            and isinstance(doc.get("event"), str)
            and isinstance(doc.get("verdict"), str)
            and isinstance(doc.get("bytes"), int)
            and (digest is None or isinstance(digest, str))
            and isinstance(problems, list) and all(isinstance(p, str) for p in problems)
            and isinstance(detail, dict)
            and isinstance(files, dict) and all(storage.is_stamp(v) for v in files.values())
            and isinstance(change, dict) and all(k in files and storage.is_int64(v)
                                                 for k, v in change.items())
            and (committed is None or (isinstance(committed, int | float)
                                       and not isinstance(committed, bool)))
        )
        if not ok:
            raise ValueError("a field is missing or has the wrong type")
        return cls(path=doc["path"], step=step, time=float(doc["time"]), event=doc["event"],
                   verdict=doc["verdict"], bytes=doc["bytes"], manifest_digest=digest,
                   problems=tuple(problems), detail=detail,
                   files={str(k): (*v[:3], change[k]) if k in change else tuple(v)
                          for k, v in files.items()},
                   committed=float(committed) if committed is not None else None)


def is_child_name(path: str) -> bool:
    """Whether a ledger line's ``path`` names a direct child of the run (no ``/``, not ``.``
    or ``..``): the only paths a ledger line may name. Anything else (a nested path, which can
    go through a symbolic link out of the run, or the run itself) is ignored when read."""
    return bool(path) and "/" not in path and "\\" not in path and "\x00" not in path and (
        path not in (".", ".."))


@dataclass(frozen=True)
class Ledger:
    """What a ledger file holds.

    Args:
        entries: Every readable line, in file order.
        skipped: How many lines could not be read (torn by a crash, or edited by hand).
        ignored: The paths of lines ignored because they name no direct child of the run
            (see :func:`is_child_name`), each once, in file order.
    """

    entries: tuple[LedgerEntry, ...]
    skipped: int = 0
    ignored: tuple[str, ...] = ()

    def latest(self) -> dict[str, LedgerEntry]:
        """The newest line per checkpoint path (later lines win)."""
        out: dict[str, LedgerEntry] = {}
        for e in self.entries:
            out[e.path] = e
        return out

    def verdict_of(self, path: str) -> LedgerEntry | None:
        """The newest line about ``path``, or None when the ledger never mentions it."""
        return self.latest().get(path)


def ledger_path(run_dir: str | os.PathLike[str]) -> Path:
    """Where the ledger of ``run_dir`` lives (local path or object-store URL)."""
    return storage.locate(run_dir) / LEDGER_NAME


def parse(data: bytes) -> Ledger:
    """Parse a ledger's bytes; unreadable lines are counted, not trusted."""
    entries: list[LedgerEntry] = []
    skipped = 0
    ignored: dict[str, None] = {}
    for raw in data.split(b"\n"):
        if not raw.strip():
            continue
        try:
            entry = LedgerEntry.from_json(orjson.loads(raw))
        except (orjson.JSONDecodeError, ValueError):
            skipped += 1
            continue
        if is_child_name(entry.path):
            entries.append(entry)
        else:
            ignored[entry.path] = None
    return Ledger(tuple(entries), skipped, tuple(ignored))


def read_ledger(run_dir: str | os.PathLike[str]) -> Ledger | None:
    """The ledger of ``run_dir``, or None when it has none.

    Raises:
        CkptError: If the ledger exists but cannot be read (not a regular file, permissions).
    """
    path = ledger_path(run_dir)
    # Regular files only (a FIFO would block), no symbolic link, at most 64 MiB.
    data = storage.read_side(path, "ledger", follow_symlinks=False)
    return None if data is None else parse(data)


def append(run_dir: str | os.PathLike[str], entries: LedgerEntry | Iterable[LedgerEntry]) -> None:
    """Append lines to the ledger of ``run_dir`` durably (created when missing).

    Raises:
        CkptError: If the ledger cannot be written.
    """
    batch = [entries] if isinstance(entries, LedgerEntry) else list(entries)
    if not batch:
        return
    for e in batch:
        if not is_child_name(e.path):
            raise ValueError(f"a ledger line names a checkpoint directly in the run, not "
                             f"{e.path!r}")
    data = b"".join(orjson.dumps(e.to_json(), option=orjson.OPT_SORT_KEYS) + b"\n"
                    for e in batch)
    path = ledger_path(run_dir)
    if not storage.has_file_system(path):  # no O_APPEND: the object is rewritten
        _append_object(path, data)
        return
    try:  # through the one door out: never through a link, nor onto a FIFO or device
        fd = open_append(path)
    except OSError as e:
        raise CkptError(f"cannot write the run ledger: {e.strerror or e}", path=path) from e
    except DestinationError as e:
        raise CkptError(f"the run ledger {e.message}", path=path) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            size = os.fstat(fd).st_size
            # A crash may have left a torn last line: start ours on a line of its own.
            if size and os.pread(fd, 1, size - 1) != b"\n":
                data = b"\n" + data
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    except OSError as e:
        raise CkptError(f"cannot write the run ledger: {e.strerror or e}", path=path) from e
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _append_object(path: Path, data: bytes) -> None:
    try:
        old = storage.read_side(path, "ledger") or b""
        if old and not old.endswith(b"\n"):
            old += b"\n"
        path.write_bytes(old + data)
    except OSError as e:
        raise CkptError(f"cannot write the run ledger: {e}", path=path) from e


def stamp(checkpoint: Path) -> dict[str, Stamp]:
    """The stamp of each file of a checkpoint (the files its manifest covers), by name
    relative to the checkpoint (:func:`ckpt_cli.storage.file_stamp`); empty when it is gone.

    Raises:
        CkptError: If the checkpoint cannot be listed.
    """
    if not checkpoint.exists():
        return {}
    base = checkpoint if checkpoint.is_dir() else checkpoint.parent
    out: dict[str, Stamp] = {}
    for rel in checkpoint_files(checkpoint):
        with contextlib.suppress(OSError):  # removed since the listing: not part of it now
            out[rel] = storage.file_stamp(base / rel)
    return out


def committed_at(stamps: Mapping[str, Stamp]) -> float | None:
    """When a save was committed: the newest modification time of its files (None: none)."""
    return max(v[1] for v in stamps.values()) / 1e9 if stamps else None


def changed_files(line: LedgerEntry, now: Mapping[str, Stamp]) -> set[str]:
    """The files whose stamp is not what ``line`` recorded (added ones included, and every
    file of a line recorded without the change field); for a line that recorded none, the
    files modified, or locally whose inode changed, after it was written."""
    if line.files:
        return {rel for rel, st in now.items() if line.files.get(rel) != st}
    after = int(line.time * 1e9)
    # The inode-change time (locally: a non-zero inode) catches a modification time set back.
    return {rel for rel, st in now.items()
            if st[1] > after or (len(st) > 3 and st[2] != 0 and st[3] > after)}


def commit_marker(path: Path) -> str | None:
    """The file a save of this checkpoint writes last, relative to it: a single file itself,
    DCP's ``.metadata``, HF Trainer's ``trainer_state.json``, a step directory's one torch
    file; None when the layout has none."""
    if not path.is_dir():
        return path.name

    meta = metadata_file(path)
    if meta is not None:
        return meta.name
    if (path / "trainer_state.json").is_file():
        return "trainer_state.json"

    lone = lone_torch_file(path)
    return lone.name if lone is not None else None


def saved_again(path: Path, line: LedgerEntry, now: Mapping[str, Stamp]) -> bool:
    """Whether the checkpoint was committed again after ``line`` (a new save under the same
    name, as a run resumed from an earlier step writes): its commit marker is not the file
    verified (its stat differs from the record, or where none was recorded it was modified
    after the verdict) and its bytes are not the ones the manifest recorded. Damage to a data
    file leaves the marker alone, and a copy keeps its bytes; a layout without a marker, and a
    single file without checksums of its own (safetensors), never count as saved again.
    """
    marker = commit_marker(path)
    cur = now.get(marker) if marker is not None else None
    if marker is None or cur is None:
        return False
    if not path.is_dir() and not _checksummed(path):
        # A single file is its own marker: without checksums of its own (safetensors, a
        # legacy pickle) a new save cannot be told from damage, so it counts as damage.
        return False
    if (line.files.get(marker) == cur) if line.files else cur[1] <= int(line.time * 1e9):
        return False
    try:
        m = read_manifest(path)
        if m is None or marker not in m.files:
            return True
        base = path if path.is_dir() else path.parent
        digests, _ = hash_files(base, [marker], algorithm=m.algorithm)
    except CkptError:
        return False
    got = digests.get(marker)
    return got is None or got.digest != m.files[marker].digest


def _checksummed(path: Path) -> bool:
    """Whether a single-file checkpoint carries checksums of its own (a torch zip: CRC-32 per
    record), which a fresh verification with CRC checks."""
    try:
        h = storage.open_regular(path)  # never blocks on a FIFO swapped in
    except (OSError, CkptError):
        return False
    try:
        return storage.pread(h, 4, 0) == b"PK\x03\x04"
    except (OSError, CkptError):
        return False
    finally:
        storage.close(h)


@dataclass(frozen=True, slots=True)
class Recheck:
    """What re-checking a trusted checkpoint found.

    Attributes:
        problems: Why it is no longer what was verified ([] when it still is).
        hashed: Files hashed against the manifest (those whose stamp changed, or all).
        witnessed: Whether the line's file record is the one its manifest was written with
            (False for a line forged or edited after the verdict, which then spares no file
            its hash; True where the manifest records none to compare).
        index: The checkpoint's index as :func:`recheck_trusted` read it (None otherwise).
    """

    problems: list[str]
    hashed: int = 0
    witnessed: bool = True
    index: CheckpointIndex | None = None


def recheck(path: Path, line: LedgerEntry, *, full: bool,
            now: Mapping[str, Stamp] | None = None) -> Recheck:
    """Re-check a checkpoint the ledger trusts against what was verified.

    Its manifest must be the one recorded (SHA-256), every file it lists there with its size,
    nothing added. Files whose stamp (size, modification time, inode, and the inode-change
    time or object version that no user call restores) differs from what the verdict
    recorded are hashed against the manifest; with ``full``, every file is, and so is every
    file when the line's record is not the one the manifest was written with (a line forged
    over a manifest put back: ``touch -r`` restores a modification time, and a forged line
    can copy the file's new stamp, but not into the manifest its digest names).

    Args:
        path: The checkpoint.
        line: Its newest (good) ledger line.
        full: Hash every file.
        now: Its files' stamps as :func:`stamp` gives them, when the caller has them.
    """
    if not path.exists():
        return Recheck(["gone"])
    try:
        if manifest_digest(path) != line.manifest_digest:
            return Recheck(["its manifest is not the one written when it was verified"])
        m = read_manifest(path)
        if m is None:
            return Recheck(["its manifest is missing"])
        witnessed = not (m.stamps and line.files) or m.stamps == dict(line.files)
        if full or not witnessed:
            v = verify_manifest(path, manifest=m)
        else:
            changed = changed_files(line, stamp(path) if now is None else now)

            def hasher(base: Path, rels: list[str]) -> tuple[dict[str, Any], HashStats]:
                pick = [r for r in rels if r in changed]
                if not pick:
                    return {}, HashStats(0, 0, 0.0, 1)
                return hash_files(base, pick, algorithm=m.algorithm)

            v = verify_manifest(path, manifest=m, hasher=hasher)
    except CkptError as e:
        return Recheck([str(e)])
    if v is None:
        return Recheck(["its manifest is missing"])
    problems = [f"{f.file}: {f.message}" for f in v.findings("the manifest")
                if f.severity == "error"][:5]
    if problems and not witnessed:
        problems[0] += (" (its ledger line does not record the files its manifest was "
                        "written with: forged or edited after the verdict)")
    return Recheck(problems, v.stats.files, witnessed)


def recheck_good(path: Path, line: LedgerEntry, *, full: bool,
                 now: Mapping[str, Stamp] | None = None) -> list[str]:
    """Why a checkpoint the ledger trusts is no longer what was verified ([] when it still
    is): :func:`recheck`'s problems."""
    return recheck(path, line, full=full, now=now).problems


def recheck_trusted(path: Path, line: LedgerEntry, *, full: bool,
                     now: Mapping[str, Stamp] | None = None) -> Recheck:
    """Every check a good ledger line must pass before anything trusts it (``resume-path``
    and ``ckpt watch`` alike): :func:`recheck`, then the index read through the allowlist
    (a forged line cannot send training into a hostile pickle, nor keep a watcher quiet
    about one). Metadata only beyond the hashes :func:`recheck` needs.
    """
    r = recheck(path, line, full=full, now=now)
    if r.problems:
        return r
    index, why = first_error(path)
    return Recheck([f"does not read cleanly: {why}"] if why else [], r.hashed, r.witnessed,
                   index)


def abandoned(book: Ledger) -> dict[str, LedgerEntry]:
    """The checkpoints of an abandoned timeline, each with the later save that abandoned it.

    A run resumed from an earlier step saves its steps again: a checkpoint of a lower step
    committed after one of a higher step means training went back to before the latter, so the
    higher one belongs to the timeline that was left. Told from the ``committed`` times the
    verdicts recorded; lines without one, ``last.ckpt``-style copies and checkpoints ever
    thinned (a rewrite, not a save) take no part.
    """
    thinned = {e.path for e in book.entries if e.event == THINNED}
    known = sorted((e for e in book.latest().values() if e.event == VERIFIED
                    and e.step is not None and e.committed is not None
                    and not is_last_copy(e.path) and e.path not in thinned),
                   key=lambda e: e.step or 0)
    out: dict[str, LedgerEntry] = {}
    newest: LedgerEntry | None = None  # the latest commit among lower steps
    i = 0
    while i < len(known):
        j = i
        while j < len(known) and known[j].step == known[i].step:
            j += 1
        group = known[i:j]
        if newest is not None:
            for e in group:
                if (e.committed or 0.0) < (newest.committed or 0.0):
                    out[e.path] = newest
        for e in group:
            if newest is None or (e.committed or 0.0) > (newest.committed or 0.0):
                newest = e
        i = j
    return out


def thinned_on_purpose(path: Path) -> bool:
    """Whether the run ledger beside a checkpoint records that ``prune --thin-after`` thinned
    it: its newest ``thinned`` line confirms a thinning (neither the intent nor the record of
    one not carried out, :func:`ckpt_cli.trust.thinning.thinned_line`)."""
    try:
        book = read_ledger(storage.locate(path).parent)
    except CkptError:
        return False
    newest = next((e for e in reversed(book.entries) if e.path == path.name
                   and e.event == THINNED), None) if book is not None else None
    return newest is not None and thinned_line(newest)


def links_in(path: Path) -> list[str]:
    """The symbolic links a checkpoint is (or holds), by name; local paths only."""
    if not storage.has_file_system(path):
        return []
    if path.is_symlink():
        return [path.name]
    if not path.is_dir():
        return []
    out: list[str] = []
    for dirpath, dirs, files in os.walk(path):
        out.extend(os.path.relpath(os.path.join(dirpath, n), path) for n in [*dirs, *files]
                   if os.path.islink(os.path.join(dirpath, n)))
    return out
