"""--json on failure: one error document on stdout; machine limits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ckpt_cli.errors import CkptError
from tests.conftest import run_cli
from tests.helpers.makers import tiny_state_dict

pytestmark = pytest.mark.requires_torch


def _failing_args(command: str, tmp: Path) -> tuple[list[str | Path], str, str | None]:
    """Arguments that make ``command`` fail with exit 2, the error kind and the path named."""
    missing = tmp / "nonexist.pt"
    good = tmp / "good.safetensors"
    save_file(tiny_state_dict(), str(good))
    c128 = tmp / "c128.pt"
    torch.save({"c": torch.ones(3, dtype=torch.complex128)}, c128)
    other = tmp / "notes"
    other.mkdir()
    (other / "notes.txt").write_text("not a checkpoint")
    return {
        "inspect": (["inspect", missing], "error", str(missing)),
        "validate": (["validate", missing], "error", str(missing)),
        "diff": (["diff", good, missing], "error", str(missing)),
        "convert": (["convert", c128, "-o", tmp / "x.safetensors"], "unsupported", None),
        "consolidate": (["consolidate", missing, "-o", tmp / "out"], "error", str(missing)),
        "prune": (["prune", good, "--keep", "1", "--yes"], "error", str(good)),
        "plan": (["plan"], "usage", None),
        "sample": (["sample", other], "destination-exists", str(other)),
    }[command]


@pytest.mark.parametrize("command", ["inspect", "validate", "diff", "convert", "consolidate",
                                     "prune", "plan", "sample"])
def test_json_failure_prints_one_error_document(command: str, tmp_path: Path) -> None:
    args, kind, path = _failing_args(command, tmp_path)
    r = run_cli(*args, "--json")
    assert r.exit_code == 2, r.output
    doc = json.loads(r.stdout)  # exactly one document: json.loads refuses trailing data
    assert doc["schema_version"] == 1 and doc["command"] == command
    assert doc["exit_code"] == 2
    err = doc["error"]
    assert set(err) == {"kind", "message", "path", "side", "hint", "text"}
    assert err["kind"] == kind and err["path"] == path
    # The one-line error on stderr is unchanged, and the document says the same.
    first = r.stderr.splitlines()[0]
    assert first == f"ckpt: error: {err['text']}", r.stderr
    assert err["text"].endswith(err["message"])
    if err["hint"] is not None:
        assert f"hint: {err['hint']}" in r.stderr
    assert err["side"] == ("B" if command == "diff" else None)
    # Without --json stdout stays empty.
    r = run_cli(*args)
    assert r.exit_code == 2 and r.stdout == "", r.stdout


def test_json_interrupt_and_internal_error_documents(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import ckpt_cli.ops.inspect

    good = tmp_path / "good.safetensors"
    save_file(tiny_state_dict(), str(good))

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt_cli.ops.inspect, "inspect", interrupted)
    r = run_cli("inspect", good, "--json")
    doc = json.loads(r.stdout)
    assert r.exit_code == 130 and doc["exit_code"] == 130, r.output
    assert doc["command"] == "inspect" and doc["error"]["kind"] == "interrupted"
    assert r.stderr.strip() == "ckpt: interrupted"

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(ckpt_cli.ops.inspect, "inspect", broken)
    monkeypatch.delenv("CKPT_DEBUG", raising=False)
    r = run_cli("inspect", good, "--json")
    doc = json.loads(r.stdout)
    assert r.exit_code == 101 and doc["exit_code"] == 101, r.output
    assert doc["error"]["kind"] == "internal" and doc["error"]["message"] == "RuntimeError: boom"


def test_json_error_after_the_document_prints_no_second_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ckpt_cli.render.inspect

    good = tmp_path / "good.safetensors"
    save_file(tiny_state_dict(), str(good))
    real = ckpt_cli.render.inspect._emit_json

    def emit_then_fail(result: object) -> None:
        real(result)
        raise CkptError("failed after the document was printed")

    monkeypatch.setattr(ckpt_cli.render.inspect, "_emit_json", emit_then_fail)
    r = run_cli("inspect", good, "--json")
    assert r.exit_code == 2 and "failed after" in r.stderr
    doc = json.loads(r.stdout)
    assert doc["command"] == "inspect" and "error" not in doc


def test_machine_limits_are_errors_not_bugs(capsys: pytest.CaptureFixture[str]) -> None:
    import errno

    import typer

    from ckpt_cli.cli.errors import handled

    with pytest.raises(typer.Exit) as exc, handled():
        raise OSError(errno.ENAMETOOLONG, "File name too long", "/very/long/path")
    assert exc.value.exit_code == 2
    assert capsys.readouterr().err.strip() == "ckpt: error: /very/long/path: File name too long"
    with pytest.raises(typer.Exit) as exc, handled():
        raise OSError(errno.EBADF, "Bad file descriptor")  # a bug of ours: internal error
    assert exc.value.exit_code == 101
