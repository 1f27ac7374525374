"""Write-behind syncing (``writers.pipeline.Syncer``): each shard is made durable in the
background while the next one is written, every shard is durable before the output is renamed
into place, and a failed background sync fails the write, leaving no output."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from ckpt_cli.errors import CkptError
from ckpt_cli.writers import OutTensor, files, pipeline, write_checkpoint


def _tensors(n: int = 3, size: int = 4096) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {f"w{i}": rng.standard_normal(size, dtype=np.float32) for i in range(n)}


def _out(values: dict[str, np.ndarray]) -> list[OutTensor]:
    return [OutTensor(name, "F32", tuple(a.shape), lambda a=a: a) for name, a in values.items()]


def _path_of(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


@pytest.fixture
def synced(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Every fdatasync the writer makes, as ``(file name, thread name)``."""
    calls: list[tuple[str, str]] = []
    real = os.fdatasync

    def spy(fd: int) -> None:
        calls.append((Path(_path_of(fd)).name, threading.current_thread().name))
        real(fd)

    monkeypatch.setattr(pipeline.os, "fdatasync", spy)
    return calls


def test_a_shard_syncs_while_the_next_one_is_written(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The first shard's sync cannot finish until the second shard's bytes have been written:
    a writer that waited for each sync before going on would never get there (the sync would
    time out and the write fail)."""
    second_written = threading.Event()
    real_write_all, real_sync = files.write_all, os.fdatasync
    writes: list[str] = []

    def write_all(f, data):  # type: ignore[no-untyped-def]
        real_write_all(f, data)
        writes.append(Path(f.name).name)
        if sum(1 for w in writes if w.startswith("model-00002-")) == 2:  # header, then data
            second_written.set()

    first_synced: list[bool] = []

    def sync(fd: int) -> None:
        if Path(_path_of(fd)).name.startswith("model-00001-"):
            first_synced.append(second_written.is_set())
            if not second_written.wait(timeout=20):
                raise OSError(errno.ETIMEDOUT, "the writer waited for this sync")
        real_sync(fd)

    monkeypatch.setattr(files, "write_all", write_all)
    monkeypatch.setattr(pipeline.os, "fdatasync", sync)
    values = _tensors()
    dest = tmp_path / "out"
    res = write_checkpoint(dest, _out(values), max_shard_size=20_000)
    # Shard 1 was synced once, and its sync ended only after shard 2 was written.
    assert len(first_synced) == 1 and second_written.is_set() and res.index_file is not None
    got: dict[str, np.ndarray] = {}
    for name in sorted(p.name for p in dest.glob("model-*.safetensors")):
        got.update(load_file(dest / name))
    assert sorted(got) == sorted(values)
    assert all(np.array_equal(got[k], v) for k, v in values.items())


def test_every_shard_is_synced_in_the_background_before_the_commit(
        tmp_path: Path, synced: list[tuple[str, str]], monkeypatch: pytest.MonkeyPatch) -> None:
    from ckpt_cli.storage import atomic

    seen_at_rename: list[list[tuple[str, str]]] = []
    real_replace = atomic.replace_dir

    def replace_dir(tmp: Path, dest: Path, overwrite: bool) -> None:
        seen_at_rename.append(list(synced))
        real_replace(tmp, dest, overwrite)

    monkeypatch.setattr(atomic, "replace_dir", replace_dir)
    write_checkpoint(tmp_path / "out", _out(_tensors()), max_shard_size=20_000)
    assert len(seen_at_rename) == 1
    before = {name for name, _ in seen_at_rename[0]}
    assert before == {f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)}
    assert {thread for _, thread in synced} == {"ckpt-fdatasync"}


def test_a_single_file_is_synced_before_it_is_renamed(tmp_path: Path,
                                                      synced: list[tuple[str, str]]) -> None:
    dest = tmp_path / "model.safetensors"
    write_checkpoint(dest, _out(_tensors()))
    assert len(synced) == 1 and synced[0][1] == "ckpt-fdatasync"
    assert synced[0][0] != dest.name  # the temporary file, before the rename
    assert dest.is_file()


def test_syncs_every_interval_of_a_large_file(tmp_path: Path, synced: list[tuple[str, str]],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pipeline.Flusher, "EVERY", 16_384)
    write_checkpoint(tmp_path / "model.safetensors", _out(_tensors(8)))  # 8 x 16 KiB
    assert 8 <= len(synced) <= 9  # every 16 KiB, and the rest at the end


@pytest.mark.parametrize("which", ["model-00001-", "model-00003-"])
def test_a_failed_background_sync_fails_the_write(tmp_path: Path, which: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.fdatasync

    def sync(fd: int) -> None:
        if Path(_path_of(fd)).name.startswith(which):
            raise OSError(errno.EIO, "Input/output error")
        real(fd)

    monkeypatch.setattr(pipeline.os, "fdatasync", sync)
    dest = tmp_path / "out"
    with pytest.raises(CkptError, match="cannot write: Input/output error"):
        write_checkpoint(dest, _out(_tensors()), max_shard_size=20_000)
    assert not dest.exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # no temporary directory left either
    # No descriptor duplicated for a sync is left open.
    assert not [fd for fd in os.listdir("/proc/self/fd")
                if _safe_link(fd).startswith(str(tmp_path))]


def _safe_link(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def test_a_parts_shard_is_durable_before_it_takes_its_final_name(
        tmp_path: Path, synced: list[tuple[str, str]], monkeypatch: pytest.MonkeyPatch) -> None:
    """A part (``--part K/N``) renames a shard into ``out/`` only once it is fsynced: a rerun
    part's shard could otherwise meet an earlier run's receipt vouching for it."""
    from ckpt_cli.parts import Part
    from ckpt_cli.writers import PartJob
    from ckpt_cli.writers import parts as parts_mod

    fsynced: list[str] = []
    renamed: list[tuple[str, bool]] = []
    real_fsync, real_replace = parts_mod.fsync_path, parts_mod.os.replace

    def fsync_path(path: Path) -> None:
        real_fsync(path)
        fsynced.append(Path(path).name)

    def replace(src: str | Path, dst: str | Path) -> None:
        renamed.append((Path(dst).name, Path(src).name in fsynced))
        real_replace(src, dst)

    monkeypatch.setattr(parts_mod, "fsync_path", fsync_path)
    monkeypatch.setattr(parts_mod.os, "replace", replace)
    values = _tensors(6)
    dest = tmp_path / "out"
    for k in (1, 2):
        res = write_checkpoint(dest, _out(values), max_shard_size=20_000,
                               part=PartJob(Part(k, 2), source_id="test"))
        assert res.part is not None and res.part.files
    shards = [(name, ok) for name, ok in renamed if name.startswith("model-")]
    assert len(shards) == 6 and all(ok for _, ok in shards), renamed
    # ...and the background syncs ran for them too.
    assert {name.split(".ckpt-tmp")[0].lstrip(".") for name, _ in synced} >= {
        name for name, _ in shards}
    got: dict[str, np.ndarray] = {}
    for p in dest.glob("model-*.safetensors"):
        got.update(load_file(p))
    assert sorted(got) == sorted(values)
    assert all(np.array_equal(got[k], v) for k, v in values.items())
