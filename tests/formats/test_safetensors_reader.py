"""The safetensors reader: hostile and odd headers."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckpt_cli.formats import read_index
from tests.conftest import run_cli

pytestmark = pytest.mark.requires_torch


def test_bad_header_types_are_clean_errors(tmp_path: Path) -> None:
    hdr = json.dumps({"a": {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}}).encode()
    hdr += b" " * (-len(hdr) % 8)
    p = tmp_path / "x.safetensors"
    p.write_bytes(struct.pack("<Q", len(hdr)) + hdr + b"\0" * 8)
    # inspect describes what it can and warns; validate fails it; convert refuses it.
    for cmd, code in ((["inspect", p], 0), (["validate", p], 1),
                      (["convert", p, "-o", tmp_path / "o"], 2)):
        r = run_cli(*cmd)
        assert r.exit_code == code and "Traceback" not in r.stderr, (cmd, r.stderr)
        assert "unknown dtype" in r.stdout + r.stderr, cmd


@pytest.mark.parametrize("header_len", [640, 896, 1152, 1408])
def test_safetensors_whose_length_bytes_look_like_a_pickle(tmp_path: Path,
                                                           header_len: int) -> None:
    # Header lengths 0x0280, 0x0380, 0x0480, 0x0580 start the file with \x80\x02..\x05, a
    # pickle protocol header; the file is still a safetensors file.
    path = tmp_path / "m.safetensors"
    for n in range(header_len):
        save_file({"w": torch.ones(4, 4)}, str(path), metadata={"note": "x" * n})
        if struct.unpack("<Q", path.read_bytes()[:8])[0] >= header_len:
            break
    assert struct.unpack("<Q", path.read_bytes()[:8])[0] == header_len
    assert read_index(path).format == "safetensors"
    r = run_cli("convert", path, "-o", tmp_path / "o.safetensors")
    assert r.exit_code == 0, r.output
    assert torch.equal(load_file(tmp_path / "o.safetensors")["w"], torch.ones(4, 4))
