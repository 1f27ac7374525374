"""Format readers: the registry and content-based detection.

Directory layouts are sniffed first (DCP ``.metadata``, ``*.index.json``, DeepSpeed
``*_model_states.pt``, Megatron ``mp_rank_*``), then a generic directory of checkpoint files;
files by content (safetensors header, zip magic, pickle header), never by extension alone.
"""

from __future__ import annotations

from pathlib import Path

from ckpt_cli import storage
from ckpt_cli.errors import CheckpointNotFoundError, CkptError, UnknownFormatError
from ckpt_cli.formats import containers
from ckpt_cli.formats.base import Reader
from ckpt_cli.formats.dcp import DCPReader
from ckpt_cli.formats.deepspeed import DeepSpeedReader
from ckpt_cli.formats.directory import DirectoryReader
from ckpt_cli.formats.hf_index import INDEX_SUFFIXES, HFIndexReader
from ckpt_cli.formats.megatron import MegatronReader
from ckpt_cli.formats.names import step_from_name
from ckpt_cli.formats.safetensors import SafetensorsReader
from ckpt_cli.formats.ties import find_ties
from ckpt_cli.formats.torchfile import TorchReader
from ckpt_cli.model import CheckpointIndex, Finding

_READERS: dict[str, Reader] = {}
_FALLBACK_DIR = "dir"


def register_reader(reader: Reader) -> None:
    """Add a reader to the registry (later registrations of a name replace earlier ones).

    Args:
        reader: An object implementing :class:`~ckpt_cli.formats.base.Reader`.
    """
    _READERS[reader.name] = reader


for _r in (DCPReader(), HFIndexReader(), DeepSpeedReader(), MegatronReader(),
           DirectoryReader(), SafetensorsReader(), TorchReader()):
    register_reader(_r)


def reader_names() -> list[str]:
    """Names of the registered readers, in detection order."""
    return list(_READERS)


def get_reader(name: str) -> Reader:
    """The reader registered under ``name``.

    Raises:
        UnknownFormatError: If there is none.
    """
    try:
        return _READERS[name]
    except KeyError:
        raise UnknownFormatError(
            f"unknown format {name!r}; known: {', '.join(_READERS)}") from None


def check_exists(path: Path) -> None:
    """Raise a one-line :class:`CkptError` unless ``path`` exists and can be listed/read."""
    try:
        path.stat()
    except FileNotFoundError:
        raise CheckpointNotFoundError("no such file or directory", path=path) from None
    except OSError as e:
        raise CkptError(f"cannot access: {e.strerror}", path=path) from None


def detect(path: Path, fmt: str | None = None) -> Reader:
    """Choose the reader for ``path``.

    Args:
        path: A file or directory.
        fmt: A format name that overrides detection.

    Returns:
        The reader.

    Raises:
        CkptError: If ``path`` does not exist.
        UnknownFormatError: No reader matches (the message lists each one's reason), or several
            specific directory readers match (pass ``--format``).
    """
    check_exists(path)
    is_dir = path.is_dir()
    special = None if is_dir else storage.not_regular(path)
    if special is not None:
        raise CkptError(special, path=path)  # never opened: a FIFO would block the read
    if not is_dir and path.is_file() and path.stat().st_size == 0:
        # Whatever the name or --input-format says: no format's file is empty, and every
        # command (inspect, validate, diff...) says so in the same words.
        raise UnknownFormatError("empty file (0 bytes): not a checkpoint, or its write never "
                                 "started", path=path)
    if fmt:
        return get_reader(fmt)
    if not is_dir and path.name.endswith(INDEX_SUFFIXES) and "hf-index" in _READERS:
        return _READERS["hf-index"]  # an index file names a shard set: read it as one
    reasons: list[str] = []
    matches: list[Reader] = []
    try:
        for r in _READERS.values():
            if r.is_dir_format != is_dir or r.name == _FALLBACK_DIR:
                continue
            why = r.sniff(path)
            if why is None:
                matches.append(r)
            else:
                reasons.append(f"{r.name}: {why}")
        if not matches and is_dir and _FALLBACK_DIR in _READERS:
            why = _READERS[_FALLBACK_DIR].sniff(path)
            if why is None:
                matches.append(_READERS[_FALLBACK_DIR])
            else:
                reasons.append(f"{_FALLBACK_DIR}: {why}")
    except PermissionError as e:
        raise CkptError(f"cannot read: {e.strerror}", path=path) from None
    if len(matches) == 1:
        return matches[0]
    if matches:
        names = ", ".join(m.name for m in matches)
        raise UnknownFormatError(f"matches several formats ({names}); choose one with "
                                 "--input-format (diff: --input-format-a/-b)", path=path)
    kind = "directory" if is_dir else "file"
    raise UnknownFormatError(f"unrecognised {kind} ({'; '.join(reasons)})", path=path)


def read_index(path: str | Path, fmt: str | None = None) -> CheckpointIndex:
    """Detect the format of ``path`` and read its metadata (no tensor data).

    Args:
        path: A checkpoint file or directory.
        fmt: Force a format instead of detecting it.

    Returns:
        The :class:`CheckpointIndex`.

    Raises:
        CkptError: For any problem with the input.
    """
    p = storage.locate(path)
    reader = detect(p, fmt)
    try:
        index = reader.read_index(p)
    except PermissionError as e:
        raise CkptError(f"cannot read: {e.strerror}", path=e.filename or p) from None
    except IsADirectoryError as e:
        raise CkptError("is a directory; this format is a single file", path=e.filename
                        or p) from None
    except NotADirectoryError as e:
        raise CkptError(f"is not a directory; the {reader.name} format is one",
                        path=e.filename or p) from None
    except OSError as e:
        raise CkptError(f"cannot read: {e.strerror or e}", path=e.filename or p) from None
    _complete(index)
    return index


def first_error(path: str | Path) -> tuple[CheckpointIndex | None, str | None]:
    """Read a checkpoint's index (headers and pickles only, through the allowlist) and report
    its first error: the quick structural and pickle-safety check of prune, thinning and
    ``resume-path``.

    Args:
        path: A checkpoint file or directory.

    Returns:
        ``(index or None when it could not be read, None or the first error as a sentence)``.
    """
    try:
        index = read_index(path)
    except CkptError as e:
        return None, e.message
    except Exception as e:  # a reader failing on odd input: not valid, never a crash
        return None, f"could not be read: {type(e).__name__}: {e}"
    errors = [f for f in index.findings if f.severity == "error"]
    return index, finding_sentence(errors[0]) if errors else None


def finding_sentence(f: Finding) -> str:
    """A finding as one sentence: ``file:location: message``."""
    where = ":".join(x for x in (f.file, f.location) if x)
    return f"{where}: {f.message}" if where else f.message


def _complete(index: CheckpointIndex) -> None:
    """What every format shares once read: training facts from nested leaves (the same
    names whatever the reader), the step the checkpoint's name gives, and tied weights that
    no storage sharing records (found the same way for every format)."""
    for k, v in containers.training_facts(index.objects, index.tensors).items():
        index.metadata.setdefault(k, v)
    root = index.root
    # A file inside a step directory (step_000300/checkpoint.pt) is named by its directory.
    names = [root.name] if root.is_dir() else [root.name, root.parent.name]
    index.name_step = next((s for n in names if (s := step_from_name(n, strict=True))
                            is not None), None)

    find_ties(index)


__all__ = ["Reader", "check_exists", "detect", "get_reader", "read_index", "reader_names",
           "register_reader"]
