"""The operations behind the commands: each module or package owns one command, its options
dataclass and its result types."""

from __future__ import annotations

from typing import Any, TypeVar

T = TypeVar("T")


def options_of(kind: type[T], options: T | None, fields: dict[str, Any]) -> T:
    """An op's options: ``options``, else its fields given as keywords, else the defaults.

    Every op takes one options dataclass (``convert(src, out, ConvertOptions(to="bf16"))``);
    a caller setting a field or two may name them instead (``convert(src, out, to="bf16")``).

    Args:
        kind: The options dataclass.
        options: The options given, or None.
        fields: The keyword arguments naming fields of ``kind``.

    Returns:
        The options to use.

    Raises:
        TypeError: Both ``options`` and keywords given, or a keyword that is no field.
    """
    if not fields:
        return options if options is not None else kind()
    if options is not None:
        raise TypeError(f"give {kind.__name__} or its fields as keywords, not both")
    return kind(**fields)
