"""FIFOs, sockets and devices where checkpoint files should be: reported, never read.

Every command runs in a subprocess with a timeout, so that a regression (a read that waits
for a FIFO's writer) fails the test instead of hanging the suite.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from ckpt_cli.errors import CkptError, CorruptCheckpointError
from ckpt_cli.formats.base import file_size, read_head, read_small
from ckpt_cli.storage import not_regular, open_regular
from tests.conftest import third_party_quiet

pytestmark = pytest.mark.requires_torch

ENV = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200"}
SD = {"a.weight": torch.arange(16.0).reshape(4, 4), "b.weight": torch.ones(8)}
SHARD_2 = "model-00002-of-00002.safetensors"
INDEX = "model.safetensors.index.json"


def _fifo(p: Path) -> None:
    p.unlink(missing_ok=True)
    os.mkfifo(p)


def _hf(d: Path) -> Path:
    d.mkdir()
    save_file({"a.weight": SD["a.weight"]}, d / "model-00001-of-00002.safetensors")
    save_file({"b.weight": SD["b.weight"]}, d / SHARD_2)
    (d / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": {
        "a.weight": "model-00001-of-00002.safetensors", "b.weight": SHARD_2}}))
    return d


def _dcp(d: Path) -> Path:
    with third_party_quiet():
        dcp.save({"model": dict(SD)}, checkpoint_id=str(d))  # type: ignore[attr-defined]
    return d


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """One checkpoint per case, each with a special file in one place."""
    root = tmp_path_factory.mktemp("special")
    cases: dict[str, Path] = {}
    _fifo(root / "x.safetensors")
    cases["fifo-argument"] = root / "x.safetensors"
    (root / "link.safetensors").symlink_to(root / "x.safetensors")
    cases["symlink-to-fifo-argument"] = root / "link.safetensors"
    sockets = [socket.socket(socket.AF_UNIX)]
    sockets[0].bind(str(root / "s.safetensors"))
    cases["socket-argument"] = root / "s.safetensors"
    d = _hf(root / "hf_index")
    _fifo(d / INDEX)
    cases["fifo-index-in-dir"] = d
    cases["fifo-index-argument"] = d / INDEX
    d = _hf(root / "hf_shard")
    _fifo(d / SHARD_2)
    cases["fifo-shard"] = d
    d = _hf(root / "hf_socket")
    (d / SHARD_2).unlink()
    sockets.append(socket.socket(socket.AF_UNIX))
    sockets[-1].bind(str(d / SHARD_2))
    cases["socket-shard"] = d
    d = root / "dir"
    d.mkdir()
    torch.save({"model": dict(SD)}, d / "checkpoint.pt")
    _fifo(d / "optimizer.pt")
    cases["fifo-beside-a-checkpoint"] = d
    d = _dcp(root / "dcp_metadata")
    _fifo(d / ".metadata")
    cases["fifo-dcp-metadata"] = d
    d = _dcp(root / "dcp_distcp")
    _fifo(sorted(d.glob("*.distcp"))[0])
    cases["fifo-distcp"] = d
    run = root / "run"
    run.mkdir()
    for step in (100, 200):
        (run / f"step_{step}").mkdir()
        torch.save({"model": dict(SD), "step": step}, run / f"step_{step}" / "checkpoint.pt")
    _fifo(run / "latest")
    cases["fifo-latest-pointer"] = run
    ds = root / "deepspeed"  # hand-made: only the names DeepSpeed gives its rank files
    (ds / "global_step10").mkdir(parents=True)
    (ds / "latest").write_text("global_step10")
    _fifo(ds / "global_step10" / "mp_rank_00_model_states.pt")
    _fifo(ds / "global_step10" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    cases["fifo-deepspeed-rank-files"] = ds
    (root / "out").mkdir()
    cases["good"] = root / "good.safetensors"
    save_file(dict(SD), cases["good"])
    yield cases
    for s in sockets:
        s.close()


def _run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckpt_cli", *map(str, args)], env=ENV,
                          capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)


# What each case reports: the special file's name and what it is.
EXPECTED = {
    "fifo-argument": "x.safetensors: not a regular file (a FIFO)",
    "symlink-to-fifo-argument": "link.safetensors: not a regular file (a FIFO)",
    "socket-argument": "s.safetensors: not a regular file (a socket)",
    "fifo-index-in-dir": f"{INDEX}: not a regular file (a FIFO)",
    "fifo-index-argument": f"{INDEX}: not a regular file (a FIFO)",
    "fifo-shard": f"{SHARD_2}: not a regular file (a FIFO)",
    "socket-shard": f"{SHARD_2}: not a regular file (a socket)",
    "fifo-beside-a-checkpoint": "optimizer.pt: not a regular file (a FIFO)",
    "fifo-dcp-metadata": ".metadata: not a regular file (a FIFO)",
    "fifo-distcp": "__0_0.distcp: not a regular file (a FIFO)",
    "fifo-latest-pointer": "latest: not a regular file",
    "fifo-deepspeed-rank-files": "mp_rank_00_model_states.pt: not a regular file (a FIFO)",
}
# Checkpoint arguments that are files: validate reports them as a usage error (exit 2).
ARGUMENT_CASES = {"fifo-argument", "symlink-to-fifo-argument", "socket-argument",
                  "fifo-index-argument"}


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_validate_reports_a_special_file(tree: dict[str, Path], case: str) -> None:
    r = _run("validate", tree[case])
    if case in ARGUMENT_CASES:
        assert r.returncode == 2, r.stdout + r.stderr
        assert r.stderr.startswith("ckpt: error: ") and EXPECTED[case] in r.stderr
        assert len(r.stderr.splitlines()) == 1
    else:
        assert r.returncode == 1, r.stdout + r.stderr
        assert f"error: {EXPECTED[case]}" in r.stdout
        assert "INVALID" in r.stdout


@pytest.mark.parametrize("case", sorted(set(EXPECTED) - {"fifo-latest-pointer",
                                                         "fifo-deepspeed-rank-files"}))
@pytest.mark.parametrize("command", ["inspect", "diff", "convert", "consolidate"])
def test_every_command_answers_at_once(tree: dict[str, Path], case: str,
                                       command: str) -> None:
    path = tree[case]
    out = tree["good"].parent / "out" / f"{case}-{command}.safetensors"
    args = {"inspect": [path], "diff": [path, tree["good"]], "convert": [path, "-o", out],
            "consolidate": [path, "-o", out]}[command]
    r = _run(command, *args)
    assert "Traceback" not in r.stderr
    assert not out.exists() or (command == "convert" and case == "fifo-beside-a-checkpoint")
    if r.returncode == 2:  # one line naming the file, perhaps a hint
        first, *rest = r.stderr.splitlines()
        assert first.startswith("ckpt: error: ") and all(x.startswith("hint: ") for x in rest)
    if command == "consolidate" and case in ARGUMENT_CASES | {"fifo-beside-a-checkpoint"}:
        return  # not sharded checkpoints: "nothing to consolidate", before any read
    if command in ("convert", "diff") and case == "fifo-beside-a-checkpoint":
        # An optimizer file, which an inference export leaves out, and whose problem diff
        # reports as a warning beside its comparison of the weights.
        assert r.returncode == 0
        assert command == "convert" or EXPECTED[case] in r.stderr
        return
    assert EXPECTED[case] in r.stdout + r.stderr
    assert r.returncode in ((0, 2) if command == "inspect" else (1, 2) if command == "diff"
                            else (2,))


@pytest.mark.parametrize("command", ["inspect", "validate", "diff", "prune"])
def test_a_fifo_pointer_in_a_run_directory_is_not_read(tree: dict[str, Path],
                                                       command: str) -> None:
    run = tree["fifo-latest-pointer"]
    args = {"inspect": [run], "validate": [run], "diff": [run, tree["good"]],
            "prune": [run, "--keep", "1", "--dry-run"]}[command]
    r = _run(command, *args)
    codes = (0, 3) if command == "prune" else (0, 1, 2)  # prune refuses to act: 3
    assert "Traceback" not in r.stderr and r.returncode in codes, r.stderr
    if command != "diff":
        assert "latest" in r.stdout + r.stderr and "not a regular file" in r.stdout + r.stderr


def test_the_helpers_refuse_special_files_without_opening_them(tmp_path: Path) -> None:
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    link = tmp_path / "link"
    link.symlink_to(fifo)
    regular = tmp_path / "r"
    regular.write_bytes(b"abc")
    assert not_regular(fifo) == "not a regular file (a FIFO)"
    assert not_regular(link) == "not a regular file (a FIFO)"  # the target counts
    assert not_regular(tmp_path) == "not a regular file (a directory)"
    assert not_regular(regular) is None and not_regular(tmp_path / "missing") is None
    assert not_regular(Path(os.devnull)) == "not a regular file (a character device)"
    for call in (lambda p: open_regular(p), lambda p: read_head(p, 4),
                 lambda p: read_small(p, 4), file_size):
        for p in (fifo, link):
            with pytest.raises(CorruptCheckpointError, match="not a regular file"):
                call(p)
    with pytest.raises(CkptError, match="no such file"):
        open_regular(tmp_path / "missing")
    assert read_head(regular, 2) == b"ab" and read_small(regular, 10) == b"abc"
    fd = open_regular(regular)
    try:
        assert os.get_blocking(fd)
    finally:
        os.close(fd)


@pytest.mark.parametrize("command", ["inspect", "consolidate", "prune"])
def test_fifo_rank_files_of_a_deepspeed_save_are_not_read(tree: dict[str, Path],
                                                          command: str) -> None:
    ds = tree["fifo-deepspeed-rank-files"]
    out = tree["good"].parent / "out" / "ds.safetensors"
    args = {"inspect": [ds], "consolidate": [ds, "-o", out],
            "prune": [ds, "--keep", "1", "--dry-run"]}[command]
    r = _run(command, *args)
    assert "Traceback" not in r.stderr and not out.exists()
    if command == "inspect":
        assert r.returncode == 0 and "not a regular" in r.stdout
    elif command == "consolidate":
        assert r.returncode == 2 and EXPECTED["fifo-deepspeed-rank-files"] in r.stderr
    else:  # the tag is kept as incomplete, saying why
        assert r.returncode == 0 and "0 to delete" in r.stdout
        assert "not a regular file (a FIFO)" in r.stdout
