"""What the API functions share: turning their keyword arguments into the ops' values (sizes
and durations as text or numbers, ``--part`` specs), naming the ops' parameters as the API
does in errors, the progress callback's type, and the store settings."""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from ckpt_cli import storage
from ckpt_cli.errors import CkptError, UsageError, with_builtin
from ckpt_cli.optionspec import options_of
from ckpt_cli.parts import parse_part
from ckpt_cli.progress import Progress
from ckpt_cli.units import parse_count, parse_duration, parse_rate, parse_size

if TYPE_CHECKING:
    from ckpt_cli.parts import Part

PathLike = str | os.PathLike[str]
"""A local path (``str`` or :class:`os.PathLike`) or a URL (``s3://bucket/key``)."""

P = ParamSpec("P")
R = TypeVar("R")


def deprecated_keywords(options: type | None = None, **renamed: str
                        ) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Keep a function's old keywords working for one release, each with a
    :class:`DeprecationWarning` naming the new one.

    Args:
        options: An options dataclass whose fields list their ``old_keywords``
            (:func:`ckpt_cli.optionspec.option`).
        renamed: More old keyword -> new keyword (for keywords that are no field).
    """

    olds = dict(renamed)
    if options is not None:
        olds.update((old, f.name) for f, s in options_of(options) for old in s.old_keywords)

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def call(*args: P.args, **kwargs: P.kwargs) -> R:
            for old, new in olds.items():
                if old not in kwargs:
                    continue
                if new in kwargs:
                    raise TypeError(f"{fn.__name__}() got both {old}= and {new}= "
                                    f"({old} is the old name of {new})")
                warnings.warn(f"{fn.__name__}({old}=...) is deprecated and will be removed in "
                              f"the next release; use {new}=...", DeprecationWarning,
                              stacklevel=2)
                kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        call.deprecated_keywords = dict(olds)  # type: ignore[attr-defined]
        return call

    return decorate


ProgressCallback = Progress
"""``on_progress(phase, done, total)``: ``done`` of ``total`` (bytes, or checkpoints for
``prune``) in the phase named (``crc32``, ``comparing``, ``writing``...); ``total`` is 0 while
unknown. The ops' one progress contract (:class:`ckpt_cli.progress.Progress`): the API passes
the callback to the op as it is."""

# The ops' parameter names -> the API's keywords (named like the CLI's options), for errors.
_COMMON = {"allow_globals": "allow_global", "filter_glob": "name_glob",
           "manifest_algorithm": "manifest_hash", "strip_prefixes": "strip_prefix",
           "everything": "all_tensors"}


@contextmanager
def api_names(fmt: str = "input_format") -> Iterator[None]:
    """Errors raised inside name the API's keywords, not the ops' parameter names, and are
    raised as the builtin a caller catches too (:func:`ckpt_cli.errors.with_builtin`).

    Args:
        fmt: The keyword the ops' ``fmt`` is (``input_format``, or ``output_format`` for an
            output).
    """
    try:
        yield
    except CkptError as e:
        e.rename_params({**_COMMON, "fmt": fmt})
        out = with_builtin(e)
        if out is e:
            raise
        raise out.with_traceback(e.__traceback__) from e.__cause__


def located(path: str | os.PathLike[str]) -> Any:
    """A path or URL as the ops take it: a ``Path`` or an ``ObjectPath``."""

    return storage.locate(os.fspath(path))


def output(path: str | os.PathLike[str]) -> Any:
    """An output: located, keeping a trailing slash (a directory whatever its suffix), as
    the CLI's ``-o`` does."""
    text = os.fspath(path)
    return text if text.endswith(("/", os.sep)) and len(text) > 1 else located(text)


def size(value: int | str | None, name: str, *, allow_zero: bool = False) -> int | None:
    """A size given as bytes or as text (``"5GB"``); None stays None (0 too with
    ``allow_zero``: no limit)."""
    if value is None:
        return None
    if isinstance(value, str):
        return parse_size(value, what=name, allow_zero=allow_zero) or None
    _number(value, name, allow_zero=allow_zero)
    return int(value) or None


def duration(value: float | str | None, name: str, *, allow_zero: bool = False) -> float | None:
    """A duration given as seconds or as text (``"10m"``, ``"1h30m"``)."""
    if value is None:
        return None
    if isinstance(value, str):
        return parse_duration(value, what=name, allow_zero=allow_zero)
    _number(value, name, allow_zero=allow_zero)
    return float(value)


def count(value: int | str | None, name: str) -> int | None:
    """A whole count given as a number or as text (``"10K"``, ``"7B"``)."""
    if value is None:
        return None
    if isinstance(value, str):
        return parse_count(value, what=name, whole=True)
    _number(value, name)
    return int(value)


def rate(value: float | str | None, name: str) -> float | None:
    """A rate given as bytes per second or as text (``"10GB/s"``)."""
    if value is None:
        return None
    if isinstance(value, str):
        return parse_rate(value, what=name)
    _number(value, name)
    return float(value)


def _number(value: float, name: str, *, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UsageError(f"{name} must be a number or text such as '10GB', not {value!r}",
                         param=name)
    if value < 0 or (value == 0 and not allow_zero):
        raise UsageError(f"{name} must be positive, not {value!r}", param=name)


def part(value: Part | str | None) -> Part | None:
    """A part of a split job: ``"K/N"``, ``"auto"`` or a :class:`~ckpt_cli.parts.Part`."""
    if value is None or not isinstance(value, str):
        return value

    return parse_part(value)


def names(value: str | Any | None) -> tuple[str, ...]:
    """A repeatable option: one string, or an iterable of them."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(value)


def local_only(path: Any, what: str, param: str) -> None:
    """Refuse a URL where only local paths work so far (as the CLI does).

    Raises:
        UsageError: If ``path`` is on an object store.
    """

    if path is not None and not storage.has_file_system(path):
        raise UsageError(f"{what} must be a local path, not a URL ({path} is on object "
                         "storage)", param=param)


def use_storage(storage_options: Mapping[str, Any] | None, concurrency: int | None) -> None:
    """Open stores with these fsspec options (and ranged GETs in flight), when given.

    The settings are the process's (as ``--storage-option`` is a run's): they stay for later
    calls until given again.
    """
    if storage_options is None and concurrency is None:
        return

    storage.configure(dict(storage_options or {}), concurrency)
