"""Duplicate keys in a safetensors header are decided on decoded keys, as every JSON reader
sees them: ``"data\\u005foffsets"`` is ``data_offsets``, ``"__metadata\\u005f_"`` is
``__metadata__``. A header with two spellings of one key reads differently in different
readers (the safetensors library refuses a repeated field and keeps the last of a repeated
tensor name): an error, like a plain duplicate.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ckpt_cli.formats.safetensors import parse_header
from tests.conftest import run_cli

pytestmark = pytest.mark.requires_torch


def _with_header_edit(path: Path, old: bytes, new: bytes) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = raw[8:8 + n].rstrip()
    assert old in header
    header = header.replace(old, new, 1)
    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + n:])


def _file(tmp_path: Path) -> Path:
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.ones(4), "b": torch.zeros(2)}, path, metadata={"k": "v"})
    return path


CASES = {
    # a second data_offsets for "a", spelt with an escape; both spans are valid
    "escaped-data-offsets": (b'"data_offsets":[0,16]',
                             b'"data_offsets":[0,16],"data\\u005foffsets":[0,16]'),
    "plain-data-offsets": (b'"data_offsets":[0,16]',
                           b'"data_offsets":[0,16],"data_offsets":[0,16]'),
    "escaped-metadata": (b'"__metadata__":{"k":"v"}',
                         b'"__metadata__":{"k":"v"},"__metadata\\u005f_":{"k":"w"}'),
    "escaped-tensor-name": (b'"b":{', b'"\\u0062":{"dtype":"F32","shape":[2],'
                            b'"data_offsets":[0,8]},"b":{'),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_duplicate_key_is_an_error_however_it_is_spelt(tmp_path: Path, case: str) -> None:
    path = _file(tmp_path)
    _with_header_edit(path, *CASES[case])
    if case == "escaped-tensor-name":  # the library keeps the last of a repeated tensor
        with safe_open(str(path), "pt") as f:
            assert sorted(f.keys()) == ["a", "b"]
            assert f.get_tensor("b").tolist() == [0.0, 0.0]
    else:  # and refuses a repeated field, escaped or not
        with pytest.raises(Exception, match="duplicate field"):
            safe_open(str(path), "pt")
    _, _, _, findings = parse_header(path)
    assert [f.code for f in findings] == ["duplicate-key"], findings
    r = run_cli("validate", path)
    assert r.exit_code == 1, r.output
    assert "more than once (the safetensors library refuses a repeated field" in r.output


def test_escapes_without_duplicates_are_fine(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"caf\u00e9\n": torch.ones(4)}, path)  # serde_json escapes the newline
    _, header, _, findings = parse_header(path)
    assert not findings and "caf\u00e9\n" in header
