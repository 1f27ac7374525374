"""``ckpt validate`` end to end: report, exit codes, JSON schema, JUnit XML, no torch."""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.conftest import Golden, run_cli
from tests.helpers import damage
from tests.helpers.golden import safetensors_run, stable
from tests.helpers.makers import save_training_checkpoint, tiny_state_dict, training_checkpoint
from tests.ops.inspect.test_inspect_cli import _imports_torch

pytestmark = pytest.mark.requires_torch

CHECKPOINT_KEYS = {"name", "path", "format", "flavor", "step", "valid", "errors", "warnings",
                   "bytes_read", "seconds", "checks", "findings", "manifest"}
FINDING_KEYS = {"severity", "code", "message", "file", "location", "check"}
CHECK_KEYS = {"id", "title", "status", "summary", "errors", "warnings"}


def _json(*args: str | Path, code: int = 0) -> dict:  # type: ignore[type-arg]
    r = run_cli("validate", *args, "--json")
    assert r.exit_code == code, r.stdout + r.stderr
    return json.loads(r.stdout)  # type: ignore[no-any-return]


@pytest.fixture
def pt(tmp_path: Path) -> Path:
    return save_training_checkpoint(tmp_path / "train.pt")


def test_valid_file_exits_0_with_a_report(pt: Path) -> None:
    r = run_cli("validate", pt)
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith(str(pt)) and "torch" in lines[0] and "step 100" in lines[0]
    assert any(ln.split()[:2] == ["ok", "crc32"] for ln in lines)
    assert lines[-1] == "valid: train.pt (0 errors, 0 warnings)"
    assert r.stderr == ""


