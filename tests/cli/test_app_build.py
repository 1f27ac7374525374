"""A run that names its command builds that command alone (``cli/app.py::build``): typer
converts every registered command's signature on each run. The one-command app must answer
exactly as the whole one does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpt_cli.cli.app import COMMANDS, app, build, named_command

ROOT = Path(__file__).parents[2]
NAMES = [name for name, _, _ in COMMANDS]


def _invoke(target: object, args: list[str]) -> tuple[int, str, str]:
    r = CliRunner().invoke(target, args, prog_name="ckpt")  # type: ignore[arg-type]
    return r.exit_code, r.stdout, r.stderr


def test_the_whole_app_has_every_command_in_order() -> None:
    assert [c.name for c in app.registered_commands] == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_one_command_app_answers_as_the_whole_app(name: str, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    if name == "sample":
        # ``sample {} --json`` writes a sample run, twice: the same files without its 400
        # training steps and its 4-process save (tests/ops/inspect/test_sample.py runs those).
        monkeypatch.setattr("ckpt_cli.ops.sample._train", lambda *_a, **_k: 0.0)
        monkeypatch.setattr("ckpt_cli.ops.sample._save_dcp",
                            lambda _m, _o, out, _x: out.mkdir())
    one = build(name)
    assert [c.name for c in one.registered_commands] == [name]
    for args in ([name, "--help"], [name, "--no-such-flag"], [name, "{}", "--json"], [name]):
        # "{}": a path in a directory that does not exist (one per app: no run sees another's).
        answers = []
        for target, where in ((one, "one"), (app, "all")):
            base = str(tmp_path / where)
            code, out, err = _invoke(target, [a.replace("{}", base + "/missing") for a in args])
            answers.append((code, out.replace(base, "{}"), err.replace(base, "{}")))
        assert answers[0] == answers[1], args


@pytest.mark.parametrize("argv, expected", [
    (["inspect", "x"], "inspect"), (["resume-path", "r"], "resume-path"),
    (["--version"], None), (["--help"], None), ([], None), (["inspectx"], None),
    (["x", "inspect"], None)])
def test_named_command(argv: list[str], expected: str | None,
                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("_CKPT_COMPLETE", raising=False)
    assert named_command(argv) == expected


def test_shell_completion_gets_the_whole_app(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("_CKPT_COMPLETE", "complete_bash")
    assert named_command(["inspect", "x"]) is None


def _command_modules_after(argv: list[str]) -> list[str]:
    code = ("import sys\n"
            f"sys.argv = ['ckpt', *{argv!r}]\n"
            "from ckpt_cli.cli.app import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "names = {'errors', 'options', 'app'}\n"
            "import json\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('ckpt_cli.cli.')"
            " and m.split('.')[2] not in names)), file=sys.stderr)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       check=True, timeout=120)
    names: list[str] = json.loads(r.stderr.strip().splitlines()[-1])
    return names


def test_a_named_command_imports_its_module_only() -> None:
    assert _command_modules_after(["inspect", "--help"]) == ["ckpt_cli.cli.inspect"]
    assert _command_modules_after(["resume-path", "--help"]) == ["ckpt_cli.cli.watch"]


def test_help_and_root_options_get_every_command() -> None:
    every = sorted({f"ckpt_cli.cli.{module}" for _, module, _ in COMMANDS})
    assert _command_modules_after(["--help"]) == every
    assert _command_modules_after(["--version", "inspect"]) == every
