"""Issue #46 item 4, "smaller holes": hostile files made here, each failing before its fix.

- a ``model.safetensors`` linked to a file outside the run (its first 8 bytes never echoed);
- a torch zip whose ``data.pkl`` hides a second pickle after STOP;
- step names with a final newline, names with ``\\n``/``\\r`` inside;
- ``-o -``.
(The FP8 scale rule is in ``tests/fp8/test_scale_rule.py``.)
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from ckpt_cli.errors import CorruptCheckpointError
from ckpt_cli.formats.safetensors import parse_header
from tests.conftest import run_cli

# A value no message may show: the file's first 8 bytes read as a little-endian u64.
SECRET = 3_619_251_681_095_544_690


def _secret_file(where: Path) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    p = where / "secret"
    p.write_bytes(struct.pack("<Q", SECRET) + os.urandom(4096))
    return p


def _linked_run(tmp_path: Path) -> Path:
    """An HF Trainer checkpoint whose model.safetensors links to random bytes elsewhere."""
    secret = _secret_file(tmp_path / "elsewhere")
    ck = tmp_path / "run" / "checkpoint-1"
    ck.mkdir(parents=True)
    (ck / "trainer_state.json").write_text('{"global_step": 1, "log_history": []}')
    (ck / "config.json").write_text("{}")
    (ck / "model.safetensors").symlink_to(secret)
    good = tmp_path / "run" / "checkpoint-2"
    good.mkdir()
    (good / "trainer_state.json").write_text('{"global_step": 2, "log_history": []}')
    save_file({"w": np.ones((2, 2), np.float32)}, str(good / "model.safetensors"))
    return tmp_path / "run"


def _no_secret(text: str) -> None:
    assert str(SECRET) not in text.replace(",", "")


def test_an_implausible_header_length_is_named_never_echoed(tmp_path: Path) -> None:
    f = tmp_path / "model.safetensors"
    f.write_bytes(struct.pack("<Q", SECRET) + os.urandom(64))
    r = run_cli("validate", f)
    assert r.exit_code == 1
    assert "header length field is implausible" in r.output
    _no_secret(r.output)
    small = tmp_path / "small.safetensors"
    small.write_bytes(struct.pack("<Q", 50_000) + b"{" + bytes(63))
    with pytest.raises(CorruptCheckpointError) as err:
        parse_header(small)
    assert "header length field is larger than the 72-byte file" in err.value.message
    assert "50000" not in err.value.message.replace(",", "")


@pytest.mark.parametrize("command", [("validate",), ("stats",), ("watch", "--once"),
                                     ("inspect",)])
def test_run_commands_read_nothing_a_symlink_takes_out_of_the_run(
        tmp_path: Path, command: tuple[str, ...]) -> None:
    run = _linked_run(tmp_path)
    r = run_cli(*command, run)
    _no_secret(r.output)
    assert "header length" not in r.output
    if command[0] not in ("stats", "inspect"):  # (their tables shorten the reason)
        assert "model.safetensors is a symbolic link out of the run directory" in r.output
    if command[0] == "validate":
        assert r.exit_code == 1


def test_a_checkpoint_named_on_its_own_is_read_through_its_links(tmp_path: Path) -> None:
    """The hub cache's layout (snapshots/<rev>/* -> ../../blobs) stays readable."""
    blob = tmp_path / "blobs" / "abc"
    blob.parent.mkdir()
    save_file({"w": np.ones((2, 2), np.float32)}, str(blob))
    snap = tmp_path / "snapshots" / "rev"
    snap.mkdir(parents=True)
    (snap / "model.safetensors").symlink_to(os.path.relpath(blob, snap))
    assert run_cli("validate", snap).exit_code == 0