def test_problem_is_one_line_with_file_location_and_explanation(pt: Path) -> None:
    off, size = damage.zip_payload(pt, "data/1")
    damage.flip(pt, off + size - 1)
    r = run_cli("validate", pt)
    assert r.exit_code == 1
    errors = [ln for ln in r.stdout.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1
    assert errors[0].startswith("error: train.pt:train/data/1: CRC-32 mismatch (storage of ")
    assert "changed after the file was written" in errors[0]
    assert any(ln.split()[:2] == ["FAIL", "crc32"] for ln in r.stdout.splitlines())
    assert r.stdout.splitlines()[-1] == "INVALID: train.pt (1 error, 0 warnings)"


def test_json_schema(pt: Path) -> None:
    doc = _json(pt)
    assert doc["schema_version"] == 1 and doc["command"] == "validate"
    assert doc["kind"] == "checkpoint" and doc["valid"] is True and doc["strict"] is False
    assert doc["run"] is None and doc["run_checks"] == [] and doc["run_findings"] == []
    assert doc["summary"] == {"checkpoints": 1, "valid": 1, "invalid": 0, "errors": 0,
                              "warnings": 0, "bytes_read": doc["summary"]["bytes_read"],
                              "seconds": doc["summary"]["seconds"]}
    (c,) = doc["checkpoints"]
    assert set(c) == CHECKPOINT_KEYS
    assert c["format"] == "torch" and c["step"] == 100 and c["findings"] == []
    assert all(set(k) == CHECK_KEYS for k in c["checks"])
    assert {k["id"]: k["status"] for k in c["checks"]}["crc32"] == "pass"
    assert c["manifest"] == {"path": str(pt) + ".ckpt-manifest.json", "action": "absent",
                             "algorithm": None, "files": 0, "bytes": 0, "seconds": 0.0,
                             "threads": 1, "bytes_per_second": 0, "changed": [], "extra": []}


def test_json_findings_and_exit_1(pt: Path) -> None:
    damage.append(pt, b"trailing")
    doc = _json(pt, code=1)
    (c,) = doc["checkpoints"]
    assert doc["valid"] is False and c["valid"] is False and c["errors"] == 1
    (f,) = [f for f in c["findings"] if f["severity"] == "error"]
    assert set(f) == FINDING_KEYS
    assert f["code"] == "zip-trailing-bytes" and f["check"] == "zip-structure"
    assert f["file"] == "train.pt"


def test_run_directory_table_and_json(sample_copy: Path) -> None:
    damage.truncate(sample_copy / "step_000300" / "checkpoint.pt", 1000)
    r = run_cli("validate", sample_copy)
    assert r.exit_code == 1
    table = r.stdout.split("\n\n")[0].splitlines()  # the first block: header and one row each
    rows = {ln.split()[0]: ln for ln in table if ln.startswith("step_")}
    assert set(rows) == {"step_000100", "step_000200", "step_000300", "step_000400"}
    assert "INVALID" in rows["step_000300"] and "valid" in rows["step_000100"]
    assert r.stdout.splitlines()[-1].startswith("INVALID: 3 of 4 checkpoint(s) valid")
    doc = _json(sample_copy, code=1)
    assert doc["kind"] == "run" and doc["summary"]["invalid"] == 1
    assert [c["name"] for c in doc["checkpoints"]] == sorted(rows)
    assert doc["run"]["latest"] == "step_000400"
    assert [k["id"] for k in doc["run_checks"]] == ["latest-pointer", "leftovers"]
    doc = _json(sample_copy, "--latest")
    assert [c["name"] for c in doc["checkpoints"]] == ["step_000400"]


def test_junit_report(pt: Path, tmp_path: Path) -> None:
    out = tmp_path / "reports" / "junit.xml"
    out.parent.mkdir()
    off, _ = damage.zip_payload(pt, "data/0")
    damage.flip(pt, off + 1)
    r = run_cli("validate", pt, "--junit", out, "--values")
    assert r.exit_code == 1
    root = ET.parse(out).getroot()
    assert root.tag == "testsuites" and root.get("failures") == "1"
    (suite,) = root.findall("testsuite")
    cases = {c.get("name"): c for c in suite.findall("testcase")}
    assert {"readable", "crc32", "values", "leftovers"} <= set(cases)
    assert int(suite.get("tests", "0")) == len(cases)
    failure = cases["crc32"].find("failure")
    assert failure is not None and failure.get("type") == "crc-mismatch"
    assert "train/data/0" in (failure.text or "")
    assert cases["readable"].find("failure") is None
    skipped = cases["manifest"].find("skipped")
    assert skipped is not None and "--write-manifest" in (skipped.get("message") or "")
    assert list(tmp_path.glob("reports/.*")) == []  # written atomically, no temp left


def test_strict_makes_warnings_fail(tmp_path: Path) -> None:
    p = tmp_path / "w.pt"
    torch.save({"model": tiny_state_dict(), "step": 5}, p)  # a step but no optimizer: a warning
    r = run_cli("validate", p)
    assert r.exit_code == 0 and "warning: " in r.stdout and "no optimizer state" in r.stdout
    assert run_cli("validate", p, "--strict").exit_code == 1
    assert run_cli("validate", p, "--require", "optimizer").exit_code == 1


def test_write_manifest_then_detect_change(tmp_path: Path) -> None:
    p = tmp_path / "m.safetensors"
    save_file(tiny_state_dict(), str(p))
    r = run_cli("validate", p, "--write-manifest")
    assert r.exit_code == 0 and "wrote m.safetensors.ckpt-manifest.json" in r.stdout
    damage.flip(p, p.stat().st_size - 1)  # tensor data: safetensors has no checksum of its own
    r = run_cli("validate", p)
    assert r.exit_code == 1
    # the manifest is named in the message, not as a place inside the file (issue 39)
    assert ("error: m.safetensors: content differs from m.safetensors.ckpt-manifest.json "
            "(xxh3_128 checksum changed; same size)") in " ".join(r.stdout.split())


@pytest.mark.parametrize("args,fragment", [
    (["--require", "rng"], "unknown requirement 'rng'"),
    (["--latest"], "--latest needs a run directory"),
    (["--manifest-hash", "md5"], "--manifest-hash must be one of"),
    (["--input-format", "nope"], "unknown format 'nope'"),
])
def test_usage_errors_exit_2(pt: Path, args: list[str], fragment: str) -> None:
    r = run_cli("validate", pt, *args)
    assert r.exit_code == 2, r.stdout
    assert fragment in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_unreadable_path_exits_2(tmp_path: Path) -> None:
    r = run_cli("validate", tmp_path / "nope.pt")
    assert r.exit_code == 2 and "no such file or directory" in r.stderr
    (tmp_path / "x.txt").write_text("not a checkpoint")
    r = run_cli("validate", tmp_path / "x.txt")
    assert r.exit_code == 2 and "unrecognised file" in r.stderr and r.stdout == ""


EMPTY = "empty file (0 bytes): not a checkpoint, or its write never started"


@pytest.mark.parametrize("name", ["model.safetensors", "train.pt", "pytorch_model.bin",
                                  "model.pth", "last.ckpt", "checkpoint",
                                  "model.safetensors.index.json"])
@pytest.mark.parametrize("fmt", [None, "torch"])
def test_an_empty_file_is_unreadable_input_as_inspect_says(tmp_path: Path, name: str,
                                                           fmt: str | None) -> None:
    # validate used to say INVALID, exit 1, "pickle data was truncated" (or "0 bytes is too
    # short for a safetensors file") where inspect said "empty file (0 bytes)", exit 2. An
    # empty file holds nothing to recognise or check, like a missing or unrecognised path:
    # exit 2 and the same line from both, whatever the name or --input-format says.
    p = tmp_path / name
    p.write_bytes(b"")
    forced = ["--input-format", fmt] if fmt else []
    for command in ("validate", "inspect"):
        r = run_cli(command, p, *forced)
        assert r.exit_code == 2, (command, r.stdout, r.stderr)
        assert r.stderr.strip().splitlines() == [f"ckpt: error: {p}: {EMPTY}"], command
        assert r.stdout == ""


def test_an_empty_file_in_a_run_directory_is_a_finding_with_the_same_words(
        tmp_path: Path) -> None:
    # Inside a run directory the run is what was given: its empty checkpoint is a problem
    # found (exit 1), named in the same words.
    run = tmp_path / "run"
    run.mkdir()
    torch.save(training_checkpoint(), run / "step_100.pt")
    (run / "step_200.pt").write_bytes(b"")
    doc = _json(run, code=1)
    by_name = {c["name"]: c for c in doc["checkpoints"]}
    assert by_name["step_100.pt"]["valid"] and not by_name["step_200.pt"]["valid"]
    assert [f["message"] for f in by_name["step_200.pt"]["findings"]] == [EMPTY]


def test_junit_destination_problems_exit_2(pt: Path, tmp_path: Path) -> None:
    (tmp_path / "no").write_text("a file, not a directory")
    r = run_cli("validate", pt, "--junit", tmp_path / "no" / "such" / "dir.xml")
    assert r.exit_code == 2 and "dir.xml: cannot be written" in r.stderr
    assert "is not a directory" in r.stderr
    r = run_cli("validate", pt, "--junit", tmp_path / "new" / "dir" / "report.xml")
    assert r.exit_code == 0 and (tmp_path / "new" / "dir" / "report.xml").is_file()


@pytest.mark.parametrize("case", ["missing", "fifo", "unrecognised", "usage", "json"])
def test_junit_is_written_when_validate_cannot_run(tmp_path: Path, case: str) -> None:
    # A CI step publishing the report after `ckpt validate` exited 2 used to find no file (or
    # the previous run's): now one failed test case names the error.
    out = tmp_path / "reports" / "junit.xml"
    out.parent.mkdir()
    out.write_text("<testsuites name='a previous run' />")
    target, extra = tmp_path / "nope.pt", []
    if case == "fifo":
        target = tmp_path / "pipe.pt"
        os.mkfifo(target)
    elif case == "unrecognised":
        target = tmp_path / "x.txt"
        target.write_text("not a checkpoint")
    elif case == "usage":
        target = tmp_path / "t.pt"
        torch.save(training_checkpoint(), target)
        extra = ["--manifest-hash", "md5"]
    elif case == "json":
        extra = ["--json"]
    r = run_cli("validate", target, "--junit", out, *extra)
    assert r.exit_code == 2, r.stdout + r.stderr
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("ckpt: error: ")]
    error = line.removeprefix("ckpt: error: ")
    root = ET.parse(out).getroot()
    assert root.get("name") == f"ckpt validate {target}"
    assert (root.get("tests"), root.get("failures"), root.get("errors")) == ("1", "1", "0")
    (suite,) = root.findall("testsuite")
    assert suite.get("name") == str(target) and suite.get("failures") == "1"
    (tc,) = suite.findall("testcase")
    assert tc.get("name") == "validate" and tc.get("classname") == f"ckpt.validate.{target.name}"
    failure = tc.find("failure")
    assert failure is not None and failure.get("message") == error
    assert (failure.text or "").splitlines()[0] == f"error: {error}"
    expected = {"missing": "no such file or directory", "fifo": "not a regular file (a FIFO)",
                "unrecognised": "unrecognised file", "usage": "--manifest-hash must be one of",
                "json": "no such file or directory"}[case]
    assert expected in error
    if case == "unrecognised":
        assert failure.get("type") == "unknown-format"
    if case == "json":
        assert json.loads(r.stdout)["error"]["message"] in error


