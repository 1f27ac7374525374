"""The library names parameters, never the CLI's flags, in its errors and hints.

A ``CkptError`` says ``max_memory must be at least 64MiB`` and lists ``max_memory`` in
``e.params``; ``ckpt_cli/cli/errors.py`` writes ``--max-memory`` in its place when the command
line reports it (see tests/cli/test_errors.py). This scan keeps flags out of the library's
error messages and hints: the string constants (f-string parts included) passed to an
``...Error(...)`` call or a ``hint=`` argument, and those assigned to a ``hint``/``*_HINT`` name,
in every module outside ``cli/`` and ``render/``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "ckpt_cli"
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]+")

# Error texts that keep naming flags, each for a reason; (module, a fragment of the string).
ALLOWED = {
    # Whole command lines to run, not parameters of the call that failed.
    ("ops/convert/fp8.py", "ckpt convert SRC --to bf16 --dequantize"),
    ("integrations/hf.py", "use ckpt watch --keep N"),
    # Names the flags of two commands (inspect/validate/convert and diff's -a/-b); the error
    # also becomes a validate finding, which the CLI prints as it is.
    ("formats/__init__.py", "--input-format (diff: --input-format-a/-b)"),
    # A finding's hint (validate, inspect), not an error: reports print findings as they are.
    ("formats/allowlist.py", "--allow-global "),
}


def _strings(node: ast.AST) -> list[str]:
    """The string constants in ``node``: plain strings and the literal parts of f-strings."""
    return [n.value for n in ast.walk(node)
            if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _callee(call: ast.Call) -> str:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def error_texts(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, string)`` of every error message or hint string in a module's tree."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            if _callee(node).endswith("Error"):
                for arg in [*node.args, *(k.value for k in node.keywords)]:
                    found.extend((node.lineno, s) for s in _strings(arg))
            else:
                for k in node.keywords:
                    if k.arg == "hint":
                        found.extend((node.lineno, s) for s in _strings(k.value))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            if node.value is not None and any(n == "hint" or n.endswith("_HINT") for n in names):
                found.extend((node.lineno, s) for s in _strings(node.value))
    return found


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py")
                  if p.relative_to(PACKAGE).parts[0] not in ("cli", "render"))


def _flagged(path: Path) -> list[tuple[int, str]]:
    rel = path.relative_to(PACKAGE).as_posix()
    return [(line, s) for line, s in error_texts(ast.parse(path.read_text(), str(path)))
            if FLAG.search(s) and not any(m == rel and frag in s for m, frag in ALLOWED)]


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_library_errors_name_parameters_not_flags(path: Path) -> None:
    flagged = _flagged(path)
    assert not flagged, (
        f"{path.relative_to(PACKAGE)}: error or hint text names a flag; name the parameter and "
        f"pass it as param=... (the CLI words it as its flag): {flagged}")


def test_each_allowed_text_is_still_there() -> None:
    # An entry whose string is gone (converted, reworded) goes from the list too.
    texts = {p.relative_to(PACKAGE).as_posix():
             [s for _, s in error_texts(ast.parse(p.read_text()))] for p in _modules()}
    missing = [(m, frag) for m, frag in ALLOWED if not any(frag in s for s in texts.get(m, []))]
    assert not missing


def test_the_scan_finds_flags_in_errors_and_hints() -> None:
    # The scan itself: each place a flag could hide is found, a docstring or a comment is not.
    tree = ast.parse('''
"""Module doc naming --to."""
X_HINT = "pass --any-dir"
def f(n):
    """Doc naming --keep."""
    hint = f"give --part {n}"
    raise UsageError(f"--to must be {n!r}", param="to")
def g():
    raise DestinationExistsError("exists", hint="use --force")
def h():
    return Finding("x", hint="--allow-global os.system")
def ok():
    note = "--thin-after keeps it"  # not an error: a note
''')
    got = sorted(m.group() for _, s in error_texts(tree) for m in FLAG.finditer(s))
    assert got == ["--allow-global", "--any-dir", "--force", "--part", "--to"]
