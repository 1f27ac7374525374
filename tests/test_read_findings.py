"""The safety findings of a read travel with it: every command that reads a file (inspect,
validate, diff, convert, stats) reports what validate reports of the repository's hostile
files: code-running pickle globals, a pickle hidden after ``data.pkl``'s STOP, a pickle record
that cannot be scanned (a crafted memo index), a safetensors key spelt twice (#47).

stats read such files and printed "No anomaly found", exit 0; convert was silent about the
hidden and the unscannable pickle.
"""

from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from tests.conftest import run_cli
from tests.helpers import pickle_corpus
from tests.helpers.fuzz import hostile_seeds

pytestmark = pytest.mark.requires_torch

SAFETY_CODES = ("unsafe-global", "unknown-global", "torchscript-archive", "unscanned-pickle",
                "pickle-after-stop", "duplicate-key")

# A pickle record beside data.pkl whose first memo index is crafted: the scanner stops there,
# and the os.system call after it is what a full unpickler reaches.
MEMO = (b"\x80\x02Nr" + (0xFFFFFFF0).to_bytes(4, "little")
        + b"0cos\nsystem\nX\x04\x00\x00\x00true\x85R.")


def _memo_pickle(dest: Path) -> Path:
    plain = dest.with_name("plain-for-memo.pt")
    torch.save({"w": torch.ones(2, 2)}, plain)
    with zipfile.ZipFile(plain) as zin, zipfile.ZipFile(dest, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info))
        zout.writestr("archive/extra.pkl", MEMO)
    return dest


def _escaped_duplicate(dest: Path) -> Path:
    save_file({"w": torch.ones(2, 2), "b": torch.zeros(2)}, dest)
    raw = dest.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = raw[8:8 + n].rstrip().replace(
        b'"b":{', b'"\\u0062":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{', 1)
    header += b" " * (-len(header) % 8)
    dest.write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + n:])
    return dest


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("hostile")
    seeds = {s.name: s for s in hostile_seeds(base)}
    corpus = {c.name: c.path for c in pickle_corpus.build(base / "corpus")}
    return {"hidden-pickle": seeds["hidden-pickle"].root / seeds["hidden-pickle"].arg,
            "memo-index": _memo_pickle(base / "memo.pt"),
            "escaped-duplicate": _escaped_duplicate(base / "dup.safetensors"),
            "os-system": corpus["dotted_torch_os_system"],
            "logging-filehandler": corpus["logging_filehandler"]}


def _facts(findings: list[dict[str, Any]]) -> set[tuple[str, str | None]]:
    """What a command said, comparable across commands: each global refused, and each other
    safety finding by code (convert words globals as one ``hostile-source`` warning)."""
    out: set[tuple[str, str | None]] = set()
    for f in findings:
        if f["code"] in ("unsafe-global", "unknown-global"):
            out.add(("global", f["location"]))
        elif f["code"] == "hostile-source":
            out |= {("global", q) for q in (f["location"] or "").split(", ") if q}
        elif f["code"] in SAFETY_CODES:
            out.add((f["code"], None))
    return out


def _run(*args: Any) -> tuple[int, dict[str, Any], str]:
    r = run_cli(*args, "--json")
    doc = json.loads(r.stdout) if r.stdout.strip().startswith("{") else {}
    return r.exit_code, doc, r.stderr


CASES = ["hidden-pickle", "memo-index", "escaped-duplicate", "os-system",
         "logging-filehandler"]


@pytest.mark.parametrize("case", CASES)
def test_every_reading_command_reports_what_validate_finds(hostile: dict[str, Path],
                                                           case: str, tmp_path: Path) -> None:
    path = hostile[case]
    code, doc, _ = _run("validate", path)
    assert code == 1 and not doc["valid"]
    want = _facts([f for c in doc["checkpoints"] for f in c["findings"]])
    assert want, doc
    pristine = tmp_path / "pristine.safetensors"
    save_file({"w": torch.ones(2, 2)}, pristine)

    code, doc, _ = _run("inspect", path)
    assert code == 0 and _facts(doc["warnings"]) == want, ("inspect", doc["warnings"])
    code, doc, err = _run("diff", pristine, path, "--exit-zero")
    if code == 0:
        assert _facts(doc["b"]["warnings"]) == want, ("diff", doc["b"])
    else:  # refused, naming the problem (a key two readers read differently)
        assert code == 2 and case == "escaped-duplicate" and "more than once" in err, err
    # convert writes a clean output and warns, or refuses naming the problem.
    code, doc, err = _run("convert", path, "-o", tmp_path / "out.safetensors")
    if code == 0:
        assert _facts(doc["warnings"]) == want, ("convert", doc["warnings"])
    else:
        assert code == 2 and case == "escaped-duplicate" and "more than once" in err, err
    # stats: the same findings, in its document, and validate's exit status.
    code, doc, err = _run("stats", path)
    assert code == 1 and _facts(doc["findings"]) == want, ("stats", doc.get("findings"))
    assert "error:" in err
    r = run_cli("stats", path)
    assert r.exit_code == 1 and "No anomaly found" not in r.stdout


def test_stats_allow_global_turns_a_refusal_into_a_note(hostile: dict[str, Path]) -> None:
    path = hostile["os-system"]
    code, doc, _ = _run("stats", path, "--allow-global", "torch.os.system")
    assert code == 0, doc["findings"]
    assert [f["code"] for f in doc["findings"]] == ["allowed-global"]


def test_stats_of_a_run_names_the_checkpoint(hostile: dict[str, Path], tmp_path: Path) -> None:
    run = tmp_path / "run"
    for step in (1, 2):
        (run / f"step_{step}").mkdir(parents=True)
        torch.save({"w": torch.full((2,), float(step))}, run / f"step_{step}" / "model.pt")
    (run / "step_2" / "model.pt").write_bytes(hostile["hidden-pickle"].read_bytes())
    code, doc, _ = _run("stats", run)
    assert code == 1 and doc["mode"] == "run"
    assert {f["file"] for f in doc["findings"]} == {"step_2/model.pt"}
    assert _facts(doc["findings"]) == {("global", "os.system"), ("pickle-after-stop", None)}


def test_a_clean_file_has_no_findings(tmp_path: Path) -> None:
    path = tmp_path / "ok.pt"
    torch.save({"w": torch.ones(2, 2)}, path)
    code, doc, _ = _run("stats", path)
    assert code == 0 and doc["findings"] == []
