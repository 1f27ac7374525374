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
from ckpt_cli.ops.options.consolidate import ConsolidateOptions
from ckpt_cli.ops.options.convert import ConvertOptions
from ckpt_cli.ops.options.diff import DiffOptions
from ckpt_cli.ops.options.inspect import InspectOptions
from ckpt_cli.ops.options.plan import PlanOptions
from ckpt_cli.ops.options.prune import PruneOptions
from ckpt_cli.ops.options.resume import ResumePathOptions
from ckpt_cli.ops.options.sample import SampleOptions
from ckpt_cli.ops.options.stats import StatsOptions
from ckpt_cli.ops.options.validate import ValidateOptions
from ckpt_cli.ops.options.watch import WatchOptions
from ckpt_cli.optionspec import docstring_args, flag, options_of, spelled, word
from tests.conftest import run_cli

# (command, API function, its options dataclass): the commands whose options are declared
# (sample has no API function: it trains a model for the other commands to read).
DECLARED: list[tuple[str, Any, type]] = [
    ("inspect", ckpt_cli.inspect, InspectOptions),
    ("plan", ckpt_cli.plan, PlanOptions),
    ("validate", ckpt_cli.validate, ValidateOptions),
    ("diff", ckpt_cli.diff, DiffOptions),
    ("stats", ckpt_cli.stats, StatsOptions),
    ("watch", ckpt_cli.watch_once, WatchOptions),
    ("sample", None, SampleOptions),
    ("convert", ckpt_cli.convert, ConvertOptions),
    ("consolidate", ckpt_cli.consolidate, ConsolidateOptions),
    ("prune", ckpt_cli.prune, PruneOptions),
    ("resume-path", ckpt_cli.resume_path, ResumePathOptions),
]

# API keywords that are no option of the command line, each for a reason.
API_ONLY = {
    # A mapping of fsspec settings; the command line takes them one by one, repeatable:
    # --storage-option KEY=VALUE (a Python caller gives a dict, a shell one string each).
    "storage_options",
    # Python callables: no command line can give one.
    "on_progress", "on_event",
}
# A keyword and a flag of the same name that are no option of the op, each for a reason.
NOT_FIELDS = {
    ("prune", "dry_run"): "whether the call deletes, with defaults of its own: the API never "
                          "asks, so it only plans unless told dry_run=False; the command line "
                          "asks (or --yes), and --dry-run stops after the plan",
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
    own = {k for (c, k) in NOT_FIELDS if c == name}  # API keywords that are no field
    fields = {f.name: f for f, _ in options_of(options)}
    if api is not None:
        keywords = {k: p for k, p in inspect.signature(api).parameters.items()
                    if p.kind is inspect.Parameter.KEYWORD_ONLY and k not in API_ONLY | own}
        assert own <= set(inspect.signature(api).parameters)
        assert set(keywords) == set(fields)
        for k, p in keywords.items():
            default = fields[k].default
            assert p.default == (None if default == () else default), k
    cli = _cli_options(name)
    not_shared = {k for (c, k) in NOT_SHARED if c == name}  # the command line's own
    assert set(cli) - set(CLI_ONLY) - not_shared - own == set(fields)
    assert own <= set(cli)
    for k, opts in cli.items():
        assert flag(k) in opts, (k, opts)


@pytest.mark.parametrize(("name", "api", "options"), DECLARED, ids=[d[0] for d in DECLARED])
def test_the_help_is_written_once(name: str, api: Any, options: type) -> None:
    if api is not None:
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


# Fields of an options dataclass that are no option, each for a reason.
NOT_OPTIONS = {
    (DiffOptions, "block"): "elements per block of the value comparison: a knob for tests",
    (WatchOptions, "report_pending"): "set by --once and watch_once(), not an option",
    (WatchOptions, "caller"): "who the messages name options for: set by the caller",
}


@pytest.mark.parametrize("options", [d[2] for d in DECLARED], ids=[d[0] for d in DECLARED])
def test_declarations_are_dataclass_fields(options: type) -> None:
    assert [f.name for f, _ in options_of(options)] == \
        [f.name for f in dataclasses.fields(options) if (options, f.name) not in NOT_OPTIONS]


def table_row(param: Any) -> str:
    """The docs page's options-table row of a declared option (``docs/<command>.md``)."""
    long = [o for o in param.opts if o.startswith("--")]
    names = ", ".join(f"`{o}`" for o in [long[0], *param.secondary_opts,
                                         *(o for o in param.opts if not o.startswith("--")),
                                         *long[1:]])
    metavar = f" `{param.metavar}`" if param.metavar and not param.is_flag else ""
    default = f" Default: `{param.default}`." if param.show_default else ""
    text = param.help.replace("|", "\\|")  # a pipe in a cell ends it, unless escaped
    return f"| {names}{metavar} | {text}{default} |"


@pytest.mark.parametrize(("name", "api", "options"), DECLARED, ids=[d[0] for d in DECLARED])
def test_the_docs_table_rows_are_the_declarations(name: str, api: Any, options: type) -> None:
    command = typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]
    page = (Path(__file__).parents[1] / "docs" / f"{name}.md").read_text()
    params = {p.name: p for p in command.params}
    missing = [table_row(params[f.name]) for f, _ in options_of(options)
               if table_row(params[f.name]) not in page]
    assert not missing, "\n".join(missing)


