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
from ckpt_cli.errors import CkptError

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

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, not {self.verdict!r}")
        if self.event not in EVENTS:
            raise ValueError(f"event must be one of {EVENTS}, not {self.event!r}")
        if not self.path or self.path.startswith("/") or ".." in self.path.split("/"):
            raise ValueError(f"path must be relative to the run root: {self.path!r}")

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
        )
        if not ok:
            raise ValueError("a field is missing or has the wrong type")
        return cls(path=doc["path"], step=step, time=float(doc["time"]), event=doc["event"],
                   verdict=doc["verdict"], bytes=doc["bytes"], manifest_digest=digest,
                   problems=tuple(problems), detail=detail)


@dataclass(frozen=True)
class Ledger:
    """What a ledger file holds.

    Args:
        entries: Every readable line, in file order.
        skipped: How many lines could not be read (torn by a crash, or edited by hand).
    """

    entries: tuple[LedgerEntry, ...]
    skipped: int = 0

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
    for raw in data.split(b"\n"):
        if not raw.strip():
            continue
        try:
            entries.append(LedgerEntry.from_json(orjson.loads(raw)))
        except (orjson.JSONDecodeError, ValueError):
            skipped += 1
    return Ledger(tuple(entries), skipped)


def read_ledger(run_dir: str | os.PathLike[str]) -> Ledger | None:
    """The ledger of ``run_dir``, or None when it has none.

    Raises:
        CkptError: If the ledger exists but cannot be read (not a regular file, permissions).
    """
    path = ledger_path(run_dir)
    # Regular files only (a FIFO would block), no symbolic link, at most 64 MiB.
    data = storage.read_side(path, "ledger", follow_symlinks=False)
    return None if data is None else parse(data)


def _is_regular(fd: int) -> bool:
    import stat

    return stat.S_ISREG(os.fstat(fd).st_mode)


def append(run_dir: str | os.PathLike[str], entries: LedgerEntry | Iterable[LedgerEntry]) -> None:
    """Append lines to the ledger of ``run_dir`` durably (created when missing).

    Raises:
        CkptError: If the ledger cannot be written.
    """
    batch = [entries] if isinstance(entries, LedgerEntry) else list(entries)
    if not batch:
        return
    data = b"".join(orjson.dumps(e.to_json(), option=orjson.OPT_SORT_KEYS) + b"\n"
                    for e in batch)
    path = ledger_path(run_dir)
    if not storage.has_file_system(path):  # no O_APPEND: the object is rewritten
        _append_object(path, data)
        return
    flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        raise CkptError(f"cannot write the run ledger: {e.strerror or e}", path=path) from e
    try:
        if not _is_regular(fd):
            raise CkptError("the run ledger is not a regular file", path=path)
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


def manifest_digest(checkpoint: str | os.PathLike[str]) -> str | None:
    """SHA-256 (hex) of a checkpoint's manifest file as it is now, or None when it has none.

    This is what a ledger line's ``manifest_digest`` records: a later reader compares it with
    the file to learn that the manifest is still the one written with the verdict.

    Raises:
        CkptError: If the manifest exists but cannot be read.
    """
    import hashlib

    from ckpt_cli.manifest import manifest_path

    path = manifest_path(storage.locate(checkpoint))
    data = storage.read_side(path, "manifest")
    return None if data is None else hashlib.sha256(data).hexdigest()


def recheck_good(path: Path, line: LedgerEntry, *, full: bool) -> list[str]:
    """Why a checkpoint the ledger trusts is no longer what was verified ([] when it still is).

    Sizes (and, with ``full``, hashes) are compared with its manifest, and the manifest with
    the digest the ledger recorded.
    """
    from ckpt_cli.manifest import HashStats, verify_manifest

    if not path.exists():
        return ["gone"]
    try:
        if manifest_digest(path) != line.manifest_digest:
            return ["its manifest is not the one written when it was verified"]
        if full:
            v = verify_manifest(path)
        else:
            v = verify_manifest(path, hasher=lambda base, rels: ({}, HashStats(0, 0, 0.0, 1)))
    except CkptError as e:
        return [str(e)]
    if v is None:
        return ["its manifest is missing"]
    return [f"{f.file}: {f.message}" for f in v.findings("manifest")
            if f.severity == "error"][:5]


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
