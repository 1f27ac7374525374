"""The safetensors reader's quick path for headers of many tensors gives what the careful path
gives: the same tensors, groups, findings (in order) and quick status; the byte-level depth
check agrees with a walk of the parsed header.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_cli import storage
from ckpt_cli.formats import probe, read_index
from ckpt_cli.formats import safetensors as sf
from ckpt_cli.storage.sidefiles import json_depth_over


def write_header(path: Path, header: dict[str, Any], data_len: int) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * data_len)
    return path


def _entry(dtype: str, shape: list[Any], begin: Any, end: Any, **extra: Any) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end], **extra}


def _tidy() -> dict[str, Any]:
    """Tensors laid out one after another, as writers do, with names of every group."""
    h: dict[str, Any] = {"__metadata__": {"step": "7"}}
    pos = 0
    names = ["model.embed.weight", "layers.0.attn.bias", "layers.0.attn.c_attn.bias",
             "bn.running_mean", "optimizer.state.0.exp_avg", "lr_scheduler.x", "model0.w",
             "ids", "h.0.attn.bias", "attn.bias", ".odd", "a..b", "mask", "z"]
    for i, name in enumerate(names):
        dtype, shape = [("F32", [2, 3]), ("I64", [4]), ("BF16", []), ("BOOL", [0, 5]),
                        ("U8", [3])][i % 5]
        n = {"F32": 4, "I64": 8, "BF16": 2, "BOOL": 1, "U8": 1}[dtype]
        size = n
        for d in shape:
            size *= d
        h[name] = _entry(dtype, shape, pos, pos + size)
        pos += size
    return h


def _hostile(h: dict[str, Any]) -> dict[str, Any]:
    """Every rule broken once, among tidy entries."""
    end = max(e["data_offsets"][1] for k, e in h.items() if k != "__metadata__")
    h = dict(h)
    h.update({
        "bad.bool_dim": _entry("F32", [True], end, end + 4),
        "bad.float_dim": _entry("F32", [1.0], end + 4, end + 8),
        "bad.negative": _entry("F32", [-1], end, end),
        "bad.dtype": _entry("F99", [1], end, end + 4),
        "bad.not_object": [1, 2],
        "bad.offsets_bool": _entry("U8", [1], False, True),
        "bad.offsets_three": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1, 2]},
        "bad.backwards": _entry("U8", [1], end + 9, end + 8),
        "bad.size": _entry("F32", [2], end + 8, end + 12),
        "bad.huge_dim": _entry("F32", [2**63, 0], end + 12, end + 12),
        "bad.many_dims": _entry("F32", [1] * 65, end + 12, end + 16),
        "bad.sub_byte": _entry("F4", [3], end + 16, end + 18),
        "extra.keys": _entry("F32", [1], end + 18, end + 22, note=[[1]]),
        "gap.after": _entry("F32", [1], end + 30, end + 34),
        "overlap": _entry("F32", [1], end + 32, end + 36),
    })
    return h


def _careful(monkeypatch: pytest.MonkeyPatch, path: Path) -> Any:
    with monkeypatch.context() as m:
        m.setattr(sf, "_fast_info", lambda *a, **k: None)
        return read_index(path, "safetensors")


@pytest.mark.parametrize("layout", ["tidy", "reversed", "hostile", "hostile-reversed",
                                    "short", "long"])
def test_quick_and_careful_paths_agree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       layout: str) -> None:
    h = _tidy() if layout in ("tidy", "reversed", "short", "long") else _hostile(_tidy())
    if layout.endswith("reversed"):
        meta = h.pop("__metadata__")
        h = {"__metadata__": meta, **dict(reversed(list(h.items())))}
    data_len = max(e["data_offsets"][1] for k, e in h.items()
                   if isinstance(e, dict) and k != "__metadata__"
                   and isinstance(e["data_offsets"][1], int))
    data_len += {"short": -3, "long": 5}.get(layout, 0)
    path = write_header(tmp_path / "m.safetensors", h, data_len)
    quick = read_index(path, "safetensors")
    careful = _careful(monkeypatch, path)
    assert list(quick.tensors.items()) == list(careful.tensors.items())
    assert quick.findings == careful.findings
    assert {t.group for t in quick.tensors.values()} >= {"model", "buffer", "optimizer",
                                                         "other"}
    if layout.startswith("hostile"):
        codes = {f.code for f in quick.findings}
        assert {"bad-shape", "unknown-dtype", "bad-entry", "bad-offsets", "size-mismatch",
                "misaligned", "gap", "overlap"} <= codes, codes
    elif layout in ("short", "long"):
        assert [f.code for f in quick.findings] == [
            "truncated" if layout == "short" else "trailing-bytes"]
    else:
        assert quick.findings == []


def test_quick_status_after_a_read_is_the_status_of_a_fresh_parse(tmp_path: Path) -> None:
    h = _hostile(_tidy())
    path = write_header(tmp_path / "m.safetensors", h, 10)
    fresh = probe.quick_status(path)
    read_index(path, "safetensors")
    h_ = storage.open_regular(path)
    try:
        assert sf.known_end(h_) is not None  # remembered, so not parsed again
    finally:
        storage.close(h_)
    assert probe.quick_status(path) == fresh
    with open(path, "ab") as f:  # changed since: parsed again
        f.write(b"\0" * 3)
    h_ = storage.open_regular(path)
    try:
        assert sf.known_end(h_) is None
    finally:
        storage.close(h_)
    assert probe.quick_status(path) != fresh


_text = st.text(alphabet='ab[]{}"\\\u00e9', max_size=6)
_json = st.recursive(st.none() | st.integers(-(2**63), 2**63 - 1) | _text,
                     lambda kids: st.lists(kids, max_size=3)
                     | st.dictionaries(_text, kids, max_size=3), max_leaves=40)


@settings(max_examples=300, deadline=None)
@given(doc=_json, limit=st.integers(0, 8))
def test_depth_from_the_bytes_is_the_depth_of_the_parsed_document(doc: Any, limit: int) -> None:
    for raw in (orjson.dumps(doc), json.dumps(doc, indent=1).encode(),
                json.dumps(doc, ensure_ascii=True).encode()):
        assert sf.text_depth_over(raw, limit) == json_depth_over(doc, limit), raw


def test_depth_counts_a_value_a_repeated_key_replaced() -> None:
    # serde_json refuses the text before any key is replaced; so does ckpt.
    raw = b'{"a": ' + b"[" * 10 + b"]" * 10 + b', "a": 1}'
    assert orjson.loads(raw) == {"a": 1}
    assert sf.text_depth_over(raw, 8)
    assert not sf.text_depth_over(raw, 11)
