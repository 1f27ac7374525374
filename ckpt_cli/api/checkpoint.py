"""``ckpt_cli.open(path)``: one checkpoint of any format ckpt reads, as safetensors'
``safe_open`` is one safetensors file.

Lazy and header-first: opening reads the metadata only (headers, indexes and pickles, through
the allowlist: no code from the file runs); each :meth:`Checkpoint.read` reads one tensor's
bytes with positioned reads, so memory holds what was asked for. Local paths and URLs alike.
What reading the checkpoint found (unsafe pickle globals, hidden pickles, duplicate keys,
damage) travels with it in :attr:`Checkpoint.findings`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, overload

from ckpt_cli import (
    dtypes,  # imports torch: only when torch tensors are asked for
    fp8,
    storage,
)
from ckpt_cli.api import _args
from ckpt_cli.api._args import PathLike
from ckpt_cli.choices import InputFormat
from ckpt_cli.errors import UsageError, with_builtin
from ckpt_cli.formats import allowlist, check_exists, read_index
from ckpt_cli.fp8 import scheme
from ckpt_cli.model import CheckpointIndex, FileInfo, Finding, TensorInfo
from ckpt_cli.resolve import resolve
from ckpt_cli.tensors.source import TensorSource

if TYPE_CHECKING:
    import numpy as np

    from ckpt_cli.tensors.source import TensorSource

__all__ = ["Checkpoint", "TensorEntry", "open"]


class TensorEntry(NamedTuple):
    """One tensor of a checkpoint, without its values.

    Attributes:
        name: Its name in the checkpoint (a flattened key path: ``model.fc.weight``).
        dtype: ckpt's dtype code: ``F32``, ``BF16``, ``F8_E4M3``, ``I64``...
        shape: Its shape.
        group: ``model``, ``buffer``, ``optimizer`` or ``other``.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    group: str


