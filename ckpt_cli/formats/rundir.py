"""Run directories: many checkpoints of one training run, listed and ordered by step.

Recognised entries: ``checkpoint-N`` (HF Trainer), ``global_stepN`` (DeepSpeed), ``iter_NNNNNNN``
(Megatron), ``step_N``/``step-N``, ``epoch=E-step=S.ckpt`` (Lightning), numbered directories
(Orbax) and numbered ``.pt``/``.safetensors`` files, plus any directory that is a DCP checkpoint.
Pointers (``latest``, ``latest_checkpointed_iteration.txt``, ``last.ckpt``) are resolved;
temporary and trash names are reported as leftovers, never as checkpoints.
"""

from __future__ import annotations

import os
import re
import struct
from pathlib import Path

from ckpt_cli.errors import CkptError
from ckpt_cli.formats import dcp, deepspeed, hf_index, megatron, safetensors, torchfile
from ckpt_cli.formats.base import read_head
from ckpt_cli.model import Finding, RunEntry, RunListing

FILE_EXTENSIONS = (".pt", ".pth", ".bin", ".ckpt", ".safetensors", ".tar")
_NAME_PATTERNS = (
    re.compile(r"^checkpoint-(?P<step>\d+)$"),
    re.compile(r"^global_step(?P<step>\d+)$"),
    re.compile(r"^iter_(?P<step>\d+)$"),
    re.compile(r"(?:^|[-_])step[=_-]?(?P<step>\d+)(?:$|[-_.])"),
    re.compile(r"^(?:checkpoint|ckpt|model|iter|iteration|epoch|save|state)[_-]?(?P<step>\d+)"
               r"(?:\.[a-z]+)?$"),
    re.compile(r"^(?P<step>\d+)(?:\.[a-z]+)?$"),
    re.compile(r"^.+?[_-](?P<step>\d+)\.(?:pt|pth|bin|ckpt|safetensors)$"),
)
_METRIC = re.compile(r"(?P<key>[A-Za-z_][A-Za-z0-9_/]*)=(?P<val>[-+]?(?:\d+\.?\d*|\.\d+)"
                     r"(?:[eE][-+]?\d+)?)")
TEMP_MARKERS = (".tmp", "-tmp-", ".ckpt-tmp-", ".partial", ".incomplete", ".orbax-checkpoint-tmp",
                ".ckpt-trash-", "_tmp")
POINTER_FILES = ("latest", "latest_checkpointed_iteration.txt", "latest_universal")
# Numbered files that are parts of one checkpoint, not checkpoints of their own.
_PART_NAME = re.compile(r"rank|rng|random_states|optim|scheduler|shard|-of-|sampler|scaler",
                        re.IGNORECASE)


def is_leftover(name: str) -> bool:
    """Whether a name is a temporary (being written) or trash entry, never a checkpoint."""
    return name.startswith(".ckpt-trash-") or any(m in name for m in TEMP_MARKERS) or (
        name.startswith("tmp") and not name[3:4].isdigit())


def step_from_name(name: str) -> int | None:
    """The step a checkpoint's name encodes, or None."""
    for pat in _NAME_PATTERNS:
        m = pat.search(name)
        if m:
            return int(m.group("step"))
    return None


def metrics_from_name(name: str) -> dict[str, float]:
    """``key=value`` metrics in a name (Lightning: ``epoch=2-step=300-val_loss=0.12.ckpt``)."""
    stem = name.removesuffix(".ckpt").removesuffix(".pt")
    out: dict[str, float] = {}
    for m in _METRIC.finditer(stem):
        key = m.group("key").lstrip("-_")
        if key not in ("epoch", "step"):
            try:
                out[key] = float(m.group("val").rstrip("."))
            except ValueError:
                continue
    return out


def _is_checkpoint_name(entry: os.DirEntry[str]) -> bool:
    name = entry.name
    if name.startswith(".") or name in POINTER_FILES:
        return False
    if entry.is_dir(follow_symlinks=False):
        return step_from_name(name) is not None or (Path(entry.path) / dcp.METADATA).is_file()
    if entry.is_file(follow_symlinks=False):
        return name.endswith(FILE_EXTENSIONS) and not _PART_NAME.search(name) and (
            step_from_name(name) is not None or name.startswith("last"))
    return False


def is_run_dir(path: Path) -> bool:
    """Whether ``path`` holds checkpoints (rather than being one).

    A directory that is itself a DCP, DeepSpeed-tag or Megatron-iteration checkpoint is not a run
    directory; one with any child named or laid out like a checkpoint is.
    """
    if not path.is_dir():
        return False
    if (dcp.metadata_file(path) is not None or (path / "trainer_state.json").is_file()
            or hf_index.find_index(path) is not None
            or deepspeed.DeepSpeedReader().sniff(path) is None
            or megatron.MegatronReader().sniff(path) is None):
        return False
    try:
        with os.scandir(path) as it:
            return any(_is_checkpoint_name(e) for e in it)
    except OSError:
        return False


