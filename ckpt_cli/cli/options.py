"""Option types shared by the commands (one definition, same help everywhere)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import typing
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from typer._click.exceptions import BadParameter

from ckpt_cli import storage
from ckpt_cli.cli.errors import handled, worded
from ckpt_cli.errors import CkptError, UsageError
from ckpt_cli.optionspec import flag as flag_of
from ckpt_cli.optionspec import options_of, word

if TYPE_CHECKING:
    from ckpt_cli.cli.errors import Outcome
    from ckpt_cli.cli.progress import ProgressSink
    from ckpt_cli.parts import Part


class Refused(BadParameter):
    """An option value a parser below refused: the command reports its ``error`` as it reports
    the same error raised inside the command (one ``ckpt: error:`` line, the ``--json``
    document, exit 2), not as click's ``Invalid value`` (see ``CkptCommand.make_context``).

    Attributes:
        error: The parse error, worded with the flag.
    """

    def __init__(self, error: CkptError) -> None:
        super().__init__(error.message)
        self.error = error


def _parser(name: str, parse: Callable[[str], Any]) -> Callable[[Any], Any]:
    """A typer ``parser=`` callback: ``parse`` applied to the text given on the command line.

    A value that is not text is a default already parsed (typer passes defaults through the
    parser too), and comes back as it is.
    """

    def parser(value: Any) -> Any:
        if not isinstance(value, str):
            return value
        try:
            return parse(value)
        except CkptError as e:
            raise Refused(e) from None

    parser.__name__ = name
    return parser


def size_parser(flag: str, *, empty_is_none: bool = False,
                allow_zero: bool = False) -> Callable[[Any], Any]:
    """Parse a size option (``5GB``) into bytes, the error naming ``flag``.

    Args:
        flag: The option, for the error message.
        empty_is_none: An empty value means "not given" (None).
        allow_zero: ``0`` is accepted, and means None ("no limit").
    """

    def parse(text: str) -> int | None:
        from ckpt_cli.units import parse_size  # lazy: not loaded by ckpt --help

        if empty_is_none and not text:
            return None
        return parse_size(text, what=flag, allow_zero=allow_zero) or None

    return _parser("size", parse)


def _units_parser(kind: str, flag: str, **how: bool) -> Callable[[Any], Any]:
    """A parser calling ``ckpt_cli.units.parse_<kind>`` (imported only when a value comes)."""

    def parse(text: str) -> Any:
        from ckpt_cli import units  # lazy: not loaded by ckpt --help

        return getattr(units, f"parse_{kind}")(text, what=flag, **how)

    return _parser(kind, parse)


def duration_parser(flag: str, *, allow_zero: bool = False) -> Callable[[Any], Any]:
    """Parse a duration option (``4h``, ``1h30m``) into seconds, the error naming ``flag``."""
    return _units_parser("duration", flag, allow_zero=allow_zero)


def rate_parser(flag: str) -> Callable[[Any], Any]:
    """Parse a rate option (``10GB/s``) into bytes per second, the error naming ``flag``."""
    return _units_parser("rate", flag)


def count_parser(flag: str, *, whole: bool = False) -> Callable[[Any], Any]:
    """Parse a count option (``7B``; with ``whole`` an integer), the error naming ``flag``."""
    return _units_parser("count", flag, whole=whole)


def whole_parser(flag: str) -> Callable[[Any], Any]:
    """Parse a whole-number option (``--ranks 8``, ``1K``), the error naming ``flag``."""
    return count_parser(flag, whole=True)


def valued(flag: str, metavar: str, help: str,
           parser: Callable[[str], Callable[[Any], Any]]) -> Any:
    """An option whose value a parser above reads (``valued("--mtbf", "DURATION", "...",
    duration_parser)``), with no default shown: typer's ``Option`` for an ``Annotated``.

    Args:
        flag: The option.
        metavar: Its value's name in the help.
        help: Its help.
        parser: One of the ``*_parser`` functions, given ``flag``.
    """
    return typer.Option(flag, parser=parser(flag), metavar=metavar, help=help,
                        show_default=False)


def _part(text: str) -> Part | None:
    from ckpt_cli.parts import parse_part  # lazy: not loaded by ckpt --help

    return parse_part(text)


part_parser = _parser("part", _part)
"""Parse ``--part K/N|auto`` (``auto`` reads the launcher's environment)."""

JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable JSON on stdout "
                                                      "(stable schema, see docs/json-schema.md).")]
InputFormatOpt = Annotated[str | None, typer.Option(
    "--input-format", "-F", metavar="NAME",
    help="Skip detection and read the input as this format: safetensors, hf-index, torch, dcp, "
         "deepspeed, megatron or dir.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar or notes.")]