def _hidden_pickle_zip(tmp_path: Path, hidden: bytes | None = None) -> tuple[Path, Path]:
    """A torch.save zip whose data.pkl has a second pickle (calling os.system) after STOP,
    the zip rebuilt with every record STORED in its order (offsets, CRCs and the central
    directory all consistent)."""
    import zipfile

    import torch

    src, out = tmp_path / "plain.pt", tmp_path / "hidden.pt"
    torch.save({"w": torch.ones(2, 2)}, src)
    marker = tmp_path / "ran"
    command = f"touch {marker}".encode()
    if hidden is None:  # os.system("touch <marker>"), if anything ever read it
        hidden = (b"\x80\x02cos\nsystem\nq\x00X" + struct.pack("<I", len(command)) + command
                  + b"\x85R.")
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename.endswith("/data.pkl"):
                data += hidden
            zout.writestr(info.filename, data)
    return out, marker


@pytest.mark.requires_torch
def test_a_second_pickle_after_data_pkl_stop_is_reported(tmp_path: Path) -> None:
    import torch

    path, marker = _hidden_pickle_zip(tmp_path)
    # What torch.load reads: the first pickle only (the hidden one never runs).
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.ones(2, 2))
    assert not marker.exists()
    r = run_cli("validate", path)
    assert r.exit_code == 1, r.output
    assert "bytes after its pickle's STOP" in r.output
    assert "os.system" in r.output
    r = run_cli("inspect", path)  # the same findings, from the same reader
    assert "bytes after its pickle's STOP" in r.output and "os.system" in r.output


@pytest.mark.parametrize("name", ["checkpoint-1\n", "global_step1\n", "iter_0000001\n",
                                  "model-1.safetensors\n", "step-1\n"])
def test_a_final_newline_is_not_part_of_a_step_name(name: str) -> None:
    from ckpt_cli.formats.names import step_from_name

    assert step_from_name(name) is None
    assert step_from_name(name.rstrip("\n")) == 1


def test_names_with_line_breaks_are_listed_as_skipped(tmp_path: Path) -> None:
    from ckpt_cli.runs import ODD_NAME_SKIPPED, list_run

    odd = ["model-1.safetensors\n", "model-3\nx.safetensors", "model-4.safetensors\r"]
    for name in ["model-2.safetensors", *odd]:
        save_file({"w": np.ones(2, np.float32)}, str(tmp_path / name))
    (tmp_path / "checkpoint-5\n").mkdir()
    listing = list_run(tmp_path)
    assert [e.name for e in listing.entries] == ["model-2.safetensors"]
    skipped = sorted(f.file or "" for f in listing.findings if f.code == ODD_NAME_SKIPPED)
    assert skipped == sorted([*odd, "checkpoint-5\n"])
    r = run_cli("inspect", tmp_path)
    assert r.exit_code == 0
    assert "model-1.safetensors\\x0a: a line break in its name" in r.output
    assert "checkpoint-5\n" not in r.output  # escaped, never a forged line


@pytest.mark.parametrize("command", [("convert", "-o", "-"), ("consolidate", "-o", "-"),
                                     ("validate", "--junit", "-"), ("stats", "--plot", "-")])
def test_dash_is_refused_as_an_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      command: tuple[str, ...]) -> None:
    src = tmp_path / "model.safetensors"
    save_file({"w": np.ones((2, 2), np.float32)}, str(src))
    monkeypatch.chdir(tmp_path)
    r = run_cli(command[0], src, *command[1:])
    assert r.exit_code == 2, r.output
    assert "'-' (standard output) is not an output here" in r.output
    assert not (tmp_path / "-").exists()


@pytest.mark.requires_torch
def test_plain_data_after_stop_is_a_warning(tmp_path: Path) -> None:
    """torch.load ignores it: a warning (an error with --strict), not a refusal."""
    path, _ = _hidden_pickle_zip(tmp_path, b"\x80\x02K\x01.")
    r = run_cli("validate", path)
    assert r.exit_code == 0, r.output
    assert "warning" in r.output and "bytes after its pickle's STOP" in r.output
    assert run_cli("validate", path, "--strict").exit_code == 1
