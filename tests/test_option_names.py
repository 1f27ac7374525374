"""One name per option (issue 47): an op's options dataclass declares each option once
(``ckpt_cli/optionspec.py``); the command line's flag is the field's name with dashes and the
Python API's keyword is the field's name, with the field's default and help."""

from __future__ import annotations

import dataclasses
import inspect
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import typer.main
from safetensors.numpy import save_file

import ckpt_cli
from ckpt_cli.cli.app import app
from ckpt_cli.ops.options.inspect import InspectOptions
from ckpt_cli.optionspec import docstring_args, flag, options_of, spelled, word
from tests.conftest import run_cli

# (command, API function, its options dataclass): the commands whose options are declared.
DECLARED: list[tuple[str, Any, type]] = [
    ("inspect", ckpt_cli.inspect, InspectOptions),
]

# API keywords that are no option of the command line, each for a reason.
API_ONLY = {
    # A mapping of fsspec settings; the command line takes them one by one, repeatable:
    # --storage-option KEY=VALUE (a Python caller gives a dict, a shell one string each).
    "storage_options",
    # Python callables: no command line can give one.
    "on_progress", "on_event",
}
# Command-line flags that are no API keyword, each for a reason.
CLI_ONLY = {
    "json": "the output's form: the API returns the result, whose to_dict() is this document",
    "quiet": "progress bars and notes on stderr: the API prints nothing",
    "verbose": "more rows in the human report: the API returns every row",
    "yes": "answers the confirmation prompt: the API never asks (dry_run says what it does)",
    "all_rows": "how many rows the human report prints: the API returns every row",
    "storage_option": "the API's storage_options, one KEY=VALUE at a time (see API_ONLY)",
}


def _cli_options(name: str) -> dict[str, list[str]]:
    command = typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]
    return {p.name: p.opts for p in command.params if p.param_type_name == "option"
            and not p.hidden}


@pytest.mark.parametrize(("name", "api", "options"), DECLARED, ids=[d[0] for d in DECLARED])
def test_every_keyword_is_a_field_and_a_flag_of_the_same_name(name: str, api: Any,
                                                               options: type) -> None:
    keywords = {k: p for k, p in inspect.signature(api).parameters.items()
                if p.kind is inspect.Parameter.KEYWORD_ONLY and k not in API_ONLY}
    fields = {f.name: f for f, _ in options_of(options)}
    assert set(keywords) == set(fields)
    for k, p in keywords.items():
        default = fields[k].default
        assert p.default == (None if default == () else default), k
    cli = _cli_options(name)
    assert set(cli) - set(CLI_ONLY) == set(fields)
    for k, opts in cli.items():
        assert flag(k) in opts, (k, opts)


@pytest.mark.parametrize(("name", "api", "options"), DECLARED, ids=[d[0] for d in DECLARED])
def test_the_help_is_written_once(name: str, api: Any, options: type) -> None:
    assert docstring_args(options).strip() in api.__doc__
    command = typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]
    helps = {p.name: p.help for p in command.params}
    for f, s in options_of(options):
        assert helps[f.name] == word(s.help, "cli")


def test_callers_spell_options_their_own_way() -> None:
    assert spelled("keep", "cli", 2) == "--keep 2"
    assert spelled("keep", "python", 2) == "keep=2"
    assert word("newest 2 (`keep=2`), not `keep_every`", "cli") == \
        "newest 2 (--keep 2), not --keep-every"
    assert word("newest 2 (`keep=2`), not `keep_every`", "python") == \
        "newest 2 (keep=2), not keep_every"


def _model(tmp_path: Path) -> Path:
    path = tmp_path / "m.safetensors"
    import numpy as np

    save_file({"a.attn.w": np.zeros((2, 2), np.float32), "b.mlp.w": np.ones(3, np.float32)},
              str(path))
    return path


def test_a_renamed_keyword_still_works_with_a_warning(tmp_path: Path) -> None:
    path = _model(tmp_path)
    new = ckpt_cli.inspect(path, name_glob="*.attn.*").to_dict()
    with pytest.warns(DeprecationWarning, match=r"inspect\(filter=...\) is deprecated.*"
                                                r"name_glob="):
        old = ckpt_cli.inspect(path, filter="*.attn.*").to_dict()  # type: ignore[call-arg]
    assert old == new and [t["name"] for t in new["tensors"]] == ["a.attn.w"]
    with warnings.catch_warnings(), pytest.raises(TypeError, match="both filter= and name_glob"):
        warnings.simplefilter("ignore")
        ckpt_cli.inspect(path, filter="x", name_glob="y")  # type: ignore[call-arg]


def test_a_renamed_flag_keeps_its_old_name_as_an_alias(tmp_path: Path) -> None:
    path = _model(tmp_path)
    docs = [json.loads(run_cli("inspect", path, how, "*.attn.*", "--json").stdout)
            for how in ("--name-glob", "--filter")]
    assert docs[0] == docs[1] and [t["name"] for t in docs[0]["tensors"]] == ["a.attn.w"]


def test_declarations_are_dataclass_fields() -> None:
    assert [f.name for f, _ in options_of(InspectOptions)] == \
        [f.name for f in dataclasses.fields(InspectOptions)]


def table_row(param: Any) -> str:
    """The docs page's options-table row of a declared option (``docs/<command>.md``)."""
    long = [o for o in param.opts if o.startswith("--")]
    names = ", ".join(f"`{o}`" for o in [long[0], *param.secondary_opts,
                                         *(o for o in param.opts if not o.startswith("--")),
                                         *long[1:]])
    metavar = f" `{param.metavar}`" if param.metavar and not param.is_flag else ""
    default = f" Default: `{param.default}`." if param.show_default else ""
    return f"| {names}{metavar} | {param.help}{default} |"


@pytest.mark.parametrize(("name", "api", "options"), DECLARED, ids=[d[0] for d in DECLARED])
def test_the_docs_table_rows_are_the_declarations(name: str, api: Any, options: type) -> None:
    command = typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]
    page = (Path(__file__).parents[1] / "docs" / f"{name}.md").read_text()
    params = {p.name: p for p in command.params}
    missing = [table_row(params[f.name]) for f, _ in options_of(options)
               if table_row(params[f.name]) not in page]
    assert not missing, "\n".join(missing)
