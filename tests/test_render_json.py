"""ckpt_cli.render.json: the documents every --json command writes."""

from __future__ import annotations

import json

from ckpt_cli.render.json import dumps


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
