"""The Python API's surface is recorded (tests/api/api_surface.json): a public function, a
parameter (its kind and default) or a result's field removed or changed fails here, unless it
is deprecated first (:data:`DEPRECATED`); one added fails until it is recorded
(``pytest tests/api --update-golden``) and documented in docs/python.md."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import ckpt_cli

SNAPSHOT = Path(__file__).with_name("api_surface.json")
DOCS = Path(__file__).resolve().parents[2] / "docs" / "python.md"
FUNCTION_PAGES = DOCS.with_suffix("")  # docs/python/: a page per function

# The result each function returns, by module and name (what the docs describe).
RESULTS = {"inspect": "ckpt_cli.ops.inspect:InspectResult",
           "validate": "ckpt_cli.ops.validate.result:ValidateResult",
           "diff": "ckpt_cli.ops.diff.result:DiffResult",
           "convert": "ckpt_cli.ops.convert:ConvertResult",
           "consolidate": "ckpt_cli.ops.consolidate:ConsolidateResult",
           "prune": "ckpt_cli.ops.prune.result:PruneResult",
           "plan": "ckpt_cli.ops.plan.result:PlanResult",
           "stats": "ckpt_cli.ops.stats.result:StatsResult",
           "resume_path": "ckpt_cli.api.results:ResumePathResult",
           "watch_once": "ckpt_cli.api.results:WatchResult"}

# "function", "function.parameter" or "Result.field" -> the version that removes it. A name
# may leave the API only after a release in which it warned (DeprecationWarning) and was
# listed here.
DEPRECATED: dict[str, str] = {}


def _result(spec: str) -> type:
    module, _, name = spec.partition(":")
    cls: type = getattr(importlib.import_module(module), name)
    return cls


def _members(cls: type) -> list[str]:
    """A result's public fields, properties and methods."""
    names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    for klass in cls.__mro__:
        if klass is object:
            continue
        names |= {n for n, v in vars(klass).items() if not n.startswith("_")
                  and (isinstance(v, property) or inspect.isfunction(v))}
    return sorted(names)


def surface() -> dict[str, Any]:
    """The API as it is: each function's parameters (kind, default) and its result's members."""
    out: dict[str, Any] = {"functions": {}, "results": {}}
    for name in ckpt_cli.COMMANDS:
        sig = inspect.signature(getattr(ckpt_cli, name))
        out["functions"][name] = {
            p.name: {"kind": p.kind.name,
                     "default": None if p.default is p.empty else repr(p.default),
                     "required": p.default is p.empty}
            for p in sig.parameters.values()}
        cls = _result(RESULTS[name])
        out["results"][cls.__name__] = _members(cls)
    return out


def test_the_surface_is_recorded(request: pytest.FixtureRequest) -> None:
    now = surface()
    if request.config.getoption("--update-golden"):
        SNAPSHOT.write_text(json.dumps(now, indent=2, sort_keys=True) + "\n")
    recorded = json.loads(SNAPSHOT.read_text())
    problems = []
    for fn, params in recorded["functions"].items():
        if fn not in now["functions"]:
            if fn not in DEPRECATED:
                problems.append(f"function {fn} removed without a deprecation")
            continue
        for p, how in params.items():
            key = f"{fn}.{p}"
            got = now["functions"][fn].get(p)
            if got is None and key not in DEPRECATED:
                problems.append(f"parameter {key} removed without a deprecation")
            elif got is not None and got != how:
                problems.append(f"parameter {key} changed: {how} -> {got}")
    problems += [f"result field {cls}.{m} removed without a deprecation"
                 for cls, members in recorded["results"].items() for m in members
                 if m not in now["results"].get(cls, []) and f"{cls}.{m}" not in DEPRECATED]
    added = [f"{fn}.{p}" for fn, params in now["functions"].items() for p in params
             if p not in recorded["functions"].get(fn, {})]
    added += [f"{cls}.{m}" for cls, members in now["results"].items() for m in members
              if m not in recorded["results"].get(cls, [])]
    if added:
        problems.append(f"not recorded yet (document them in docs/python.md, then run pytest "
                        f"tests/api --update-golden): {', '.join(added)}")
    assert not problems, "\n".join(problems)


def test_the_check_sees_a_removal(monkeypatch: pytest.MonkeyPatch) -> None:
    """A parameter dropped from a function is seen (the snapshot test would fail)."""
    def validate(path: str) -> None:
        """Stand-in without validate's options."""

    from ckpt_cli.api import commands

    monkeypatch.setattr(commands, "validate", validate)
    assert surface()["functions"]["validate"].keys() == {"path"}
    assert "strict" in json.loads(SNAPSHOT.read_text())["functions"]["validate"]


