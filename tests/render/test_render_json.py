"""ckpt_cli.render.json: the documents every --json command writes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ckpt_cli.render import json as render_json
from ckpt_cli.render.json import SCHEMA_VERSION, dumps, emit, emit_error, emitted


def test_dumps_sorts_keys_and_ends_with_a_newline() -> None:
    out = dumps({"b": 1, "a": {"d": [1, 2], "c": None}})
    assert out.endswith(b"}\n")
    assert list(json.loads(out)) == ["a", "b"]
    assert out.index(b'"c"') < out.index(b'"d"')


def test_dumps_survives_odd_names_and_huge_integers() -> None:
    name = b"caf\xe9.pt".decode("utf-8", "surrogateescape")
    doc = json.loads(dumps({"path": name, "numel": 2**70}))
    assert doc["numel"] == 2**70
    assert "\\xe9" in doc["path"] or "\\xE9" in doc["path"]


def test_emit_writes_one_sorted_document_to_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    before = emitted()
    emit("inspect", {"zeta": 1, "alpha": {"y": 2, "x": 1}, "path": Path("/a/b")})
    out, err = capsys.readouterr()
    assert err == ""
    assert out.endswith("}\n") and out.count("\n}\n") == 1
    doc = json.loads(out)
    assert doc["schema_version"] == SCHEMA_VERSION == 1
    assert doc["command"] == "inspect"
    assert doc["path"] == "/a/b"
    assert list(doc) == sorted(doc)
    assert list(doc["alpha"]) == ["x", "y"]
    assert emitted() == before + 1


def test_emit_keeps_the_body(capsys: pytest.CaptureFixture[str]) -> None:
    emit("plan", {"rows": [1, 2]})
    assert json.loads(capsys.readouterr().out)["rows"] == [1, 2]


def test_emit_error_document(capsys: pytest.CaptureFixture[str]) -> None:
    emit_error("validate", {"kind": "usage", "message": "bad"}, 2)
    doc = json.loads(capsys.readouterr().out)
    assert doc == {"schema_version": 1, "command": "validate",
                   "error": {"kind": "usage", "message": "bad"}, "exit_code": 2}


def test_dumps_serialises_numpy_sets_tuples_and_paths() -> None:
    doc = json.loads(dumps({"n": np.int64(7), "a": np.arange(3), "s": frozenset({1}),
                            "t": (1, 2), "p": Path("x/y"), 3: "int key"}))
    assert doc == {"n": 7, "a": [0, 1, 2], "s": [1], "t": [1, 2], "p": "x/y", "3": "int key"}
    assert render_json.dumps({}) == b"{}\n"