def test_validate_does_not_import_torch(tmp_path: Path) -> None:
    save_file(tiny_state_dict(), str(tmp_path / "m.safetensors"))
    torch.save(training_checkpoint(), tmp_path / "t.pt")
    for argv in (["validate", str(tmp_path / "m.safetensors"), "--values"],
                 ["validate", str(tmp_path / "t.pt"), "--values", "--json"],
                 ["validate", str(tmp_path / "t.pt"), "--write-manifest"]):
        imported, tail = _imports_torch(*argv)
        assert not imported, (argv, tail)
        assert "EXIT=0" in tail, (argv, tail)


def test_validate_dcp_does_not_import_torch(sample_run: Path) -> None:
    imported, tail = _imports_torch("validate", str(sample_run / "step_000400"), "--values")
    assert not imported and "EXIT=0" in tail, tail


def test_junit_of_a_run_directory(sample_copy: Path, tmp_path: Path) -> None:
    out = tmp_path / "run.xml"
    (sample_copy / "latest").write_text("step_000900")
    r = run_cli("validate", sample_copy, "--junit", out, "--quick")
    assert r.exit_code == 1
    suites = ET.parse(out).getroot().findall("testsuite")
    assert [s.get("name") for s in suites] == [
        *(str(sample_copy / f"step_000{n}00") for n in range(1, 5)),
        f"{sample_copy} (run directory)"]
    run_cases = {c.get("name"): c for c in suites[-1].findall("testcase")}
    failure = run_cases["latest-pointer"].find("failure")
    assert failure is not None and "step_000900" in (failure.text or "")
    assert all(s.get("failures") == "0" for s in suites[:-1])