def _run(tmp_path: Path) -> Path:
    import numpy as np

    run = tmp_path / "run"
    for step in (1, 2, 3):
        (run / f"checkpoint-{step}").mkdir(parents=True)
        save_file({"w": np.ones(4, np.float32)},
                  str(run / f"checkpoint-{step}" / "model.safetensors"))
    return run


def test_prune_reasons_name_options_as_the_caller_does(tmp_path: Path) -> None:
    run = _run(tmp_path)
    python = [r for c in ckpt_cli.prune(run, keep=1, grace=0).to_dict()["checkpoints"]
              for r in c["reasons"]]
    assert any("(keep=1)" in r for r in python) and not any("--" in r for r in python)
    r = run_cli("prune", run, "--keep", "1", "--grace", "0", "--dry-run", "--json")
    cli = [x for c in json.loads(r.stdout)["checkpoints"] for x in c["reasons"]]
    assert cli == [x.replace("(keep=1)", "(--keep 1)") for x in python]
    human = run_cli("prune", run, "--keep", "1", "--grace", "0", "--dry-run").stdout
    assert "(--keep 1)" in human and "`" not in human and "keep=1" not in human


def test_the_overwrite_hint_names_one_option(tmp_path: Path) -> None:
    src = _model(tmp_path)
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"x")
    with pytest.raises(FileExistsError) as e:
        ckpt_cli.convert(src, out)
    assert e.value.hint == "pass overwrite to replace it"  # type: ignore[attr-defined]
    r = run_cli("convert", src, "-o", out)
    assert r.exit_code == 2 and r.stderr.splitlines()[-1] == "hint: pass --overwrite to replace it"
    with pytest.warns(DeprecationWarning, match=r"convert\(force=...\).*overwrite="):
        ckpt_cli.convert(src, out, force=True)  # type: ignore[call-arg]
    assert out.stat().st_size > 1
    for flag_ in ("--overwrite", "--force"):
        assert run_cli("convert", src, "-o", out, flag_).exit_code == 0


@pytest.mark.parametrize(("command", "old", "new", "value"), [
    ("stats", "filter", "name_glob", "*.attn.*"), ("stats", "all", "all_tensors", True),
    ("diff", "filter", "name_glob", "*.attn.*"), ("diff", "all", "all_tensors", True),
    ("convert", "format", "output_format", "safetensors"),
    ("convert", "force", "overwrite", True),
    ("consolidate", "format", "output_format", "safetensors"),
    ("consolidate", "force", "overwrite", True), ("plan", "measure", "measure_dir", "x"),
])
def test_no_keyword_shadows_a_builtin_and_old_ones_still_work(command: str, old: str,
                                                              new: str, value: Any) -> None:
    api = getattr(ckpt_cli, command)
    keywords = inspect.signature(api).parameters
    assert new in keywords and old not in keywords
    assert api.deprecated_keywords[old] == new
    cli = _cli_options(command)
    assert flag(new) in cli[new]


def test_no_api_keyword_shadows_a_builtin() -> None:
    import builtins

    for name in ("inspect", "validate", "diff", "stats", "convert", "consolidate", "prune",
                 "plan", "resume_path", "watch_once"):
        shadowing = [k for k in inspect.signature(getattr(ckpt_cli, name)).parameters
                     if hasattr(builtins, k)]
        assert not shadowing, (name, shadowing)


def _every_command() -> list[tuple[str, str]]:
    return [(c, a) for c, a in (("inspect", "inspect"), ("validate", "validate"),
                                ("diff", "diff"), ("stats", "stats"), ("convert", "convert"),
                                ("consolidate", "consolidate"), ("prune", "prune"),
                                ("plan", "plan"), ("resume-path", "resume_path"),
                                ("watch", "watch_once"))]


# Flags of a command that are no keyword of its API function yet, or the other way round,
# each for a reason (beyond CLI_ONLY and API_ONLY).
NOT_SHARED = {
    ("validate", "junit"): "a report file the command line writes; the API returns the result",
    ("diff", "exit_zero"): "the exit status: the API returns the result (result.identical)",
    ("diff", "top"): "rows per table of the human report",
    ("stats", "top"): "rows per table of the human report",
    ("stats", "sort"): "order of the human report's rows",
    ("stats", "plot"): "a figure file the command line draws from the result",
    ("convert", "output"): "the API's second argument (-o on the command line)",
    ("consolidate", "output"): "the API's second argument (-o on the command line)",
    ("watch", "once"): "watch_once() is one pass; the command line loops without --once",
    ("watch", "interval"): "time between passes of the loop, which the API leaves to its caller",
    ("watch", "wake"): "what wakes the loop between passes (see interval)",
}