@dataclass(eq=False)
class Checkpoint:
    """A checkpoint opened by :func:`open`; use it as a context manager (or call
    :meth:`close`) to close the files its reads keep open.

    Attributes:
        path: The path or URL opened.
        format: ``safetensors``, ``hf-index``, ``torch``, ``dcp``, ``deepspeed``, ``megatron``
            or ``dir``.
        flavor: What wrote it, when known (``lightning``, ``hf-trainer``...).
        files: The files it is made of (``FileInfo``: path relative to its directory, size).
        metadata: Training facts it records: ``step``, ``epoch``, ``lr``, versions...
        step: Its training step (recorded, else from its name), or None.
        step_source: ``metadata``, ``name`` or None.
        findings: What reading it found, as ``validate`` reports it: unsafe or unknown pickle
            globals (errors unless ``allow_global`` trusts them), hidden pickles, duplicate
            keys, damage. Reading never runs code whatever they say.
        index: The full description ckpt's commands work from.
    """

    path: str
    format: str
    flavor: str | None
    files: list[FileInfo]
    metadata: dict[str, Any]
    step: int | None
    step_source: str | None
    findings: list[Finding]
    index: CheckpointIndex

    def __post_init__(self) -> None:
        self._by_name = dict(self.index.tensors)
        self._source: TensorSource | None = None

    # -- what it holds --------------------------------------------------------------------------

    def tensors(self, group: str | None = None) -> list[TensorEntry]:
        """Its tensors in file order (``group``: only ``model``, ``optimizer``... ones)."""
        return [TensorEntry(t.name, t.dtype, t.shape, t.group)
                for t in self.index.tensors.values() if group is None or t.group == group]

    def keys(self) -> list[str]:
        """Every tensor's name, in file order (as ``safe_open(...).keys()``)."""
        return list(self._by_name)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __len__(self) -> int:
        return len(self._by_name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    @property
    def ok(self) -> bool:
        """Whether reading it found no error (warnings and notes allowed)."""
        return not any(f.severity == "error" for f in self.findings)

    # -- values ---------------------------------------------------------------------------------

    @overload
    def read(self, name: str, *, framework: Literal["numpy"] = "numpy",
             dequantize: bool = False) -> np.ndarray: ...

    @overload
    def read(self, name: str, *, framework: Literal["torch"],
             dequantize: bool = False) -> Any: ...

    def read(self, name: str, *, framework: Literal["numpy", "torch"] = "numpy",
             dequantize: bool = False) -> Any:
        """One tensor's values, read from its bytes (never through a pickle).

        Args:
            name: A name of :meth:`keys`.
            framework: ``numpy`` (BF16 and FP8 as ml_dtypes) or ``torch`` (imports torch;
                the same bytes, zero-copy).
            dequantize: An FP8 weight with a scale comes back as FP32 ``weight * scale``
                (rounded once, as torch's ``w.float() * s``); other tensors are as stored.

        Returns:
            A C-contiguous array of the tensor's shape and stored dtype.

        Raises:
            KeyError: No tensor has this name.
            CorruptCheckpointError: Its bytes are missing or do not decode.
            UnsupportedError: A tensor without data (``meta``) or a compressed DCP chunk.
        """
        t = self._tensor(name)
        with _args.api_names():
            arr = self._values(t, dequantize)
        return _framework(arr, "F32" if dequantize and t.dtype.startswith("F8") else t.dtype,
                          framework)

    def read_slice(self, name: str, start: int, stop: int, *,
                   framework: Literal["numpy", "torch"] = "numpy") -> Any:
        """Rows ``start:stop`` of a tensor (its first dimension), reading only their bytes
        where the tensor is one contiguous range, as safetensors' ``get_slice``.

        Args:
            name: A name of :meth:`keys`.
            start: First row (Python slice rules: negative counts from the end).
            stop: Row after the last.
            framework: As for :meth:`read`.

        Returns:
            The rows, shape ``(rows, *shape[1:])``.

        Raises:
            KeyError: No tensor has this name.
            UsageError: A 0-d tensor has no rows.
        """
        t = self._tensor(name)
        with _args.api_names():
            if not t.shape:
                raise UsageError(f"tensor {name!r} is 0-d: it has no rows to slice")
            lo, hi, _ = slice(start, stop).indices(t.shape[0])
            arr = self._src().read_rows(t, lo, max(lo, hi))
        return _framework(arr, t.dtype, framework)

    # -- life -----------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the files reads opened (opening again on the next read)."""
        if self._source is not None:
            self._source.close()
            self._source = None

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Checkpoint({self.path!r}, format={self.format!r}, tensors={len(self)}, "
                f"step={self.step!r}, findings={len(self.findings)})")

    # -- inside ---------------------------------------------------------------------------------

    def _tensor(self, name: str) -> TensorInfo:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no tensor named {name!r} in {self.path}") from None

    def _src(self) -> TensorSource:
        if self._source is None:
            self._source = TensorSource(self.index)
        return self._source

    def _values(self, t: TensorInfo, dequantize: bool) -> np.ndarray:
        arr = self._src().read(t)
        if not dequantize or not t.dtype.startswith("F8"):
            return arr

        qc, _ = scheme.read_quantization_config(self.index)
        pair = scheme.pair_scales(self._by_name, qc).pairs.get(t.name)
        if pair is None or len(t.shape) != 2:
            raise UsageError(f"tensor {t.name!r} is {t.dtype} without a scale ckpt can pair "
                             "with it: read it without dequantize", param="dequantize")
        return fp8.dequantize(arr, self._src().read(pair.scale), "F32")


def _framework(arr: np.ndarray, code: str, framework: str) -> Any:
    if framework == "numpy":
        return arr
    if framework != "torch":
        raise _args_error(f"framework must be numpy or torch, not {framework!r}",
                         param="framework")

    return dtypes.to_torch(arr, code)


def _args_error(message: str, *, param: str) -> BaseException:
    return with_builtin(UsageError(message, param=param))


def open(path: PathLike, *, input_format: InputFormat | None = None,
         allow_global: str | Iterable[str] | None = None,
         storage_options: Mapping[str, Any] | None = None) -> Checkpoint:
    """Open one checkpoint of any format ckpt reads, reading its metadata only.

    Args:
        path: A checkpoint file or directory, or a URL (``s3://bucket/run/step_100``); a run
            directory whose resume pointer (``latest``) names a checkpoint opens that one.
        input_format: Skip detection and read it as this format.
        allow_global: Pickle globals to trust (``"module.name"``, one or several): their
            findings become notes.
        storage_options: fsspec options for URLs.

    Returns:
        The :class:`Checkpoint`.

    Raises:
        CheckpointNotFoundError: The path does not exist (a ``FileNotFoundError`` too).
        UsageError: The path is a run directory without a resume pointer (the message names
            its newest checkpoint), a directory above runs, or unrelated checkpoint files.
        CkptError: An unknown format, an unreadable or corrupt checkpoint.

    Example:
        >>> with ckpt_cli.open("demo-run/step_000300") as ck:
        ...     w = ck.read("model.wte.weight")
        ...     ck.step, [f.code for f in ck.findings]
    """

    with _args.api_names():
        _args.use_storage(storage_options, None)
        where = storage.locate(_args.located(path))
        check_exists(where)
        # One resolver for every command: a run's resume pointer is followed (as convert and
        # diff follow it); a run without one is refused naming its newest checkpoint.
        where = resolve(where, input_format=input_format).checkpoint()
        index = read_index(where, input_format)
        index.findings = allowlist.allow(index.findings, allowlist.parse_names(
            _args.names(allow_global)))
    return Checkpoint(path=str(where), format=index.format, flavor=index.flavor,
                      files=list(index.files), metadata=dict(index.metadata), step=index.step,
                      step_source=index.step_source, findings=list(index.findings),
                      index=index)