def test_no_color_and_no_progress_when_not_a_terminal(pt: Path) -> None:
    r = run_cli("validate", pt, "--values", "--write-manifest")
    assert r.exit_code == 0
    assert "\x1b[" not in r.stdout and r.stderr == ""


def test_progress_bar_on_a_terminal(pt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from rich.console import Console

    from ckpt_cli.cli import progress
    from ckpt_cli.ops.validate import validate

    buf = io.StringIO()
    monkeypatch.setattr(progress, "is_tty", lambda: True)
    monkeypatch.setattr(progress, "stderr", lambda: Console(file=buf, force_terminal=True,
                                                            width=100))
    with progress.byte_progress("validating") as bar:
        validate(pt, values=True, progress=bar)
    shown = buf.getvalue()
    assert "train.pt: CRC-32" in shown and "train.pt: values" in shown
    buf.truncate(0)
    with progress.byte_progress("validating", enabled=False) as bar:  # --quiet, --json
        validate(pt, values=True, progress=bar)
    assert buf.getvalue() == ""


def test_golden_json(tmp_path: Path, golden: Golden) -> None:
    """``validate --json`` of a run dir is a contract (timings aside)."""
    run = safetensors_run(tmp_path)
    r = run_cli("validate", run, "--json")
    assert r.exit_code == 0, r.output
    golden("validate_run.json", json.loads(r.stdout), stable(tmp_path))


@pytest.mark.parametrize("target,extra,expected", [
    ("ftp://u:p@h/x", [], "ftp:// is not an object store ckpt reads"),
    ("s3://user:pw@bucket/x.pt", [], "credentials in a URL are not accepted"),
    ("DIR", ["--jobs", "abc"], "'abc' is not a valid int range"),
])
def test_junit_is_written_when_click_refuses_a_value(tmp_path: Path, target: str,
                                                      extra: list[str], expected: str) -> None:
    # Values refused while the arguments were parsed used to print a box and write no report.
    out = tmp_path / "junit.xml"
    target = str(tmp_path) if target == "DIR" else target
    r = run_cli("validate", target, *extra, "--junit", out)
    assert r.exit_code == 2, r.stdout + r.stderr
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("ckpt: error: ")]
    assert expected in line and "╭" not in r.stderr
    text = out.read_text()
    assert "pw" not in text and ":p@" not in text and "pw" not in r.stderr
    (tc,) = ET.parse(out).getroot().iter("testcase")
    failure = tc.find("failure")
    assert failure is not None and expected in (failure.get("message") or "")
