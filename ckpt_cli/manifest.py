"""Integrity manifests: the size and checksum of every file of a checkpoint, kept with it.

Most checkpoint formats carry no checksum of their data (safetensors, DCP's ``.metadata``, JSON
state; torch zips have CRC-32 per record, which ``torch.load`` never checks). A manifest
records each file once, when the checkpoint is known to be good; verifying it later names
every file that changed (bit rot, a partial copy, a file replaced by an older one).

Where it lives: ``ckpt-manifest.json`` inside a checkpoint directory, or
``<name>.ckpt-manifest.json`` beside a single-file checkpoint. The format (JSON, UTF-8)::

    {"ckpt_manifest": 1, "algorithm": "xxh3_128", "created": "2026-01-02T03:04:05Z",
     "tool": "ckpt 0.1.0",
     "files": [{"path": "model.safetensors", "size": 1234, "digest": "<hex>"}, ...]}

``path`` is relative to the checkpoint directory, with ``/`` separators, sorted. The default
algorithm is xxh3_128 (xxhash: detects accidental change at memory speed, same digest as
``xxh128sum``); ``blake3`` and ``sha256`` are there when tampering, not just rot, is the
concern. Files are hashed in parallel threads, each streaming its file through a small buffer;
where there are fewer large files than threads, each has its bytes copied ahead of its
(sequential) digest by several more threads (:func:`ckpt_cli.storage.reads.read_ahead`).

Writers hash an existing checkpoint (:func:`write_manifest`: ``validate --write-manifest``)
or fill a :class:`Manifest` from :func:`new_hasher` while they write (``consolidate``).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import orjson
import xxhash

import ckpt_cli
from ckpt_cli import storage
from ckpt_cli.errors import CkptError, CorruptCheckpointError, UsageError
from ckpt_cli.formats.names import MANIFEST_NAME as MANIFEST_NAME
from ckpt_cli.formats.names import MANIFEST_SUFFIX as MANIFEST_SUFFIX
from ckpt_cli.formats.names import OWN_TEMP_MARKERS, TRASH_PREFIX
from ckpt_cli.formats.names import manifest_path as manifest_path
from ckpt_cli.model import Finding
from ckpt_cli.progress import Progress
from ckpt_cli.storage import open_regular, stages
from ckpt_cli.storage.atomic import check_destination
from ckpt_cli.storage.reads import (
    READ_AHEAD_MIN,
    Meter,
    default_jobs,
    read_ahead,
    run_parallel,
)

FORMAT_VERSION = 1
"""Value of the ``ckpt_manifest`` key; bumped only for incompatible changes."""
ALGORITHMS = ("xxh3_128", "blake3", "sha256")
"""Checksums a manifest may use."""
DEFAULT_ALGORITHM = "xxh3_128"
_DIGEST_HEX = {"xxh3_128": 32, "blake3": 64, "sha256": 64}
_MAX_READERS = 8  # threads copying one file ahead of its hasher (64-72 MiB of buffers)


class Hasher(Protocol):
    """What :func:`new_hasher` returns (hashlib-like)."""

    def update(self, data: bytes | memoryview, /) -> object:
        """Add bytes."""

    def hexdigest(self) -> str:
        """The digest so far, as lowercase hex."""


def new_hasher(algorithm: str = DEFAULT_ALGORITHM) -> Hasher:
    """A fresh incremental hasher for one of :data:`ALGORITHMS`.

    Args:
        algorithm: ``xxh3_128``, ``blake3`` or ``sha256``.

    Returns:
        An object with ``update(bytes)`` and ``hexdigest()``.

    Raises:
        UsageError: For an unknown algorithm, or ``blake3`` when the package is missing.
    """
    if algorithm == "xxh3_128":
        h: Hasher = xxhash.xxh3_128()
        return h
    if algorithm == "sha256":
        return hashlib.sha256()
    if algorithm == "blake3":
        try:
            import blake3  # lazy: the optional blake3 extra; missing is an error here
        except ImportError:
            raise UsageError("the blake3 checksum needs the blake3 package "
                             "(pip install 'ckpt-cli[blake3]')") from None
        b: Hasher = blake3.blake3()
        return b
    raise UsageError(f"unknown checksum {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")


@dataclass(frozen=True, slots=True)
class FileDigest:
    """One file of a manifest.

    Attributes:
        path: Relative to the checkpoint directory, ``/``-separated.
        size: Size in bytes.
        digest: Lowercase hex checksum.
    """

    path: str
    size: int
    digest: str


@dataclass(slots=True)
class Manifest:
    """The recorded state of a checkpoint's files.

    Attributes:
        algorithm: The checksum used (one of :data:`ALGORITHMS`).
        files: Entries by path.
        created: When it was made (ISO 8601, UTC), if recorded.
        tool: What made it (``ckpt 0.1.0``), if recorded.
        stamps: Each file's :func:`ckpt_cli.storage.file_stamp` when hashed for a ledger
            verdict, as its line records them (a line that differs spares no file its hash).
    """

    algorithm: str = DEFAULT_ALGORITHM
    files: dict[str, FileDigest] = field(default_factory=dict)
    created: str | None = None
    tool: str | None = None
    stamps: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def add(self, path: str, size: int, digest: str) -> None:
        """Record one file (a writer that hashed it while writing calls this)."""
        self.files[path] = FileDigest(path, size, digest)

    @property
    def total_bytes(self) -> int:
        """Bytes of all recorded files."""
        return sum(f.size for f in self.files.values())

    def to_json(self) -> bytes:
        """The manifest file's content."""
        version = ckpt_cli.__version__
        doc = {"ckpt_manifest": FORMAT_VERSION, "algorithm": self.algorithm,
               "created": self.created or _now(), "tool": self.tool or f"ckpt {version}",
               "files": [{"path": f.path, "size": f.size, "digest": f.digest}
                         for f in sorted(self.files.values(), key=lambda f: f.path)],
               **({"stamps": dict(sorted(self.stamps.items()))} if self.stamps else {})}
        return orjson.dumps(doc, option=orjson.OPT_INDENT_2) + b"\n"

    @classmethod
    def from_json(cls, data: bytes, *, source: Path) -> Manifest:
        """Parse and check a manifest file's content.

        Args:
            data: The file's bytes.
            source: Its path, for messages.

        Returns:
            The :class:`Manifest`.

        Raises:
            CorruptCheckpointError: Not JSON, not a ckpt manifest, a newer format version, an
                unknown algorithm, malformed entries, or paths that leave the checkpoint.
        """
        try:
            doc = orjson.loads(data)
        except orjson.JSONDecodeError as e:
            raise CorruptCheckpointError(f"manifest is not valid JSON ({e})",
                                         path=source) from None
        if not isinstance(doc, dict) or "ckpt_manifest" not in doc:
            raise CorruptCheckpointError("not a ckpt manifest (no ckpt_manifest key)",
                                         path=source)
        version = doc["ckpt_manifest"]
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise CorruptCheckpointError(f"bad manifest version {version!r}", path=source)
        if version > FORMAT_VERSION:
            raise CorruptCheckpointError(
                f"manifest format {version} is newer than this ckpt understands "
                f"({FORMAT_VERSION}); upgrade ckpt", path=source)
        algorithm = doc.get("algorithm")
        if algorithm not in ALGORITHMS:
            raise CorruptCheckpointError(f"unknown manifest checksum {algorithm!r}", path=source)
        entries = doc.get("files")
        if not isinstance(entries, list):
            raise CorruptCheckpointError("manifest has no files list", path=source)
        m = cls(algorithm, {}, _str_or_none(doc.get("created")), _str_or_none(doc.get("tool")))
        width = _DIGEST_HEX[algorithm]
        for entry in entries:
            rel, size, digest = _entry(entry, width, source)
            if rel in m.files:
                raise CorruptCheckpointError(f"manifest lists {rel!r} twice", path=source)
            m.add(rel, size, digest)
        stamps = doc.get("stamps", {})
        if not isinstance(stamps, dict) or not all(
                k in m.files and storage.is_stamp(v) for k, v in stamps.items()):
            raise CorruptCheckpointError("malformed manifest stamps", path=source)
        m.stamps = {k: tuple(v) for k, v in stamps.items()}
        return m