# Thinning and timelines (prune, and watch's retention): one declaration for both commands.
ThinAfterOpt = Annotated[int | None, typer.Option(
    "--thin-after", metavar="N", help="Rewrite checkpoints older than the newest N complete "
    "ones without optimizer state, in place (torch and Lightning files, HF checkpoint-N).",
    show_default=False)]
ThinToOpt = Annotated[str | None, typer.Option(
    "--thin-to", metavar="bf16", help="Also cast thinned checkpoints' weights to BF16.",
    show_default=False)]
KeepFullEveryOpt = Annotated[int | None, typer.Option(
    "--keep-full-every", metavar="STEPS", help="Never thin checkpoints whose step is a "
    "multiple of STEPS (e.g. 10K, as --keep-every).", show_default=False,
    parser=whole_parser("--keep-full-every"))]
KeepAbandonedOpt = Annotated[bool, typer.Option(
    "--keep-abandoned", help="Keep checkpoints of a timeline a rollback abandoned (higher "
    "steps a resume from an earlier one left behind); by default they are deleted. They "
    "never count towards --keep or --keep-every.")]
YesOpt = Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", "-n",
                                         help="Show what would be done and stop.")]
ForceOpt = Annotated[bool, typer.Option("--overwrite", "--force",
                                        help="Replace an existing output.")]


def _cast_targets(incomplete: str) -> list[str]:
    """Shell completion of ``--to``: the cast targets (imported only when completing)."""
    from ckpt_cli.tensors.cast import TARGETS  # lazy: not loaded by ckpt --help

    return [t for t in TARGETS if t.startswith(incomplete)]


CastToOpt = Annotated[str, typer.Option("--to", metavar="fp16|bf16|fp32|keep",
                                        help="Cast floating-point model tensors.",
                                        autocompletion=_cast_targets)]
OutputFormatOpt = Annotated[str | None, typer.Option(
    "--output-format", "-f", "--format", metavar="safetensors|pt",
    help="Output file format (default: from the output's suffix, else safetensors).")]
PartOpt = Annotated[Any, typer.Option(
    "--part", metavar="K/N|auto", parser=part_parser,
    help="Do only part K of N of the work (auto: from torchrun's RANK/WORLD_SIZE or a SLURM "
         "array); the last part to finish completes the job (index, manifest, report).")]
FinalizeOpt = Annotated[bool, typer.Option(
    "--finalize", help="Complete a job split with --part from every part's receipt (exit 2 "
                       "naming the parts missing).")]
MaxMemoryOpt = Annotated[int | None, typer.Option(
    "--max-memory", metavar="SIZE", parser=size_parser("--max-memory", empty_is_none=True),
    help="Budget for data read ahead and written behind, e.g. 512MB (default 256MB; the "
         "largest tensor may add to it).")]
Location = Any
"""The annotation of a path argument parsed by :func:`location`: typer would turn a ``Path``
annotation back into a local ``PosixPath`` (``s3://b/k`` into ``s3:/b/k``)."""

StorageOpt = Annotated[list[str] | None, typer.Option(
    "--storage-option", "-S", metavar="KEY=VALUE",
    help="An fsspec option for URLs (s3://, gs://, az://...), repeatable, e.g. "
         "endpoint_url=http://minio:9000 or anon=true.", show_default=False)]

AllowGlobalOpt = Annotated[list[str] | None, typer.Option(
    "--allow-global", metavar="MODULE.NAME",
    help="Trust this pickle global (repeatable), like torch's add_safe_globals; every other "
         "global outside ckpt's allowlist is an error.", show_default=False)]

ConcurrencyOpt = Annotated[int | None, typer.Option(
    "--concurrency", min=1, metavar="N",
    help="URLs: ranged GETs in flight per object streamed (default 8).", show_default=False)]


def location(text: str) -> Path:
    """Parse a path argument: a local path, or a URL (``s3://bucket/key``) on a store.

    Raises:
        typer.BadParameter: For a URL that cannot name an object (a usage error, exit 2).
    """
    try:
        return storage.locate(text)
    except UsageError as e:
        raise typer.BadParameter(worded(e)[0]) from None


def output_file(text: str) -> Path:
    """Parse a file to write (``--junit``) like :func:`location`, refusing ``-``.

    Raises:
        typer.BadParameter: For ``-`` (by convention standard output, where ckpt writes no
            file) or a URL that cannot name an object (a usage error, exit 2).
    """
    if text == "-":
        raise typer.BadParameter("'-' (standard output) is not an output here: ckpt writes "
                                 "files, never to stdout; name a file or directory (./- for "
                                 "one called '-')")
    return location(text)


