"""What gets written, and under which names: the output's format and kind (file or directory)
from its name, the tensors to write (:class:`OutTensor`), and the shard plan.

:func:`plan_shards` packs tensors into output files the way huggingface_hub does (greedy, in
order, an oversize tensor alone in its own shard), and names the files HF-style. Writers only
execute the plan.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ckpt_cli import dtypes
from ckpt_cli.errors import UnsupportedError, UsageError

if TYPE_CHECKING:
    import numpy as np

FORMATS = ("safetensors", "pt")
FILE_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".ckpt")
NAMING = {"safetensors": ("model", ".safetensors"), "pt": ("pytorch_model", ".bin")}
"""The stem and extension of each format's weight files (``model-00001-of-00002.safetensors``)."""


def index_name(fmt: str) -> str:
    """The shard index's name for ``fmt``: ``model.safetensors.index.json``."""
    stem, ext = NAMING[fmt]
    return f"{stem}{ext}.index.json"


def output_format(dest: Path, fmt: str | None, *, directory: bool = False) -> str:
    """The format to write: ``fmt``, or what ``dest``'s suffix says (a directory: safetensors).

    This is also where the output's kind is decided: a name ending in ``.safetensors``,
    ``.pt``, ``.pth``, ``.bin`` or ``.ckpt`` (Lightning's name for a torch file) is a file;
    any other name is a directory, unless it has an extension ckpt does not write
    (``model.safetenors``, ``x.txt``), which is refused rather than silently made a
    directory. An extension is a suffix of letters and digits starting with a letter
    (:func:`is_extension`): ``checkpoint-1.5`` and ``step_0001.00`` are directory names. An
    existing directory, or a name given with a trailing slash (``directory``), is a
    directory whatever its suffix.

    Args:
        dest: The output path.
        fmt: ``safetensors``, ``pt``, or None to infer it.
        directory: The name was given with a trailing slash: the user means a directory.

    Returns:
        ``safetensors`` or ``pt``.

    Raises:
        UsageError: An unknown format, one that contradicts the file name (``x.pt`` as
            safetensors would mislead every later reader), or an output name with an
            extension ckpt does not write.
    """
    by_suffix = {".safetensors": "safetensors", ".pt": "pt", ".pth": "pt", ".bin": "pt",
                 ".ckpt": "pt"}
    implied = by_suffix.get(dest.suffix)
    accepted = ", ".join(FILE_SUFFIXES[:-1]) + f" or {FILE_SUFFIXES[-1]}"
    if implied and directory:
        raise UsageError(f"{dest}/: ends in '/' (a directory) but names a {dest.suffix} file; "
                         f"drop the '/' for a file, or name the directory without {dest.suffix}")
    if implied and dest.is_dir():
        raise UsageError(f"{dest}: an existing directory, but a {dest.suffix} output is one "
                         "file; name another file, or remove the directory first")
    if not implied and dest.suffix.lower() in by_suffix:
        raise UsageError(f"{dest}: write the extension in lower case "
                         f"({dest.suffix.lower()!r}); ckpt and the loaders match it exactly")
    if (not implied and not directory and is_extension(dest.suffix)
            and not dest.is_dir()):
        raise UsageError(f"{dest}: unknown output extension {dest.suffix!r}; a file must end "
                         f"in {accepted}; a directory has no extension (or give it with a "
                         "trailing '/')")
    if fmt is None:
        return implied or "safetensors"
    if fmt not in FORMATS:
        raise UsageError(f"fmt must be safetensors or pt, not {fmt!r}", param="fmt")
    if implied and implied != fmt:
        raise UsageError(f"fmt {fmt} does not match the file name {dest.name!r}", param="fmt",
                         hint=f"name it *.{'safetensors' if fmt == 'safetensors' else 'pt'}")
    return fmt


def names_directory(output: str | os.PathLike[str]) -> bool:
    """Whether an output argument ends in a slash: the user means a directory.

    Args:
        output: The output as given (a ``str`` keeps its trailing slash, a ``Path`` has none).

    Returns:
        True for ``out/`` or ``s3://bucket/out/``.
    """
    return isinstance(output, str) and len(output) > 1 and output.endswith(("/", os.sep))


_EXTENSION = re.compile(r"\.[A-Za-z][A-Za-z0-9]{0,15}")


def is_extension(suffix: str) -> bool:
    """Whether a name's suffix is a file extension (``.txt``, ``.h5``, ``.safetenors``) rather
    than part of a directory name (``.5`` in ``checkpoint-1.5``, ``.00``, ``.my_run``).

    Args:
        suffix: ``Path.suffix`` of the name (``""`` for none).

    Returns:
        True for a dot, a letter and up to 15 more letters or digits.
    """
    return _EXTENSION.fullmatch(suffix) is not None

