"""The quick completeness check: a checkpoint's format and whether it looks complete, from
marker files, headers and zip end records only (never tensor data).

``runs`` (listings, prune, watch) and ``validate --latest`` ask this per checkpoint; the readers
in this package answer the full question when a checkpoint is opened.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import NamedTuple

from ckpt_cli import storage
from ckpt_cli.errors import CkptError
from ckpt_cli.formats import dcp, deepspeed, megatron, safetensors, torchfile
from ckpt_cli.formats.names import FILE_EXTENSIONS, in_progress_reason
from ckpt_cli.storage import Handle, open_regular


class Probe(NamedTuple):
    """What :func:`quick_status` found (a named 3-tuple)."""

    format: str | None
    """``dcp``, ``deepspeed``, ``megatron``, ``dir``, ``safetensors``, ``torch`` or None."""
    complete: bool
    reason: str | None
    """Why it is not complete (None when it is)."""


def quick_status(path: Path, *, run: Path | None = None) -> Probe:
    """Detect a checkpoint's format cheaply and whether it looks complete.

    Reads only marker files, headers and zip end records: never tensor data.

    Args:
        path: A checkpoint file or directory.
        run: The run directory it was listed in: a directory checkpoint holding a symbolic
            link out of it is incomplete and nothing of it is read (see :func:`links_out`).

    Returns:
        A :class:`Probe`: ``(format or None, complete, reason when incomplete)``.
    """
    try:
        if run is not None and path.is_dir() and (out := links_out(path, run)):
            return Probe(None, False, link_out_reason(out))
        status = _dir_status(path) if path.is_dir() else _file_status(path)
    except (OSError, CkptError) as e:
        return Probe(None, False, f"unreadable: {e}")
    return named_unfinished(path, status)


def links_out(path: Path, run: Path, limit: int = 3) -> list[str]:
    """The symbolic links inside a checkpoint directory that lead out of its run directory.

    A run-level command (a run's listing, ``validate`` of a run, ``stats``, ``watch``) reads
    nothing through them, as it follows no symlinked checkpoint: a ``model.safetensors`` linked
    to a file elsewhere on the machine is not the run's to read, nor to echo. (A checkpoint
    named on its own is read through its links: the hub cache links ``snapshots/<rev>/*`` to
    ``../../blobs``.) Links are found by the directory entries' types (no stat per file);
    only the links are resolved.

    Args:
        path: The checkpoint directory.
        run: The run directory.
        limit: Stop after this many.

    Returns:
        Up to ``limit`` paths relative to ``path``, in walk order; empty on object stores.
    """
    if not storage.has_file_system(path):
        return []
    top = os.path.realpath(run)
    out: list[str] = []
    stack = [str(path)]
    while stack and len(out) < limit:
        where = stack.pop()
        try:
            with os.scandir(where) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError:
            continue
        for e in entries:
            if e.is_symlink():
                target = os.path.realpath(e.path)
                if os.path.commonpath([top, target]) != top:
                    out.append(os.path.relpath(e.path, path))
            elif e.is_dir(follow_symlinks=False):
                stack.append(e.path)
    return out[:limit]


LINK_OUT = "is a symbolic link out of the run directory"
"""What a :class:`Probe` reason of :func:`links_out` says (nothing of such an entry is read)."""


def link_out_reason(links: list[str]) -> str:
    """One line for :func:`links_out`'s findings."""
    return (f"{links[0]} {LINK_OUT}"
            f"{f' (and {len(links) - 1} more)' if len(links) > 1 else ''}; not read")


def named_unfinished(path: Path, status: Probe) -> Probe:
    """``status``, made incomplete when the checkpoint's own name marks an unfinished save."""
    fmt, complete, reason = status
    unfinished = in_progress_reason(path.name) if complete else None
    if unfinished is not None:
        # Orbax, HF Trainer and ckpt itself save under a temporary name and rename when
        # done: such a path holds what was written so far, whatever its markers say.
        return Probe(fmt, False, unfinished)
    return Probe(fmt, complete, reason)


def _dir_status(path: Path) -> Probe:
    # One scandir serves every check below: at thousands of checkpoints, per-name stat calls
    # and pathlib objects are most of the cost of a listing.
    with storage.scandir(path) as it:
        children = {e.name: e for e in it}
    names = set(children)
    if not names:
        return Probe(None, False, "empty directory")
    has_metadata = dcp.METADATA in names or (
        any(n.endswith(".metadata") and n.startswith("__") for n in names)
        and dcp.metadata_file(path) is not None)
    if has_metadata or any(n.endswith(".distcp") for n in names):
        if not has_metadata:
            return Probe("dcp", False, "no .metadata: the save did not finish")
        if path.name.startswith("iter_") and "common.pt" in names and "metadata.json" not in names:
            return Probe("dcp", False, "no metadata.json: Megatron writes it last")
        return Probe("dcp", True, None)
    # A DeepSpeed tag, or a save directory of one tag (Lightning's DeepSpeedStrategy).
    tag = path if any(deepspeed.MODEL_STATES.match(n) for n in names) else (
        deepspeed.tag_dir(path) if "latest" in names else None)
    if tag is not None:
        model, optim, _ = deepspeed.rank_files(tag)
        bad = [p.name for p in model + optim if _file_status(p)[1] is False]
        return Probe("deepspeed", not bad, f"damaged: {', '.join(bad[:3])}" if bad else None)
    if megatron.rank_dirs(path):
        missing = [d.name for d, *_ in megatron.rank_dirs(path)
                   if not (d / "model_optim_rng.pt").is_file()]
        return Probe("megatron", not missing,
                      f"no model_optim_rng.pt in {missing[0]}" if missing else None)
    if path.name.startswith("checkpoint-") and "trainer_state.json" not in names:
        return Probe("dir", False, "no trainer_state.json: HF Trainer writes it last")
    data = [children[n] for n in sorted(names)
            if n.endswith(FILE_EXTENSIONS) and children[n].is_file()]
    if not data:
        return Probe(None, False, "no checkpoint files")
    for e in data:
        _fmt, ok, why = _file_status(storage.locate(e.path))
        if not ok:
            return Probe("dir", False, f"{e.name}: {why}")
    return Probe("dir", True, None)


def _file_status(path: Path) -> Probe:
    fd = open_regular(path)  # a FIFO among a tag's rank files must not block the listing
    try:
        status = open_file_status(path, fd, storage.size_of(fd))
    finally:
        storage.close(fd)
    return status if status is not None else _other_file_status(path)


def open_file_status(path: Path, fd: Handle, size: int) -> Probe | None:
    """:func:`_file_status` of an open file: safetensors and zip checks on ``fd`` itself;
    None for anything else (see :func:`_other_file_status`)."""
    head = storage.pread(fd, 16, 0)
    if safetensors.sniff_bytes(head[:9], size) is None or (
            len(head) >= 8 and path.name.endswith(".safetensors")):
        return _safetensors_status(path, size, fd)
    if head.startswith(torchfile.ZIP_MAGIC):
        ok = _has_zip_end(fd, size)
        return Probe("torch", ok,
                      None if ok else "no zip end record: truncated or still being written")
    return None


def _other_file_status(path: Path) -> Probe:
    size = path.stat().st_size
    if torchfile.sniff_torch(path) is None:
        return Probe("torch", size > 0, None if size else "empty file")
    if size == 0:
        return Probe(None, False, "empty file")
    return Probe(None, False, "not a recognised checkpoint file")


def _safetensors_status(path: Path, size: int,
                        fd: Handle | None = None) -> Probe:
    known = safetensors.known_end(fd) if fd is not None else None
    if known is not None:
        n, end = known
    else:
        try:
            n, header, _, _findings = safetensors.parse_header(path, fd=fd, size=size)
        except CkptError as err:
            return Probe("safetensors", False, err.message)
        header.pop("__metadata__", None)
        ends = [e for e in map(safetensors.declared_end, header.values()) if e is not None]
        end = max(ends, default=0)
    if 8 + n + end != size:
        return Probe("safetensors", False,
                      f"file is {size:,} bytes, header implies {8 + n + end:,}")
    return Probe("safetensors", True, None)


_EOCD = b"PK\x05\x06"


def _has_zip_end(fd: Handle, size: int) -> bool:
    """Whether a zip ends with an end-of-central-directory record.

    torch writes no zip comment, so the record is almost always the last 22 bytes: read those
    first and search the largest possible comment span only when they are not it.
    """
    if size < 22:
        return False
    last = storage.pread(fd, 22, size - 22)
    if last[:4] == _EOCD and last[20:22] == b"\0\0":
        return True
    start = max(0, size - 22 - 65535)
    tail = storage.pread(fd, size - start, start)
    i = tail.rfind(_EOCD)
    if i < 0 or len(tail) - i < 22:
        return False
    (comment_len,) = struct.unpack("<H", tail[i + 20:i + 22])
    return bool(i + 22 + comment_len == len(tail))