def _entry(e: Any, width: int, source: Path) -> tuple[str, int, str]:
    if not (isinstance(e, dict) and isinstance(e.get("path"), str)
            and isinstance(e.get("size"), int) and not isinstance(e.get("size"), bool)
            and e["size"] >= 0 and isinstance(e.get("digest"), str)
            and len(e["digest"]) == width and _is_hex(e["digest"])):
        raise CorruptCheckpointError(f"malformed manifest entry {str(e)[:120]}", path=source)
    if not _safe_rel(e["path"]):
        raise CorruptCheckpointError(
            f"manifest names {e['path']!r}, which is not a path inside the checkpoint",
            path=source)
    return e["path"], e["size"], e["digest"].lower()


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _str_or_none(v: Any) -> str | None:
    return v if isinstance(v, str) else None


def _is_hex(s: str) -> bool:
    return all(c in "0123456789abcdefABCDEF" for c in s)  # int(s, 16) takes " 0x1_f" too


def _safe_rel(rel: str) -> bool:
    if not rel or rel.startswith("/") or "\\" in rel or "\x00" in rel:
        return False
    parts = rel.split("/")
    return all(p not in ("", ".", "..") for p in parts)


@dataclass(frozen=True, slots=True)
class HashStats:
    """How much hashing was done, and how fast.

    Attributes:
        files: Files hashed.
        bytes: Bytes hashed.
        seconds: Wall time.
        threads: Threads used.
    """

    files: int
    bytes: int
    seconds: float
    threads: int

    @property
    def throughput(self) -> float:
        """Bytes per second (0 when nothing was timed)."""
        return self.bytes / self.seconds if self.seconds > 0 else 0.0


