"""One declaration per option: an op's options dataclass field is the option.

A field made with :func:`option` carries the option's name (the field's), its type and
default (the field's) and its help, once. The command line's flag is the name with dashes
(``keep_full_every`` -> ``--keep-full-every``, see ``ckpt_cli/cli/options.py::from_options``),
the Python API's keyword is the name itself, and both take their help from here
(``tests/test_option_names.py`` keeps the three equal).

Help and messages name other options between backticks (``implies `tensors```); each caller
spells them its own way (:func:`spelled`): ``--tensors`` on the command line, ``tensors`` from
Python. Nothing here imports typer: the API and the ops use it too.
"""

from __future__ import annotations

import dataclasses
import re
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field
from typing import Any, Literal, TypeVar

Caller = Literal["cli", "python"]
"""Who an option is named for: the command line (``--keep 2``) or Python (``keep=2``)."""

Kind = Literal["size", "duration", "count", "rate", "part", "path", "names"]
"""How a value given as text is read: ``5GB``, ``10m``, ``10K``, ``10GB/s``, ``K/N``, a path
or URL, one name or several."""

_KEY = "ckpt_option"
F = TypeVar("F", bound=Callable[..., Any])


@dataclasses.dataclass(frozen=True, slots=True)
class Spec:
    """What a field says about its option besides its name, type and default.

    Attributes:
        help: One or two sentences; other options between backticks (`` `tensors` ``).
        metavar: The value's name in ``--help`` (``GLOB``, ``SIZE``).
        short: A short flag (``-t``), if any.
        off: The flag turning a bool option off (``--no-manifest``, ``--model-only``), if
            any; ``--help`` shows it beside the flag.
        aliases: Older flags that still work (``--filter`` for ``--name-glob``), listed in
            ``--help`` after the flag.
        old_keywords: Older Python keywords that still work, with a DeprecationWarning.
        kind: How text given for the value is read (see :data:`Kind`); None: as the type says.
        cli: False for an option the command line does not take (a Python object).
        min: The smallest number the command line accepts.
        allow_zero: A size or duration of 0 is accepted (it means "none").
    """

    help: str
    metavar: str | None = None
    short: str | None = None
    off: str | None = None
    aliases: tuple[str, ...] = ()
    old_keywords: tuple[str, ...] = ()
    kind: Kind | None = None
    cli: bool = True
    min: int | None = None
    allow_zero: bool = False


def option(default: Any = MISSING, *, help: str, metavar: str | None = None,
           short: str | None = None, off: str | None = None,
           aliases: tuple[str, ...] = (), old_keywords: tuple[str, ...] = (),
           kind: Kind | None = None, cli: bool = True, min: int | None = None,
           allow_zero: bool = False, default_factory: Callable[[], Any] | Any = MISSING) -> Any:
    """A dataclass field that declares an option (see :class:`Spec` for the arguments).

    Returns:
        A ``dataclasses.field`` with the default and the :class:`Spec` as metadata.
    """
    spec = Spec(help=help, metavar=metavar, short=short, off=off, aliases=aliases,
                old_keywords=old_keywords, kind=kind, cli=cli,
                min=min, allow_zero=allow_zero)
    if default_factory is not MISSING:
        return dataclasses.field(default_factory=default_factory, metadata={_KEY: spec})
    return dataclasses.field(default=default, metadata={_KEY: spec})


def spec_of(f: Field[Any]) -> Spec | None:
    """The :class:`Spec` of a field made by :func:`option` (None for another field)."""
    found = f.metadata.get(_KEY)
    return found if isinstance(found, Spec) else None


def options_of(cls: type) -> list[tuple[Field[Any], Spec]]:
    """The options an options dataclass declares, in field order."""
    found = []
    for f in dataclasses.fields(cls):
        s = spec_of(f)
        if s is not None:
            found.append((f, s))
    return found


def flag(name: str) -> str:
    """The command line's flag of an option: ``keep_full_every`` -> ``--keep-full-every``."""
    return "--" + name.replace("_", "-")


def spelled(name: str, caller: Caller, value: Any = MISSING) -> str:
    """An option (with a value, if given) as ``caller`` writes it: ``--keep 2`` / ``keep=2``."""
    if caller == "cli":
        return flag(name) if value is MISSING else f"{flag(name)} {value}"
    return name if value is MISSING else f"{name}={value}"


_TICKED = re.compile(r"`([a-z][a-z0-9_]*)((?:=[^`]*)?)`")


def word(text: str, caller: Caller) -> str:
    """``text`` with each option named between backticks spelled for ``caller``:
    `` `keep=2` `` -> ``--keep 2`` or ``keep=2``; `` `keep_every` `` -> ``--keep-every`` or
    ``keep_every``."""

    def one(m: re.Match[str]) -> str:
        value = m.group(2)[1:] if m.group(2) else MISSING
        return spelled(m.group(1), caller, value)

    return _TICKED.sub(one, text)


def docstring_args(cls: type, caller_names: Mapping[str, str] | None = None,
                   indent: str = "        ", width: int = 96) -> str:
    """The ``Args:`` lines of an API function taking ``cls``'s options as keywords, from
    the fields' help (so the help is written once).

    Args:
        cls: The options dataclass.
        caller_names: Unused names to skip (fields the function does not take).
        indent: The indentation of an ``Args:`` entry.
        width: The longest line.
    """
    lines: list[str] = []
    for f, s in options_of(cls):
        if caller_names is not None and f.name in caller_names:
            continue
        text = f"{f.name}: {_TICKED.sub(lambda m: f'``{m.group(1)}{m.group(2)}``', s.help)}"
        lines.extend(textwrap.wrap(text, width=width, initial_indent=indent,
                                   subsequent_indent=indent + "    ",
                                   break_on_hyphens=False))
    return "\n".join(lines)


def documented(cls: type, marker: str = "{options}") -> Callable[[F], F]:
    """Put ``cls``'s options' ``Args:`` lines in a function's docstring at ``marker``."""

    def decorate(fn: F) -> F:
        if fn.__doc__ and marker in fn.__doc__:
            fn.__doc__ = fn.__doc__.replace(marker, docstring_args(cls).lstrip())
        return fn

    return decorate


__all__ = ["Caller", "Kind", "Spec", "docstring_args", "documented", "flag", "option",
           "options_of", "spec_of", "spelled", "word"]
