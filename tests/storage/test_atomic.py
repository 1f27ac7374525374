"""ckpt_cli.storage.atomic: outputs appear whole or not at all."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckpt_cli.errors import CkptError
from ckpt_cli.storage.atomic import atomic_dir, atomic_file


def test_atomic_file_appears_only_on_success(tmp_path: Path) -> None:
    dest = tmp_path / "out.bin"
    with atomic_file(dest) as tmp:
        tmp.write_bytes(b"hello")
        assert not dest.exists() and tmp.parent == tmp_path
    assert dest.read_bytes() == b"hello"
    assert list(tmp_path.iterdir()) == [dest]


def test_atomic_file_exception_removes_the_temporary(tmp_path: Path) -> None:
    dest = tmp_path / "out.bin"
    dest.write_bytes(b"old")
    with pytest.raises(RuntimeError), atomic_file(dest, overwrite=True) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("boom")
    assert dest.read_bytes() == b"old"
    assert list(tmp_path.iterdir()) == [dest]


def test_existing_destination_needs_overwrite(tmp_path: Path) -> None:
    dest = tmp_path / "out.bin"
    dest.write_bytes(b"old")
    with pytest.raises(CkptError, match="already exists"), atomic_file(dest) as tmp:
        tmp.write_bytes(b"new")
    assert dest.read_bytes() == b"old"
    with atomic_file(dest, overwrite=True) as tmp:
        tmp.write_bytes(b"new")
    assert dest.read_bytes() == b"new"


def test_atomic_dir_replaces_whole_or_not_at_all(tmp_path: Path) -> None:
    dest = tmp_path / "d"
    with atomic_dir(dest) as tmp:
        (tmp / "a").write_text("1")
        assert not dest.exists()
    assert [p.name for p in dest.iterdir()] == ["a"]
    with pytest.raises(KeyboardInterrupt), atomic_dir(dest, overwrite=True) as tmp:
        (tmp / "b").write_text("2")
        raise KeyboardInterrupt
    assert [p.name for p in dest.iterdir()] == ["a"]
    assert [p.name for p in tmp_path.iterdir()] == ["d"]
    with pytest.raises(CkptError, match="already exists"), atomic_dir(dest):
        pass
    with atomic_dir(dest, overwrite=True) as tmp:
        (tmp / "b").write_text("2")
    assert [p.name for p in dest.iterdir()] == ["b"]
    assert [p.name for p in tmp_path.iterdir()] == ["d"]