def tree_stats(path: Path) -> tuple[int, int, float]:
    """``(bytes, files, newest mtime)`` of a file or a directory tree (symlinks not followed)."""
    try:
        st = path.lstat()
    except OSError:
        return 0, 0, 0.0
    if not path.is_dir() or path.is_symlink():
        return st.st_size, 1, st.st_mtime
    total, count, newest = 0, 0, st.st_mtime
    stack = [str(path)]
    while stack:
        d = stack.pop()
        try:
            with os.scandir(d) as it:
                for e in it:
                    try:
                        est = e.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    newest = max(newest, est.st_mtime)
                    if e.is_dir(follow_symlinks=False):
                        stack.append(e.path)
                    else:
                        total += est.st_size
                        count += 1
        except OSError:
            continue
    return total, count, newest


def _read_pointer(root: Path, name: str) -> str | None:
    p = root / name
    try:
        if p.is_symlink():
            return Path(os.readlink(p)).name
        if not p.is_file() or p.stat().st_size > 4096:
            return None
        text = p.read_text(errors="replace").strip()
    except OSError:
        return None
    if not text:
        return None
    if name == "latest_checkpointed_iteration.txt":
        return "release" if text == "release" else (
            f"iter_{int(text):07d}" if text.isdigit() else None)
    return Path(text.splitlines()[0].strip()).name


def quick_status(path: Path) -> tuple[str | None, bool, str | None]:
    """Detect a checkpoint's format cheaply and whether it looks complete.

    Reads only marker files, headers and zip end records: never tensor data.

    Args:
        path: A checkpoint file or directory.

    Returns:
        ``(format or None, complete, reason when incomplete)``.
    """
    try:
        if path.is_dir():
            return _dir_status(path)
        return _file_status(path)
    except (OSError, CkptError) as e:
        return None, False, f"unreadable: {e}"


def _dir_status(path: Path) -> tuple[str | None, bool, str | None]:
    names = set(os.listdir(path))
    if not names:
        return None, False, "empty directory"
    distcp = [n for n in names if n.endswith(".distcp")]
    if dcp.metadata_file(path) is not None or distcp:
        if dcp.metadata_file(path) is None:
            return "dcp", False, "no .metadata: the save did not finish"
        if path.name.startswith("iter_") and "common.pt" in names and "metadata.json" not in names:
            return "dcp", False, "no metadata.json: Megatron writes it last"
        return "dcp", True, None
    if any(deepspeed.MODEL_STATES.match(n) for n in names):
        model, optim, _ = deepspeed.rank_files(path)
        bad = [p.name for p in model + optim if _file_status(p)[1] is False]
        return "deepspeed", not bad, (f"damaged: {', '.join(bad[:3])}" if bad else None)
    if megatron.rank_dirs(path):
        missing = [d.name for d, *_ in megatron.rank_dirs(path)
                   if not (d / "model_optim_rng.pt").is_file()]
        return "megatron", not missing, (f"no model_optim_rng.pt in {missing[0]}"
                                         if missing else None)
    if path.name.startswith("checkpoint-") and "trainer_state.json" not in names:
        return "dir", False, "no trainer_state.json: HF Trainer writes it last"
    files = [path / n for n in sorted(names)
             if n.endswith((*FILE_EXTENSIONS, ".json")) and (path / n).is_file()]
    data = [f for f in files if not f.name.endswith(".json")]
    if not data:
        return None, False, "no checkpoint files"
    for f in data:
        _fmt, ok, why = _file_status(f)
        if not ok:
            return "dir", False, f"{f.name}: {why}"
    return "dir", True, None


def _file_status(path: Path) -> tuple[str | None, bool, str | None]:
    size = path.stat().st_size
    head = read_head(path, 16)
    if safetensors.sniff_bytes(head[:9], size) is None or (
            len(head) >= 8 and path.name.endswith(".safetensors")):
        try:
            n, header, _, _findings = safetensors.parse_header(path)
        except CkptError as err:
            return "safetensors", False, err.message
        header.pop("__metadata__", None)
        end = max((v["data_offsets"][1] for v in header.values()
                   if isinstance(v, dict) and isinstance(v.get("data_offsets"), list)
                   and len(v["data_offsets"]) == 2 and isinstance(v["data_offsets"][1], int)),
                  default=0)
        if 8 + n + end != size:
            return "safetensors", False, (f"file is {size:,} bytes, header implies "
                                          f"{8 + n + end:,}")
        return "safetensors", True, None
    if head.startswith(torchfile.ZIP_MAGIC):
        ok = _has_zip_end(path, size)
        return "torch", ok, None if ok else "no zip end record: truncated or still being written"
    if torchfile.sniff_torch(path) is None:
        return "torch", size > 0, None if size else "empty file"
    if size == 0:
        return None, False, "empty file"
    return None, False, "not a recognised checkpoint file"