@pytest.mark.parametrize(("command", "api_name"), _every_command())
def test_every_keyword_is_a_flag_of_the_same_name(command: str, api_name: str) -> None:
    keywords = {k for k, p in inspect.signature(getattr(ckpt_cli, api_name)).parameters.items()
                if p.kind is inspect.Parameter.KEYWORD_ONLY} - API_ONLY
    cli = _cli_options(command)
    for k, opts in cli.items():
        assert flag(k) in opts, (command, k, opts)  # the flag is the parameter's name
    shared = {k for (c, k) in NOT_SHARED if c == command}
    assert all((k in keywords) != (k in cli) for k in shared), "NOT_SHARED is out of date"
    assert keywords - set(cli) - shared == set(), command
    assert set(cli) - keywords - set(CLI_ONLY) - shared == set(), command


def test_diff_and_stats_old_names_still_work(tmp_path: Path) -> None:
    path = _model(tmp_path)
    new = ckpt_cli.stats(path, name_glob="*.attn.*", no_cache=True).to_dict()
    with pytest.warns(DeprecationWarning, match=r"stats\(filter=...\) is deprecated"):
        old = ckpt_cli.stats(path, filter="*.attn.*", no_cache=True)  # type: ignore[call-arg]
    assert [t["name"] for t in old.to_dict()["tensors"]] == \
        [t["name"] for t in new["tensors"]] == ["a.attn.w"]
    with pytest.warns(DeprecationWarning, match=r"diff\(all=...\) is deprecated"):
        assert ckpt_cli.diff(path, path, all=True).equal  # type: ignore[call-arg]
    docs = [json.loads(run_cli("diff", path, path, *how, "--json").stdout)
            for how in (("--name-glob", "b.*", "--all-tensors"), ("--filter", "b.*", "--all"))]
    assert docs[0] == docs[1] and docs[0]["summary"]["identical"] == 1


def test_a_switch_on_by_default_has_its_no_flag(tmp_path: Path) -> None:
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    import numpy as np

    for path, step in ((a, "1"), (b, "2")):
        save_file({"w": np.ones(2, np.float32)}, str(path), metadata={"step": step})
    assert run_cli("diff", a, b, "--metadata").exit_code == 1
    assert run_cli("diff", a, b, "--no-metadata").exit_code == 0
    assert ckpt_cli.diff(a, b, metadata=False).equal


def test_a_duration_default_is_shown_and_read_as_typed() -> None:
    command = typer.main.get_command(app).commands["watch"]  # type: ignore[attr-defined]
    params = {p.name: p for p in command.params}
    assert (params["settle"].default, params["grace"].default) == ("1s", "10m")
    assert WatchOptions().grace == 600.0 and params["grace"].type_cast_value(
        typer.main.get_command(app).make_context("ckpt", ["watch", "x"]), "10m") == 600.0


def test_plan_notes_name_options_as_the_caller_does() -> None:
    python = ckpt_cli.plan(params="7B").to_dict()["notes"]
    assert "give bandwidth or measure_dir for the write time and the optimal interval" in python
    assert not any("--" in n for n in python)
    r = run_cli("plan", "--params", "7B", "--json")
    assert json.loads(r.stdout)["notes"] == [
        n.replace("bandwidth or measure_dir", "--bandwidth or --measure-dir")
        .replace("mtbf, or gpus with gpu_mtbf", "--mtbf, or --gpus with --gpu-mtbf")
        for n in python]
    human = run_cli("plan", "--params", "7B").stderr
    assert "note: give --bandwidth or --measure-dir for" in human and "`" not in human


def test_convert_notes_name_options_as_the_caller_does(tmp_path: Path) -> None:
    src = _model(tmp_path)
    python = ckpt_cli.convert(src, tmp_path / "a.safetensors", to="fp16",
                              keep_fp32="*norm*").to_dict()["notes"]
    assert "keep_fp32 '*norm*' matched no tensor of the output" in python
    r = run_cli("convert", src, "-o", tmp_path / "b.safetensors", "--to", "fp16",
                "--keep-fp32", "*norm*", "--json")
    assert json.loads(r.stdout)["notes"] == [n.replace("keep_fp32", "--keep-fp32")
                                              for n in python]


def test_the_old_format_keyword_and_flag_still_work(tmp_path: Path) -> None:
    src = _model(tmp_path)
    with pytest.warns(DeprecationWarning, match=r"convert\(format=...\).*output_format="):
        ckpt_cli.convert(src, tmp_path / "x", format="pt")  # type: ignore[call-arg]
    assert (tmp_path / "x" / "pytorch_model.bin").is_file()
    r = run_cli("convert", src, "-o", tmp_path / "y", "--format", "pt", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["files"][0]["path"] == "pytorch_model.bin"
