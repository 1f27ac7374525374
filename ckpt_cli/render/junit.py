"""JUnit XML for ``validate --junit FILE``: CI systems show each check as a test case.

One ``<testsuite>`` per checkpoint (plus one for a run directory's own checks), one
``<testcase>`` per check: a failed check is a ``<failure>`` listing its errors, a skipped one
``<skipped>``; warnings and notes go to ``<system-out>``. Accepted by Jenkins, GitLab, GitHub
Actions reporters and the like.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path
from typing import TYPE_CHECKING

from ckpt_cli.errors import CkptError, visible
from ckpt_cli.model import Finding
from ckpt_cli.storage import redact
from ckpt_cli.storage.atomic import atomic_file

if TYPE_CHECKING:
    from ckpt_cli.ops.validate.result import CheckResult, ValidateResult


def _line(f: Finding) -> str:
    where = ":".join(x for x in (f.file, f.location) if x)
    return f"{f.severity}: {where + ': ' if where else ''}{f.message}"


def _suite(parent: ET.Element, name: str, classname: str, checks: list[CheckResult],
           seconds: float, properties: dict[str, str]) -> None:
    suite = ET.SubElement(parent, "testsuite", {
        "name": name, "tests": str(len(checks)),
        "failures": str(sum(c.status == "fail" for c in checks)), "errors": "0",
        "skipped": str(sum(c.status == "skip" for c in checks)), "time": f"{seconds:.3f}"})
    if properties:
        props = ET.SubElement(suite, "properties")
        for k, v in properties.items():
            ET.SubElement(props, "property", {"name": k, "value": v})
    for c in checks:
        case = ET.SubElement(suite, "testcase", {"classname": classname, "name": c.id,
                                                 "time": "0"})
        errors = [f for f in c.findings if f.severity == "error"]
        if c.status == "fail":
            fail = ET.SubElement(case, "failure", {
                "message": f"{len(errors)} error(s): {errors[0].message}"[:500],
                "type": errors[0].code})
            fail.text = "\n".join(_line(f) for f in errors)
        elif c.status == "skip":
            ET.SubElement(case, "skipped", {"message": c.summary})
        rest = [f for f in c.findings if f.severity != "error"]
        out = ET.SubElement(case, "system-out")
        # The title states what passing means ("CRC-32 of every zip record matches its
        # bytes"): said as the check, with its outcome, so a failing case does not read as a
        # pass.
        out.text = "\n".join([f"{_OUTCOME[c.status]}: {c.title} ({c.summary})",
                              *(_line(f) for f in rest)])


_OUTCOME = {"pass": "passed", "warn": "passed with warnings", "fail": "FAILED",
            "skip": "skipped"}
"""What each check status says before the check's title in a case's ``system-out``."""


def _serialise(root: ET.Element) -> bytes:
    """``root`` as UTF-8 XML 1.0: characters XML forbids (a file name's control characters,
    a non-UTF-8 byte) are written out (``\\x1b``) so that the report stays well-formed."""
    for el in root.iter():
        el.text = None if el.text is None else visible(el.text)
        el.tail = None if el.tail is None else visible(el.tail)
        for key, value in el.attrib.items():
            el.set(key, visible(value))
    ET.indent(root)
    data: bytes = ET.tostring(root, encoding="utf-8", xml_declaration=True)
    return data + b"\n"


def junit_xml(result: ValidateResult) -> bytes:
    """The JUnit XML document for a validation result.

    Args:
        result: What ``validate`` returned.

    Returns:
        UTF-8 XML with a declaration.
    """
    root = ET.Element("testsuites", {"name": f"ckpt validate {result.path}"})
    for r in result.checkpoints:
        props = {k: str(v) for k, v in (("format", r.format), ("flavor", r.flavor),
                                         ("step", r.step), ("path", r.path)) if v is not None}
        _suite(root, str(r.path), f"ckpt.validate.{r.name}", r.checks, r.seconds, props)
    if result.run_checks:
        _suite(root, f"{result.path} (run directory)", f"ckpt.validate.{result.path.name}",
               result.run_checks, 0.0, {"path": str(result.path)})
    suites = list(root)
    for key in ("tests", "failures", "errors", "skipped"):
        root.set(key, str(sum(int(s.get(key, "0")) for s in suites)))
    root.set("time", f"{sum(float(s.get('time', '0')) for s in suites):.3f}")
    return _serialise(root)


def error_junit_xml(path: Path | str, kind: str, message: str, detail: str = "") -> bytes:
    """The JUnit XML document of a validation that could not run (exit 2): one failed case.

    A CI step that publishes the report after ``ckpt validate`` then finds a file saying what
    went wrong (a missing path, an unreadable file, a bad option) instead of no file at all.

    Args:
        path: The path given to ``validate``.
        kind: The kind of error (as ``error.kind`` in ``--json`` documents).
        message: The error, one line (as printed on stderr).
        detail: More lines (a hint), if any.

    Returns:
        UTF-8 XML with a declaration.
    """
    message, detail = redact(message), redact(detail)
    name = redact(str(path))
    root = ET.Element("testsuites", {"name": f"ckpt validate {name}", "tests": "1",
                                     "failures": "1", "errors": "0", "skipped": "0",
                                     "time": "0.000"})
    suite = ET.SubElement(root, "testsuite", {"name": name, "tests": "1", "failures": "1",
                                              "errors": "0", "skipped": "0", "time": "0.000"})
    case = ET.SubElement(suite, "testcase", {
        "classname": f"ckpt.validate.{Path(name).name or name}", "name": "validate",
        "time": "0"})
    fail = ET.SubElement(case, "failure", {"message": message[:500], "type": kind})
    fail.text = "\n".join(x for x in (f"error: {message}", detail) if x)
    return _serialise(root)


def write_junit(result: ValidateResult, dest: Path) -> None:
    """Write :func:`junit_xml` to ``dest`` atomically (replacing an existing file).

    Args:
        result: What ``validate`` returned.
        dest: The XML file.

    Raises:
        CkptError: If it cannot be written.
    """
    write_junit_bytes(junit_xml(result), dest)


def write_junit_bytes(data: bytes, dest: Path) -> None:
    """Write a JUnit document to ``dest`` atomically (replacing an existing file).

    Args:
        data: The XML (:func:`junit_xml`, :func:`error_junit_xml`).
        dest: The XML file.

    Raises:
        CkptError: If it cannot be written.
    """
    try:
        with atomic_file(Path(dest), overwrite=True, parents=True) as tmp:
            tmp.write_bytes(data)
    except OSError as e:
        raise CkptError(f"cannot write the JUnit report: {e.strerror}", path=dest) from None
