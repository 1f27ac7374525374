"""ckpt_cli.render.junit: the JUnit XML of real ``validate`` results."""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from ckpt_cli.ops.validate import validate
from ckpt_cli.ops.validate.result import ValidateResult
from ckpt_cli.render.junit import junit_xml, write_junit


def _save(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"w": np.arange(100, dtype=np.float32), "b": np.ones(10, dtype=np.float32)},
              str(path))
    return path


def _truncated(path: Path) -> Path:
    _save(path)
    os.truncate(path, path.stat().st_size - 50)
    return path


def _check_against(result: ValidateResult, root: ET.Element) -> None:
    """Every suite and case of ``root`` matches the checks and findings of ``result``."""
    suites = root.findall("testsuite")
    reports = [(str(r.path), r.checks) for r in result.checkpoints]
    if result.run_checks:
        reports.append((f"{result.path} (run directory)", result.run_checks))
    assert [s.get("name") for s in suites] == [name for name, _ in reports]
    for suite, (_, checks) in zip(suites, reports, strict=True):
        cases = suite.findall("testcase")
        assert [c.get("name") for c in cases] == [c.id for c in checks]
        assert suite.get("tests") == str(len(checks))
        assert suite.get("failures") == str(sum(c.status == "fail" for c in checks))
        assert suite.get("skipped") == str(sum(c.status == "skip" for c in checks))
        for case, check in zip(cases, checks, strict=True):
            failure = case.find("failure")
            errors = [f for f in check.findings if f.severity == "error"]
            if check.status == "fail":
                assert failure is not None and failure.text is not None
                assert failure.get("type") == errors[0].code
                assert failure.get("message", "").startswith(f"{len(errors)} error(s): ")
                assert len(failure.text.splitlines()) == len(errors)
                assert all(line.startswith("error: ") for line in failure.text.splitlines())
            else:
                assert failure is None
            assert (case.find("skipped") is not None) == (check.status == "skip")
            out = case.find("system-out")
            assert out is not None and out.text is not None
            lines = out.text.splitlines()
            outcome = {"pass": "passed", "warn": "passed with warnings", "fail": "FAILED",
                       "skip": "skipped"}[check.status]
            assert lines[0] == f"{outcome}: {check.title} ({check.summary})"
            assert len(lines) == 1 + sum(f.severity != "error" for f in check.findings)
    for key in ("tests", "failures", "skipped"):
        assert root.get(key) == str(sum(int(s.get(key, "0")) for s in suites))


def test_good_checkpoint_has_no_failures(tmp_path: Path) -> None:
    good = _save(tmp_path / "good.safetensors")
    result = validate(good)
    dest = tmp_path / "report.xml"
    write_junit(result, dest)
    root = ET.parse(dest).getroot()
    assert root.tag == "testsuites"
    assert root.get("failures") == "0"
    assert int(root.get("tests", "0")) == len(result.checkpoints[0].checks) > 0
    suite = root.find("testsuite")
    assert suite is not None
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert props["format"] == result.checkpoints[0].format == "safetensors"
    assert props["path"] == str(good)
    _check_against(result, root)
    assert not [p for p in tmp_path.iterdir() if ".ckpt-tmp-" in p.name]


def test_truncated_checkpoint_fails_with_its_findings(tmp_path: Path) -> None:
    bad = _truncated(tmp_path / "bad.safetensors")
    result = validate(bad)
    failed = [c for c in result.checkpoints[0].checks if c.status == "fail"]
    assert failed, "a truncated file must fail a check"
    root = ET.fromstring(junit_xml(result))
    assert root.get("failures") == str(len(failed))
    failures = root.findall(".//failure")
    assert len(failures) == len(failed)
    assert {f.get("type") for f in failures} >= {"truncated"}
    _check_against(result, root)


def test_run_directory_has_a_suite_per_checkpoint_and_one_for_the_run(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _save(run / "checkpoint-1" / "model.safetensors")
    _truncated(run / "checkpoint-2" / "model.safetensors")
    result = validate(run)
    assert result.kind == "run" and len(result.checkpoints) == 2 and result.run_checks
    data = junit_xml(result)
    assert data.startswith(b"<?xml") and data.endswith(b"\n")
    root = ET.fromstring(data)
    assert len(root.findall("testsuite")) == 3
    _check_against(result, root)
    total_fail = sum(c.status == "fail" for r in result.checkpoints for c in r.checks)
    assert root.get("failures") == str(total_fail) and total_fail >= 1


def test_write_junit_replaces_an_existing_report(tmp_path: Path) -> None:
    dest = tmp_path / "report.xml"
    dest.write_text("old")
    result = validate(_save(tmp_path / "good.safetensors"))
    write_junit(result, dest)
    assert dest.read_bytes() == junit_xml(result)


def test_write_junit_into_a_missing_directory_creates_it(tmp_path: Path) -> None:
    # As save_pretrained does: the report's missing directories are created (they used to be
    # refused); a file in the way is a CkptError naming the report, and nothing is created.
    from ckpt_cli.errors import CkptError

    result = validate(_save(tmp_path / "good.safetensors"))
    write_junit(result, tmp_path / "nope" / "deeper" / "report.xml")
    assert (tmp_path / "nope" / "deeper" / "report.xml").read_bytes() == junit_xml(result)
    (tmp_path / "file").write_text("x")
    with pytest.raises(CkptError, match=r"report\.xml: cannot be written: .*file is not a"):
        write_junit(result, tmp_path / "file" / "sub" / "report.xml")
    assert (tmp_path / "file").read_text() == "x"


def test_control_characters_in_a_file_name_keep_the_report_well_formed(tmp_path: Path) -> None:
    # A file name holding \x01 and an escape sequence used to make the XML unreadable, and the
    # escape sequence reached the terminal raw.
    from tests.conftest import run_cli

    run = tmp_path / "xr"
    _save(run / "step_1" / "model.safetensors")
    (run / "step_1" / "w\x01\x1b[31m.pt").write_bytes(b"")
    lone = tmp_path / "step_4\x01\x1b[31m.ckpt"
    lone.write_bytes(b"")
    for target, name in ((run, "j1.xml"), (lone, "j2.xml")):
        out = tmp_path / name
        r = run_cli("validate", target, "--junit", out)
        assert r.exit_code in (1, 2), r.stdout + r.stderr
        assert "\x1b[31m" not in r.stderr and "\x01" not in r.stderr
        text = out.read_text(encoding="utf-8")
        ET.fromstring(text)  # well-formed
        assert "\\x01\\x1b[31m" in text
    r = run_cli("validate", lone)
    assert "step_4\\x01\\x1b[31m.ckpt: empty file" in r.stderr