def test_every_function_and_parameter_is_documented(request: pytest.FixtureRequest) -> None:
    """docs/python.md has a section per function naming each of its parameters, generated from
    the docstrings (``--update-golden`` writes it), and each docstring has the one style:
    summary, Args (every parameter), Returns, Raises, Example."""
    from tests.api.python_md import MARKER, functions, pages

    docs = DOCS.read_text()
    page, _, section = docs.partition(MARKER)
    generated = pages()
    if request.config.getoption("--update-golden"):
        DOCS.write_text(page + functions())
        FUNCTION_PAGES.mkdir(exist_ok=True)
        for name, text in generated.items():
            (FUNCTION_PAGES / name).write_text(text)
        for old in set(os.listdir(FUNCTION_PAGES)) - set(generated):
            (FUNCTION_PAGES / old).unlink()
        docs = DOCS.read_text()
    else:
        assert MARKER + section == functions(), (
            "docs/python.md's Functions section is not what the docstrings say: run pytest "
            "tests/api --update-golden and review the change")
        assert sorted(os.listdir(FUNCTION_PAGES)) == sorted(generated), (
            "docs/python/ is not one page per function: run pytest tests/api --update-golden")
        for name, text in generated.items():
            assert (FUNCTION_PAGES / name).read_text() == text, (
                f"docs/python/{name} is not what the docstring says: run pytest tests/api "
                "--update-golden and review the change")
    for name in ckpt_cli.COMMANDS:
        fn = getattr(ckpt_cli, name)
        head = f"`ckpt_cli.{name}("
        section = (FUNCTION_PAGES / f"{name}.md").read_text()
        assert section.startswith(f"# {head}"), f"docs/python/{name}.md has no '# {head}...'"
        assert f"(python/{name}.md)" in docs, f"docs/python.md does not link {name}'s page"
        doc = inspect.getdoc(fn) or ""
        for part in ("Args:", "Returns:", "Raises:", "Example:"):
            assert f"\n{part}\n" in doc, f"{name}'s docstring has no {part}"
        for p in inspect.signature(fn).parameters:
            assert f"`{p}`" in section, f"docs/python/{name}.md does not name `{p}`"
            assert f"\n    {p}: " in doc, f"{name}'s docstring does not describe {p}"
    docs += "".join(generated.values())
    for cls in surface()["results"]:
        assert f"`{cls}`" in docs, f"docs/python.md (or a function's page) does not name {cls}"


@pytest.mark.requires_torch  # the sample run is written with torch
def test_import_is_cheap_and_calls_load_no_torch_typer_or_rich(sample_run: Path) -> None:
    """``import ckpt_cli`` loads no command code; ``ckpt_cli.validate(run).ok`` (the README's
    quick start) works and loads neither torch nor typer nor rich, nor do the other read-only
    commands."""
    code = (
        "import sys, ckpt_cli\n"
        "assert not [m for m in sys.modules if m.startswith(('ckpt_cli.api', 'ckpt_cli.ops'))]\n"
        f"run = {str(sample_run)!r}\n"
        "print(ckpt_cli.validate(run).ok)\n"
        "ckpt_cli.inspect(run, tree=True).to_dict()\n"
        "ckpt_cli.diff(run + '/step_000100', run + '/step_000200').to_dict()\n"
        "ckpt_cli.prune(run, keep=1).to_dict()\n"
        "ckpt_cli.plan(params='7B', bandwidth='1GB/s', mtbf='4h').to_dict()\n"
        "ckpt_cli.resume_path(run).to_dict()\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'typer', 'rich', "
        "'click'}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=sample_run.parent).stdout
    assert out.split("\n")[:2] == ["True", "[]"], out


def _python_blocks(text: str) -> list[str]:
    import re
    import textwrap

    return [textwrap.dedent(b) for b in re.findall(r"```python\n(.*?)```", text, re.S)]


@pytest.mark.requires_torch  # the sample run is written with torch
@pytest.mark.parametrize("page", ["docs/python.md", "README.md"])
def test_the_examples_run(page: str, sample_run: Path, tmp_path: Path,
                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Every Python example of docs/python.md (the docstrings' examples among them) and of the
    README's Python API section runs, in order, on a copy of the quick start's demo-run."""
    import shutil

    text = (DOCS.parents[1] / page).read_text()
    if page == "docs/python.md":  # then each function's page, in the index's order
        from tests.api.python_md import ORDER

        text += "".join((FUNCTION_PAGES / f"{name}.md").read_text() for name in ORDER)
        text += "".join((DOCS.parent / f"python-{name}.md").read_text()
                        for name in ("open", "types"))
    if page == "README.md":
        text = text.split("## Python API", 1)[1].split("\n## ", 1)[0]
    blocks = [b for b in _python_blocks(text) if "ckpt_cli." in b]
    assert blocks
    shutil.copytree(sample_run, tmp_path / "demo-run", symlinks=True)
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {}
    for block in blocks:
        exec(compile(block, page, "exec"), namespace)
    # What the examples write is there.
    wrote = {"README.md": ["model"],
             "docs/python.md": ["model", "model-fp16", "model-bf16", "step400-full"]}[page]
    assert all((tmp_path / name).is_dir() for name in wrote), sorted(os.listdir(tmp_path))