@dataclass(frozen=True, slots=True)
class OutTensor:
    """One tensor to write.

    Attributes:
        name: Its name in the output.
        dtype: Output dtype code.
        shape: Output shape.
        load: Returns the values: a C-contiguous numpy array of ``dtype`` and ``shape``.
        pieces: Optionally, returns an iterator over the values in row-major order as
            flat arrays of ``dtype`` (together ``nbytes``); used instead of ``load`` when
            given, so that a large tensor never sits in memory whole.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    load: Callable[[], np.ndarray]
    pieces: Callable[[], Iterator[np.ndarray]] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data."""
        n = 1
        for d in self.shape:
            n *= d
        return dtypes.nbytes_of(self.dtype, n)

    @property
    def numel(self) -> int:
        """Number of elements."""
        n = 1
        for d in self.shape:
            n *= d
        return n

# Dtypes each output format cannot hold: safetensors has no complex128 and no 6-bit floats;
# torch has no 6-bit floats, and its float4 packs pairs with a shape ckpt does not write yet.
# Neither gets torch's own complex32 and raw bit types (no numpy dtype to write them from).
_TORCH_ONLY = {d.code for d in dtypes.DTYPES.values()
               if d.kind in ("complex", "bits") and d.numpy_name is None}
_UNWRITABLE = {"safetensors": {"C128", "F6_E2M3", "F6_E3M2", *_TORCH_ONLY},
               "pt": {"F4", "F6_E2M3", "F6_E3M2", *_TORCH_ONLY}}


def check_dtypes(tensors: Sequence[OutTensor], fmt: str) -> None:
    """Refuse a dtype the output format cannot hold.

    Raises:
        UnsupportedError: Naming the first such tensor, and the format that can hold it.
    """
    bad = [t for t in tensors if t.dtype in _UNWRITABLE[fmt]]
    if bad:
        other = "pt" if fmt == "safetensors" else "safetensors"
        hint = (f"fmt {other} can hold {bad[0].dtype}"
                if bad[0].dtype not in _UNWRITABLE[other] else None)
        raise UnsupportedError(f"{fmt} cannot hold {bad[0].dtype} ({bad[0].name}"
                               + (f" and {len(bad) - 1} more" if len(bad) > 1 else "") + ")",
                               hint=hint, param="fmt" if hint else None)


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """Which tensors go to which file.

    Attributes:
        files: Output file names, in order.
        members: For each file, the indices (into the planned sequence) of its tensors.
        sizes: For each file, the bytes of tensor data it holds.
    """

    files: tuple[str, ...]
    members: tuple[tuple[int, ...], ...]
    sizes: tuple[int, ...]

    @property
    def sharded(self) -> bool:
        """Whether more than one file is written (an index file is then needed)."""
        return len(self.files) > 1


def shard_name(stem: str, ext: str, i: int, n: int) -> str:
    """HF shard file name: ``model-00001-of-00003.safetensors`` (``model.safetensors`` if n=1)."""
    if n == 1:
        return f"{stem}{ext}"
    return f"{stem}-{i:05d}-of-{n:05d}{ext}"


def plan_shards(sizes: Sequence[int], max_shard_size: int | None, *, stem: str = "model",
                ext: str = ".safetensors") -> ShardPlan:
    """Pack tensors of the given byte sizes into shards of at most ``max_shard_size`` bytes.

    Tensors keep their order; each lands in exactly one shard; a tensor larger than the limit
    gets a shard of its own. With no limit everything goes into one file.

    Args:
        sizes: Byte size of each tensor, in output order.
        max_shard_size: Largest shard in bytes, or None for a single file.
        stem: File name stem (``model``, ``pytorch_model``).
        ext: File extension (``.safetensors``, ``.bin``).

    Returns:
        The :class:`ShardPlan`.

    Raises:
        ValueError: If ``max_shard_size`` is not positive or a size is negative.
    """
    if max_shard_size is not None and max_shard_size <= 0:
        raise ValueError("max_shard_size must be positive")
    groups: list[list[int]] = [[]]
    totals: list[int] = [0]
    for i, size in enumerate(sizes):
        if size < 0:
            raise ValueError("tensor sizes cannot be negative")
        full = max_shard_size is not None and groups[-1] and totals[-1] + size > max_shard_size
        if full:
            groups.append([])
            totals.append(0)
        groups[-1].append(i)
        totals[-1] += size
    n = len(groups)
    return ShardPlan(tuple(shard_name(stem, ext, i + 1, n) for i in range(n)),
                     tuple(tuple(g) for g in groups), tuple(totals))