def manifest_digest(checkpoint: str | os.PathLike[str]) -> str | None:
    """SHA-256 (hex) of a checkpoint's manifest file as it is now, what a ledger line's
    ``manifest_digest`` records; None when it has none. Raises CkptError if it is unreadable."""
    data = storage.read_side(manifest_path(storage.locate(checkpoint)), "manifest")
    return None if data is None else hashlib.sha256(data).hexdigest()


def _base_and_files(checkpoint: Path) -> tuple[Path, list[str]]:
    """The directory manifest paths are relative to, and the checkpoint's files in it."""
    if not checkpoint.is_dir():
        return checkpoint.parent, [checkpoint.name]
    out: list[str] = []
    for dirpath, dirnames, filenames in storage.walk(checkpoint, onerror=_walk_error):
        dirnames[:] = sorted(d for d in dirnames if not _own_temp(d))
        rel_dir = Path(dirpath.relative_to(checkpoint).as_posix())
        for name in filenames:
            if name == MANIFEST_NAME and rel_dir == Path("."):
                continue
            if _own_temp(name):
                continue
            try:
                if not stat.S_ISREG((dirpath / name).stat().st_mode):
                    continue  # FIFOs, devices, dangling links: not checkpoint data
            except OSError:
                continue
            out.append((rel_dir / name).as_posix())
    return checkpoint, sorted(out)


def _own_temp(name: str) -> bool:
    """ckpt's own temporary and trash names (a split job's staging too): never checkpoint data."""
    return name.startswith(TRASH_PREFIX) or any(m in name for m in OWN_TEMP_MARKERS)


def _walk_error(e: OSError) -> None:
    raise CkptError(f"cannot list: {e.strerror}", path=e.filename)


def checkpoint_files(checkpoint: Path) -> list[str]:
    """The files a manifest of ``checkpoint`` covers, relative and sorted.

    A directory: every regular file below it (symlinks to files followed), except the
    manifest itself and ckpt's own temporary files. A file: just that file.

    Args:
        checkpoint: A checkpoint directory or file.

    Returns:
        Relative ``/``-separated paths.

    Raises:
        CkptError: If the directory cannot be listed.
    """
    return _base_and_files(storage.locate(checkpoint))[1]