def output_location(text: str) -> Path | str:
    """Parse an output argument like :func:`location`, keeping a trailing slash.

    ``-o out/x.v2/`` says "a directory" whatever the suffix, which a ``Path`` would forget:
    such a name comes back as the string, which the ops locate themselves. ``-`` is refused
    (:func:`output_file`).

    Raises:
        typer.BadParameter: For ``-`` or a URL that cannot name an object (a usage error,
            exit 2).
    """
    located = output_file(text)
    return text if text.endswith(("/", os.sep)) and len(text) > 1 else located


def path_argument(help: str, metavar: str | None = None) -> Any:
    """A path argument parsed by :func:`location` (a local path or a URL), with no default
    shown: typer's ``Argument`` for an ``Annotated[Location, ...]``."""
    return typer.Argument(help=help, metavar=metavar, show_default=False, parser=location)


CheckpointArg = Annotated[Location, path_argument(
    "Checkpoint file, shard set, checkpoint directory or run directory, or a URL (s3://...).")]
RunPatternOpt = Annotated[str | None, typer.Option(
    "--pattern", metavar="REGEX", help="Run directories: which entries are checkpoints "
                                       "(a 'step' group gives the step).")]


def use_storage(options: list[str] | None, concurrency: int | None = None) -> None:
    """Open stores with the ``--storage-option`` (and ``--concurrency``) settings; call
    inside ``handled()``.

    Raises:
        UsageError: For an item that is not ``KEY=VALUE``.
    """
    parsed: dict[str, Any] = storage.parse_options(options)
    storage.configure(parsed, concurrency)


def local_only(path: Path | None, what: str) -> None:
    """Refuse a URL where only local paths work so far.

    Raises:
        UsageError: If ``path`` is on an object store.
    """
    if path is not None and not storage.has_file_system(path):
        raise UsageError(f"{what} must be a local path, not a URL ({path} is on object "
                         "storage)")


@dataclasses.dataclass(frozen=True)
class Common:
    """The options several commands share, declared once: a command names those it takes in
    :func:`common_options` and gets their values as one ``common`` parameter.

    The field order is their order at the end of each command's ``--help``.
    """

    max_memory: MaxMemoryOpt = None
    quiet: QuietOpt = False
    storage_option: StorageOpt = None
    concurrency: ConcurrencyOpt = None
    json: JsonOpt = False

    def use_storage(self) -> None:
        """Open stores with ``--storage-option`` and ``--concurrency``; call inside
        ``handled()``."""
        use_storage(self.storage_option, self.concurrency)

    @contextmanager
    def handled(self) -> Iterator[Outcome]:
        """A command body's ``handled()`` block, the stores opened first."""

        with handled() as outcome:
            self.use_storage()
            yield outcome

    def progress(self, description: str) -> AbstractContextManager[ProgressSink]:
        """A byte-progress bar, off with ``--quiet`` or ``--json``."""
        from ckpt_cli.cli.progress import byte_progress  # lazy: not loaded by ckpt --help

        return byte_progress(description, enabled=not (self.quiet or self.json))


STREAMING = ("max_memory", "quiet", "storage_option", "concurrency", "json")
"""The common options of the commands that stream tensors (validate, diff, convert,
consolidate)."""