def _has_zip_end(path: Path, size: int) -> bool:
    """Whether a zip ends with an end-of-central-directory record (torch writes no comment)."""
    if size < 22:
        return False
    with open(path, "rb") as f:
        f.seek(max(0, size - 22 - 65535))
        tail = f.read()
    i = tail.rfind(b"PK\x05\x06")
    if i < 0 or len(tail) - i < 22:
        return False
    (comment_len,) = struct.unpack("<H", tail[i + 20:i + 22])
    return bool(i + 22 + comment_len == len(tail))


def list_run(root: Path, pattern: str | None = None, *, step_from_metadata: bool = True,
             ) -> RunListing:
    """List the checkpoints of a run directory, oldest first.

    Args:
        root: The run directory.
        pattern: A regex overriding name recognition; a ``step`` group (or the first group)
            gives the step.
        step_from_metadata: Read checkpoint metadata for entries whose name has no step.

    Returns:
        The :class:`RunListing`.

    Raises:
        CkptError: If ``root`` is not a readable directory, or ``pattern`` is not a regex.
    """
    if not root.is_dir():
        raise CkptError("not a directory", path=root)
    rx = None
    if pattern:
        try:
            rx = re.compile(pattern)
        except re.error as e:
            raise CkptError(f"--pattern is not a valid regular expression: {e}") from None
    listing = RunListing(root=root)
    for name in POINTER_FILES:
        target = _read_pointer(root, name)
        if target:
            listing.pointers[name] = target
    for link in sorted(root.glob("last*.ckpt")):
        if link.is_symlink():
            listing.pointers[link.name] = Path(os.readlink(link)).name
    try:
        with os.scandir(root) as it:
            children = sorted(it, key=lambda e: e.name)
    except OSError as err:
        raise CkptError(f"cannot list: {err.strerror}", path=root) from None
    for entry in children:
        if is_leftover(entry.name):
            listing.leftovers.append(entry.name)
            continue
        if entry.is_symlink():
            continue  # pointers such as last.ckpt -> epoch=...ckpt; never an entry of their own
        if rx is not None:
            m = rx.search(entry.name)
            if not m:
                continue
            groups = m.groupdict().get("step") or (m.group(1) if m.groups() else None)
            step = int(groups) if groups and str(groups).isdigit() else None
        elif _is_checkpoint_name(entry):
            step = step_from_name(entry.name)
        else:
            continue
        listing.entries.append(_entry(Path(entry.path), step))
    _fill_steps(listing, step_from_metadata)
    latest = listing.pointers.get("latest") or listing.pointers.get(
        "latest_checkpointed_iteration.txt") or next(
        (v for k, v in listing.pointers.items() if k.startswith("last")), None)
    names = {en.name for en in listing.entries}
    for k, v in listing.pointers.items():
        if v not in names:
            listing.findings.append(Finding("warning", "dangling-pointer",
                                            f"{k} names {v!r}, which is not in the directory",
                                            k))
    if latest in names:
        listing.latest = latest
    for en in listing.entries:
        if en.name in listing.pointers.values() or en.name.startswith("last"):
            en.latest = True
    return listing


def _entry(path: Path, step: int | None) -> RunEntry:
    size, files, mtime = tree_stats(path)
    fmt, complete, reason = quick_status(path)
    return RunEntry(name=path.name, path=path, step=step, step_source="name" if step is not None
                    else "unknown", format=fmt, bytes=size, files=files, mtime=mtime,
                    complete=complete, reason=reason, metrics=metrics_from_name(path.name))


def _fill_steps(listing: RunListing, from_metadata: bool) -> None:
    unknown = [e for e in listing.entries if e.step is None]
    if from_metadata:
        for e in unknown:
            step = _step_from_metadata(e.path)
            if step is not None:
                e.step, e.step_source = step, "metadata"
    if any(e.step is None for e in listing.entries):
        listing.findings.append(Finding(
            "warning", "mtime-order",
            "some checkpoints have no step in their name or metadata; they are ordered by "
            "modification time"))
        for e in listing.entries:
            if e.step is None:
                e.step_source = "mtime"
        listing.entries.sort(key=lambda e: e.mtime)
    else:
        listing.entries.sort(key=lambda e: (e.step or 0, e.mtime))


def _step_from_metadata(path: Path) -> int | None:
    from ckpt_cli.formats import read_index

    try:
        index = read_index(path)
    except CkptError:
        return None
    step = index.metadata.get("step")
    return step if isinstance(step, int) else None