def hash_files(base: Path, rels: list[str], *, algorithm: str = DEFAULT_ALGORITHM,
               jobs: int | None = None, on_progress: Progress | None = None,
               ) -> tuple[dict[str, FileDigest], HashStats]:
    """Hash files in parallel threads (one file per task, largest first; a file of
    :data:`~ckpt_cli.storage.reads.READ_AHEAD_MIN` or more, where there are fewer such files
    than threads, is read ahead of its hasher by several more threads).

    Args:
        base: The directory ``rels`` are relative to.
        rels: The files.
        algorithm: One of :data:`ALGORITHMS`.
        jobs: Threads (default: the usable CPUs, at most 8).
        on_progress: Progress callback (label ``hashing``).

    Returns:
        ``(digests by path, stats)``.

    Raises:
        CkptError: A file cannot be opened or read, or shrinks while it is read.
        UsageError: Unknown algorithm.
    """
    new_hasher(algorithm)  # fail on a bad name before starting threads
    sizes = {rel: _size(base / rel) for rel in rels}
    order = sorted(rels, key=lambda r: -sizes[r])
    threads = jobs or default_jobs()
    # A digest is sequential: one thread per file. Where there are fewer large files than
    # threads, each large file gets threads // large (at most 8) readers copying its bytes
    # ahead of its hasher, with (readers + 1) x 8 MiB of buffers.
    large = sum(1 for r in rels if sizes[r] >= READ_AHEAD_MIN)
    readers = min(_MAX_READERS, threads // min(threads, large)) if large else 1

    def job(rel: str) -> Callable[[Meter], FileDigest]:
        def run(meter: Meter) -> FileDigest:
            path = base / rel
            h = new_hasher(algorithm)
            try:
                fd = open_regular(path)
            except OSError as e:
                raise CkptError(f"cannot read: {e.strerror}", path=path) from None
            try:
                size = storage.size_of(fd)
                ahead = readers if size >= READ_AHEAD_MIN else 1
                # Closed before the descriptor is: its reader threads stop first.
                with contextlib.closing(read_ahead(fd, 0, size, readers=ahead, meter=meter,
                                                   path=path)) as views:
                    for view in views:
                        with stages.stage("hash", len(view)):
                            h.update(view)
            finally:
                storage.close(fd)
            return FileDigest(rel, size, h.hexdigest())
        return run

    t0 = time.perf_counter()
    results = run_parallel([job(r) for r in order], threads=threads,
                           total=sum(sizes.values()), label="hashing", on_progress=on_progress)
    seconds = time.perf_counter() - t0
    digests = {d.path: d for d in results}
    return digests, HashStats(len(results), sum(d.size for d in results), seconds,
                              min(threads, max(1, len(order))))


HashFn = Callable[[Path, list[str]], tuple[dict[str, FileDigest], HashStats]]
"""Hashes files: ``(base, rels) -> (digests by path, stats)``, like :func:`hash_files`. A
split validation (``--part``) passes one that hashes only its own files, or that takes the
other parts' digests from their receipts; the digests it leaves out are not checked."""


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError as e:
        raise CkptError(f"cannot read: {e.strerror}", path=path) from None


def compute_manifest(checkpoint: Path, *, algorithm: str = DEFAULT_ALGORITHM,
                     jobs: int | None = None, on_progress: Progress | None = None,
                     hasher: HashFn | None = None) -> tuple[Manifest, HashStats]:
    """Hash every file of a checkpoint into a :class:`Manifest` (nothing is written).

    Args:
        checkpoint: A checkpoint directory or file.
        algorithm: One of :data:`ALGORITHMS`.
        jobs: Threads.
        on_progress: Progress callback.
        hasher: Hash with this instead of :func:`hash_files` (see :data:`HashFn`).

    Returns:
        ``(manifest, stats)``.

    Raises:
        CkptError: Unreadable files.
        UsageError: Unknown algorithm.
    """
    base, rels = _base_and_files(storage.locate(checkpoint))
    if hasher is not None:
        digests, stats = hasher(base, rels)
    else:
        digests, stats = hash_files(base, rels, algorithm=algorithm, jobs=jobs,
                                    on_progress=on_progress)
    return Manifest(algorithm, digests), stats


def write_manifest(checkpoint: Path, *, algorithm: str = DEFAULT_ALGORITHM,
                   jobs: int | None = None, on_progress: Progress | None = None,
                   manifest: Manifest | None = None) -> tuple[Path, Manifest, HashStats | None]:
    """Hash a checkpoint's files and write its manifest atomically (replacing an old one).

    Args:
        checkpoint: A checkpoint directory or file.
        algorithm: One of :data:`ALGORITHMS` (ignored when ``manifest`` is given).
        jobs: Threads.
        on_progress: Progress callback.
        manifest: Write this one instead of hashing (its digests were computed already).

    Returns:
        ``(manifest file, manifest, stats or None when nothing was hashed)``.

    Raises:
        CkptError: Unreadable files, or the manifest cannot be written.
        UsageError: Unknown algorithm.
    """
    stats: HashStats | None = None
    # Decided (and checked: no link, FIFO, read-only directory) before hashing: decided after,
    # a directory deleted meanwhile (a concurrent prune) would get a sibling file's manifest.
    check_destination(dest := manifest_path(storage.locate(checkpoint)), overwrite=True)
    if manifest is None:
        manifest, stats = compute_manifest(checkpoint, algorithm=algorithm, jobs=jobs,
                                           on_progress=on_progress)
    try:
        storage.write_whole(dest, manifest.to_json())  # temp + rename, or one PUT
    except OSError as e:
        raise CkptError(f"cannot write the manifest: {e.strerror}", path=dest) from None
    return dest, manifest, stats


def read_manifest(checkpoint: Path) -> Manifest | None:
    """The manifest of a checkpoint, or None if it has none.

    Args:
        checkpoint: A checkpoint directory or file.

    Returns:
        The parsed manifest.

    Raises:
        CorruptCheckpointError: The manifest exists but is malformed.
        CkptError: It cannot be read.
    """
    path = manifest_path(storage.locate(checkpoint))
    data = storage.read_side(path, "manifest")  # regular files only, at most 64 MiB
    return None if data is None else Manifest.from_json(data, source=path)


@dataclass(slots=True)
class Verification:
    """The result of checking a checkpoint against its manifest.

    Attributes:
        path: The manifest file.
        manifest: The manifest read.
        changed: Files whose content differs (same size, different checksum).
        resized: ``(path, recorded size, actual size)`` of files whose size differs.
        missing: Files the manifest lists that are gone.
        extra: Files present that the manifest does not list (added after it was written).
        actual: Digests computed now, by path (those hashed).
        stats: Hashing statistics.
    """

    path: Path
    manifest: Manifest
    changed: list[str] = field(default_factory=list)
    resized: list[tuple[str, int, int]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)
    actual: dict[str, FileDigest] = field(default_factory=dict)
    stats: HashStats = field(default_factory=lambda: HashStats(0, 0, 0.0, 1))

    @property
    def ok(self) -> bool:
        """Whether every recorded file is present and unchanged, and nothing was added."""
        return not (self.changed or self.resized or self.missing or self.extra)

    def findings(self, name: str) -> list[Finding]:
        """One finding per discrepancy.

        Args:
            name: How to call the manifest in messages (its path relative to the checkpoint).

        Returns:
            Errors for changed, resized and missing files; warnings for extra files.
        """
        algo = self.manifest.algorithm
        # The manifest is named in the message, not as a location: a location is a place
        # inside the file, and "shard.safetensors:ckpt-manifest.json" read like one.
        out = [Finding("error", "manifest-changed",
                       f"content differs from {name} ({algo} checksum changed; same size): "
                       "bit rot, or the file was rewritten", rel, None)
               for rel in self.changed]
        out += [Finding("error", "manifest-size",
                        f"is {actual:,} bytes but {name} recorded {want:,} "
                        f"({'truncated or a partial copy' if actual < want else 'grew'})",
                        rel, None)
                for rel, want, actual in self.resized]
        out += [Finding("error", "manifest-missing",
                        f"listed in {name} but missing", rel, None) for rel in self.missing]
        out += [Finding("warning", "manifest-extra",
                        f"not in {name} (added after it was written)", rel, None)
                for rel in self.extra]
        return out


def verify_manifest(checkpoint: Path, *, jobs: int | None = None,
                    on_progress: Progress | None = None,
                    manifest: Manifest | None = None,
                    hasher: HashFn | None = None) -> Verification | None:
    """Check a checkpoint's files against its manifest.

    Files whose size already differs are not hashed.

    Args:
        checkpoint: A checkpoint directory or file.
        jobs: Threads.
        on_progress: Progress callback.
        manifest: Use this manifest instead of reading the checkpoint's.
        hasher: Hash with this instead of :func:`hash_files` (with the manifest's checksum;
            files it returns no digest for are not compared).

    Returns:
        The :class:`Verification`, or None if there is no manifest.

    Raises:
        CorruptCheckpointError: The manifest is malformed.
        CkptError: Files cannot be read.
    """
    checkpoint = storage.locate(checkpoint)
    m = manifest or read_manifest(checkpoint)
    if m is None:
        return None
    base, present = _base_and_files(checkpoint)
    result = Verification(manifest_path(checkpoint), m)
    present_set = set(present)
    to_hash: list[str] = []
    for rel, entry in sorted(m.files.items()):
        if rel not in present_set:
            result.missing.append(rel)
            continue
        try:
            size = (base / rel).stat().st_size
        except OSError:
            result.missing.append(rel)  # removed while we were listing
            continue
        if size != entry.size:
            result.resized.append((rel, entry.size, size))
        else:
            to_hash.append(rel)
    result.extra = sorted(present_set - set(m.files))
    if hasher is not None:
        digests, result.stats = hasher(base, to_hash)
    else:
        digests, result.stats = hash_files(base, to_hash, algorithm=m.algorithm, jobs=jobs,
                                           on_progress=on_progress)
    result.actual = digests
    for rel in to_hash:
        got = digests.get(rel)
        if got is None:  # another part's file (--part): that part compares it
            continue
        if got.size != m.files[rel].size:  # changed between stat and read
            result.resized.append((rel, m.files[rel].size, got.size))
        elif got.digest != m.files[rel].digest:
            result.changed.append(rel)
    return result
