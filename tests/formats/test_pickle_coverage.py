"""Every pickle a loader could execute is scanned, whatever its prefix or position, and one ckpt
cannot scan fails validate (fail closed; other commands warn).

The zips start from torch.save's own records and add a second archive directory: torch 2.13
refuses a zip whose records sit under two prefixes, but a loader that takes the prefix of the
first record (``b/``) would unpickle ``b/data.pkl`` where ckpt, following torch, reads
``a/data.pkl``. DCP's BYTE_IO items are such zips too (``dcp.load`` unpickles them with
``torch.load(weights_only=False)``).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import warnings
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckpt_cli.formats import read_index
from tests.conftest import run_cli, third_party_quiet
from tests.helpers.damage import edit_dcp_metadata

pytestmark = pytest.mark.requires_torch


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("echo pwned",))


EVIL = pickle.dumps(_Evil(), protocol=2)


def _mixed_zip(dest: Path | None, *, compress_evil: bool, evil_name: str = "b/data.pkl",
               evil: bytes = EVIL) -> bytes:
    """A torch.save zip moved under ``a/``, with a first record under ``b/`` and a pickle
    calling ``os.system`` at ``evil_name`` (deflated: ckpt cannot scan it)."""
    src = io.BytesIO()
    torch.save({"w": torch.arange(4.0)}, src)
    with zipfile.ZipFile(io.BytesIO(src.getvalue())) as zf:
        records = [(i.filename.split("/", 1)[1], zf.read(i.filename)) for i in zf.infolist()]
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("b/version", b"3\n")
        for name, data in records:
            zf.writestr("a/" + name, data)
        zf.writestr(evil_name, evil,
                    compress_type=zipfile.ZIP_DEFLATED if compress_evil else zipfile.ZIP_STORED)
    data = out.getvalue()
    if dest is not None:
        dest.write_bytes(data)
    return data


def _validate(path: Path) -> tuple[int, dict[str, Any]]:
    r = run_cli("validate", path, "--json")
    return r.exit_code, json.loads(r.stdout)


def _findings(doc: dict[str, Any]) -> list[tuple[str, str]]:
    return [(f["severity"], f["code"]) for c in doc["checkpoints"] for f in c["findings"]]


# A pickle that runs os.system before an opcode ckpt's scanner does not know: Python's
# unpickler has run the call by the time it stops.
UNREADABLE = EVIL[:-1] + b"\xff."


@pytest.mark.parametrize("how", ["deflated", "unreadable"])
def test_an_unscannable_pickle_under_another_prefix_fails_validate(tmp_path: Path,
                                                                   how: str) -> None:
    path = tmp_path / "mixed.pt"
    _mixed_zip(path, compress_evil=how == "deflated",
               evil=EVIL if how == "deflated" else UNREADABLE)
    code, doc = _validate(path)
    assert code == 1 and not doc["valid"]
    assert ("error", "unscanned-pickle") in _findings(doc)
    # elsewhere it is a warning: inspect still shows the file
    index = read_index(path)
    assert ("warning", "unscanned-pickle") in [(f.severity, f.code) for f in index.findings]
    r = run_cli("inspect", path)
    assert r.exit_code == 0 and "could not be scanned" in r.output


@pytest.mark.parametrize("evil_name", ["b/data.pkl", "a/data/evil.pkl", "c/d/e.pkl"])
def test_every_pkl_record_is_scanned(tmp_path: Path, evil_name: str) -> None:
    path = tmp_path / "mixed.pt"
    _mixed_zip(path, compress_evil=False, evil_name=evil_name)
    code, doc = _validate(path)
    assert code == 1 and ("error", "unsafe-global") in _findings(doc), doc


def _dcp_with_item(d: Path, item: bytes) -> None:
    """A real DCP checkpoint whose BYTE_IO item ``extra.step`` is replaced by ``item``,
    appended to its .distcp file, with ``.metadata`` pointing at it."""
    with third_party_quiet():
        dcp.save({"model": {"w": torch.ones(4)}, "extra": {"step": 7}},  # type: ignore[attr-defined]
                 checkpoint_id=str(d))
    distcp = sorted(d.glob("*.distcp"))[0]
    offset = distcp.stat().st_size
    with open(distcp, "ab") as f:
        f.write(item)

    def edit(md: Any) -> None:
        for key, info in md.storage_data.items():
            if key.fqn == "extra.step":
                info.relative_path, info.offset, info.length = distcp.name, offset, len(item)
                return
        raise AssertionError("no BYTE_IO item")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        edit_dcp_metadata(d, edit)


def test_the_dcp_byte_io_variant_fails_validate(tmp_path: Path) -> None:
    d = tmp_path / "dcp"
    _dcp_with_item(d, _mixed_zip(None, compress_evil=True))
    code, doc = _validate(d)
    assert code == 1 and not doc["valid"]
    assert ("error", "unscanned-pickle") in _findings(doc)


def test_the_dcp_byte_io_variant_scanned(tmp_path: Path) -> None:
    d = tmp_path / "dcp"
    _dcp_with_item(d, _mixed_zip(None, compress_evil=False))
    code, doc = _validate(d)
    assert code == 1 and ("error", "unsafe-global") in _findings(doc)


@pytest.mark.parametrize("payload,finding", [
    (b"\x80\x02c__torch__.os\nsystem\nX\x04\x00\x00\x00echo\x85R.",
     ("unsafe-global", "__torch__.os.system")),
    # a TorchScript-shaped name no code/ of the file defines: refused as unknown
    (b"\x80\x02}X\x01\x00\x00\x00ac__torch__.mypkg\nThing\ns.",
     ("unknown-global", "__torch__.mypkg.Thing")),
])
def test_torchscript_names_outside_their_stand_ins_are_refused(
        tmp_path: Path, payload: bytes, finding: tuple[str, str]) -> None:
    path = tmp_path / "t.pt"
    torch.save({"w": torch.ones(2)}, path)
    with zipfile.ZipFile(path) as zf:
        records = [(i.filename, zf.read(i.filename)) for i in zf.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for name, data in records:
            zf.writestr(name, payload if name.endswith("data.pkl") else data)
    code, doc = _validate(path)
    assert code == 1
    assert finding in {(f["code"], f["location"]) for c in doc["checkpoints"]
                       for f in c["findings"]}