def common_options(*names: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Give a command the :class:`Common` options ``names``, after its own options.

    The command declares a keyword-only ``common: Common`` parameter instead of one parameter
    per option; typer reads the returned function's signature, which has the options in its
    place.

    Raises:
        TypeError: For a name that is not a field of :class:`Common`.
    """
    hints = typing.get_type_hints(Common, include_extras=True)
    fields = [f for f in dataclasses.fields(Common) if f.name in names]
    if len(fields) != len(names):
        raise TypeError(f"not common options: {sorted(set(names) - {f.name for f in fields})}")
    added = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                               annotation=hints[f.name]) for f in fields]

    def decorate(command: Callable[..., None]) -> Callable[..., None]:
        own = inspect.signature(command, eval_str=True)
        signature = own.replace(parameters=[
            *(p for p in own.parameters.values() if p.name != "common"), *added])

        @functools.wraps(command)
        def run(**kwargs: Any) -> None:
            common = Common(**{name: kwargs.pop(name) for name in names})
            command(**kwargs, common=common)

        run.__signature__ = signature  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in signature.parameters.values()}
        run.__annotations__["return"] = signature.return_annotation
        return run

    return decorate


def _cli_type(hint: Any) -> tuple[Any, bool]:
    """The type typer parses an option's value as, from the field's type: ``Literal`` values
    as text (the op checks them), repeatable options (a tuple) as a list; and whether the
    field is a tuple."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    optional = len(args) < len(typing.get_args(hint))
    base = args[0] if optional and len(args) == 1 else hint
    if typing.get_origin(base) is typing.Literal:
        base = type(typing.get_args(base)[0])
    if typing.get_origin(base) is tuple:
        return list[str] | None, True
    return (base | None if optional else base), False


_KIND_PARSERS: dict[str, Callable[[str, bool], Callable[[Any], Any]]] = {
    # An empty value is refused, as the API refuses it (--max-total-size "" must not drop
    # a rule).
    "size": lambda flag, zero: size_parser(flag, allow_zero=zero),
    "duration": lambda flag, zero: duration_parser(flag, allow_zero=zero),
    "count": lambda flag, zero: whole_parser(flag),
    "rate": lambda flag, zero: rate_parser(flag),
}


def _size_as_typed(value: int) -> str:
    """A size default as a user types it: ``5GB`` (the largest decimal unit that divides it;
    else the plain number of bytes)."""
    for unit, factor in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if value % factor == 0:
            return f"{value // factor}{unit}"
    return str(value)


def _option_parameter(f: dataclasses.Field[Any], spec: Any, hint: Any,
                      flags: list[str]) -> inspect.Parameter:
    """The typer parameter of one declared option."""

    annotation, _ = _cli_type(hint)
    default = f.default if f.default is not dataclasses.MISSING else None
    if isinstance(default, tuple):
        default = None
    if spec.kind == "size" and isinstance(default, int) and default:
        # Shown as typed (5GB, not 5000000000), which the parser reads as a given value.
        annotation, default = Any, _size_as_typed(default)
    how: dict[str, Any] = {"help": word(spec.help, "cli"), "metavar": spec.metavar,
                           "show_default": default is not None and default not in ((), False)}
    if spec.kind == "duration" and isinstance(default, (int, float)) and default:
        from ckpt_cli.units import format_duration  # lazy: only where a duration is declared

        # The default as typed (10m, not 600.0), which the parser reads as a given value.
        annotation, default = Any, format_duration(default)
    if default is True:  # a switch on by default: --metadata/--no-metadata, which say it
        flags = [f"{flags[0]}/--no-{f.name.replace('_', '-')}", *flags[1:]]
        how["show_default"] = False
    if spec.min is not None:
        how["min"] = spec.min
    if spec.kind in _KIND_PARSERS:
        how["parser"] = _KIND_PARSERS[spec.kind](flag_of(f.name), spec.allow_zero)
    elif spec.kind == "part":
        annotation, how["parser"] = Any, part_parser
    elif spec.kind == "path":
        annotation, how["parser"] = Location, location
    # The Literal's values: the type itself (to: ConvertTarget), or one of a union's members
    # (output_format: OutputFormat | None).
    literal = next((a for a in (hint, *typing.get_args(hint))
                    if typing.get_origin(a) is typing.Literal), None)
    choices = typing.get_args(literal) if literal is not None else ()
    if choices:
        how["autocompletion"] = lambda incomplete: [c for c in choices
                                                    if c.startswith(incomplete)]
    return inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default,
                             annotation=Annotated[annotation, typer.Option(*flags, **how)])


def from_options(cls: type) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Give a command one option per field :func:`ckpt_cli.optionspec.option` declares in
    the options dataclass ``cls``: flag ``--`` + the field's name with dashes, its short flag
    and aliases, its default and help. The command declares a keyword-only ``options: cls``
    parameter and gets the values as one ``cls`` instance.
    """

    hints = typing.get_type_hints(cls)
    declared = [(f, s) for f, s in options_of(cls) if s.cli]
    added = [_option_parameter(f, s, hints[f.name],
                               [flag_of(f.name) + (f"/{s.off}" if s.off else ""),
                                *([s.short] if s.short else []), *s.aliases])
             for f, s in declared]
    tuples = {f.name for f, _ in declared if _cli_type(hints[f.name])[1]}

    def decorate(command: Callable[..., None]) -> Callable[..., None]:
        own = inspect.signature(command, eval_str=True)
        rest = [p for p in own.parameters.values() if p.name != "options"]
        positional = [p for p in rest if p.kind is not inspect.Parameter.KEYWORD_ONLY]
        keyword = [p for p in rest if p.kind is inspect.Parameter.KEYWORD_ONLY]
        signature = own.replace(parameters=[*positional, *added, *keyword])

        @functools.wraps(command)
        def run(**kwargs: Any) -> None:
            values = {f.name: kwargs.pop(f.name) for f, _ in declared}
            for name in tuples:
                values[name] = tuple(values[name] or ())
            command(**kwargs, options=cls(**values))

        run.__signature__ = signature  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in signature.parameters.values()}
        run.__annotations__["return"] = signature.return_annotation
        return run

    return decorate
