"""The stats figure cache trusts nothing it cannot check (issue 46): any file name is a key,
a cache directory (or subdirectory) that is a link or that someone else could write is refused
with one line, entries are bound to each file's full stamp and bounded by their checkpoint."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

from ckpt_cli.formats import read_index
from ckpt_cli.ops.stats import cache as cache_mod
from ckpt_cli.ops.stats.cache import SUBDIR, VERSION, FigureCache, identity, key_of
from tests.conftest import run_cli

ROOT = Path(__file__).resolve().parents[3]
NAMES = ["a.weight", "b.weight", "c.bias"]


def nan_checkpoint(path: Path) -> Path:
    """A checkpoint holding one NaN (stats exits 1 on it)."""
    save_file({"a.weight": np.array([1.0, float("nan"), 3.0, 4.0], dtype=np.float32),
               "b.weight": np.arange(6, dtype=np.float32),
               "c.bias": np.zeros(2, dtype=np.float32)}, str(path))
    return path


def run(ckpt: Path, cache: Path, *args: str) -> Any:
    return run_cli("stats", ckpt, "--json", "--cache-dir", cache, *args)


def doc_of(r: Any, code: int) -> dict[str, Any]:
    assert r.exit_code == code, r.stdout + r.stderr
    out: dict[str, Any] = json.loads(r.stdout)
    return out


def refused(r: Any, path: Path, problem: str) -> None:
    """One line naming the path and the problem, exit 2, no traceback."""
    assert r.exit_code == 2, r.stdout + r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("ckpt: error:")]
    assert len(lines) == 1, r.stderr
    assert str(path) in lines[0] and problem in lines[0], lines[0]
    assert "Traceback" not in r.stderr


def entries(cache: Path) -> list[Path]:
    return sorted((cache / SUBDIR).glob("*/*.json"))


def forge(p: Path) -> None:
    """Edit an entry into a self-consistent one saying no value is NaN."""
    doc = json.loads(p.read_bytes())
    for figs in doc["tensors"].values():
        figs[1] += figs[8]  # count: the NaN counted as a finite value...
        figs[8] = 0  # ...and none left: the counts still add up to numel
    p.write_text(json.dumps(doc))


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return nan_checkpoint(tmp_path / "model.safetensors")


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache"


def test_the_forged_entry_fixture_is_believed_where_only_its_user_writes(ckpt: Path,
                                                                       cache: Path) -> None:
    # What the tests below defend against: whoever can write the entry decides the verdict
    # (documented in docs/stats.md: the cache is as trusted as its directory).
    assert doc_of(run(ckpt, cache), 1)["tensors"]
    for p in entries(cache):
        forge(p)
    assert doc_of(run(ckpt, cache), 0)["read"]["cached_tensors"] == 3


# --- any file name ------------------------------------------------------------------------------

def test_a_file_name_that_is_not_utf8_is_a_cache_key(tmp_path: Path) -> None:
    d = os.fsencode(tmp_path) + b"/run-\xff"
    os.mkdir(d)
    f = d + b"/model-\xfe.safetensors"
    nan_checkpoint(Path(os.fsdecode(f)))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_COLOR": "1"}
    argv = [os.fsencode(sys.executable), b"-m", b"ckpt_cli", b"stats", f, b"--json",
            b"--cache-dir", os.fsencode(tmp_path / "cache")]
    for cached in (0, 3):
        p = subprocess.run(argv, capture_output=True, env=env, timeout=120, check=False)
        assert p.returncode == 1, p.stderr.decode(errors="replace")  # the NaN, nothing else
        doc = json.loads(p.stdout)
        assert doc["read"]["cached_tensors"] == cached
        assert doc["anomalies"][0]["kind"] == "nan"


# --- directories only the user can write --------------------------------------------------------

def _where(cache: Path, which: str) -> Path:
    if which == "root":
        return cache
    if which == "version":
        return cache / SUBDIR
    return entries(cache)[0].parent


@pytest.mark.parametrize("mode", [0o775, 0o757, 0o1777, 0o2770])
@pytest.mark.parametrize("which", ["root", "version", "subdir"])
def test_a_forged_entry_in_a_directory_others_can_write_is_refused(
        ckpt: Path, cache: Path, which: str, mode: int) -> None:
    doc_of(run(ckpt, cache), 1)
    for p in entries(cache):
        forge(p)  # as a member of the group (or anyone) could, once they can write there
    where = _where(cache, which)
    where.chmod(mode)
    who = " and ".join(w for bit, w in ((0o020, "its group"), (0o002, "everyone")) if mode & bit)
    refused(run(ckpt, cache), where, f"is writable by {who} (mode {mode:04o})")
    r = run(ckpt, cache)
    assert "chmod go-w" in r.stderr
    # a shared --part cache is refused the same way, saying how to make it safe
    r = run(ckpt, cache, "--part", "1/2")
    refused(r, where, "writable by")
    assert "0700 or 0755" in r.stderr
    where.chmod(0o755)  # one user's again: read (the forged entry is its user's own word)
    assert run(ckpt, cache).exit_code in (0, 1)


def test_a_cache_directory_that_is_a_symlink_is_refused(ckpt: Path, tmp_path: Path) -> None:
    real = tmp_path / "real-cache"
    real.mkdir(mode=0o700)
    link = tmp_path / "cache-link"
    link.symlink_to(real)
    refused(run(ckpt, link), link, "is a symbolic link")
    assert not any(real.iterdir()), "written through the link"
    assert doc_of(run(ckpt, real), 1)["read"]["computed_tensors"] == 3  # the target itself


@pytest.mark.parametrize("which", ["version", "subdir"])
def test_a_symlinked_cache_subdirectory_is_refused_and_not_written(
        ckpt: Path, cache: Path, tmp_path: Path, which: str) -> None:
    doc_of(run(ckpt, cache), 1)
    where = _where(cache, which)
    elsewhere = tmp_path / "elsewhere"
    where.rename(elsewhere)
    for p in elsewhere.rglob("*.json"):
        forge(p)
        p.chmod(0o600)
    where.symlink_to(elsewhere)
    before = sorted((p.name, p.stat().st_mtime_ns) for p in elsewhere.rglob("*"))
    refused(run(ckpt, cache), where, "is a symbolic link")
    assert sorted((p.name, p.stat().st_mtime_ns) for p in elsewhere.rglob("*")) == before


def test_a_symlink_planted_before_the_first_run_receives_no_write(ckpt: Path, cache: Path,
                                                                  tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cache.mkdir(mode=0o700)
    (cache / SUBDIR).symlink_to(elsewhere)
    refused(run(ckpt, cache), cache / SUBDIR, "is a symbolic link")
    assert not any(elsewhere.iterdir())


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                    reason="giving a directory to another user needs root")
@pytest.mark.parametrize("which", ["root", "version", "subdir"])
def test_a_cache_directory_of_another_user_is_refused(ckpt: Path, cache: Path,
                                                      which: str) -> None:
    doc_of(run(ckpt, cache), 1)
    where = _where(cache, which)
    os.chown(where, 4242, -1)
    refused(run(ckpt, cache), where, "belongs to another user (uid 4242)")


@pytest.mark.parametrize("parent_mode", [0o1777, 0o775])
def test_the_parents_do_not_matter(ckpt: Path, tmp_path: Path, parent_mode: int) -> None:
    # a sticky /tmp, a group's project directory: the cache directory itself is checked, and
    # everything below is reached from its descriptor
    parent = tmp_path / "shared"
    parent.mkdir()
    parent.chmod(parent_mode)
    cache = parent / "mine"
    doc_of(run(ckpt, cache), 1)
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in entries(cache))
    assert doc_of(run(ckpt, cache), 1)["read"]["cached_tensors"] == 3


# --- entry files --------------------------------------------------------------------------------

def test_an_entry_writable_by_others_is_not_trusted_and_replaced(ckpt: Path,
                                                                 cache: Path) -> None:
    doc_of(run(ckpt, cache), 1)
    for d in (cache, cache / SUBDIR, entries(cache)[0].parent):
        d.chmod(0o755)  # others may enter, not write
    (p,) = entries(cache)
    forge(p)
    p.chmod(0o666)  # ...but this file they could write
    doc = doc_of(run(ckpt, cache), 1)  # the NaN found again
    assert doc["read"]["computed_tensors"] == 3
    assert stat.S_IMODE(p.stat().st_mode) == 0o600  # replaced by one only its user writes


def test_an_entry_that_is_a_symlink_is_not_followed(ckpt: Path, cache: Path,
                                                    tmp_path: Path) -> None:
    doc_of(run(ckpt, cache), 1)
    (p,) = entries(cache)
    forged = tmp_path / "forged.json"
    p.rename(forged)
    forge(forged)
    p.symlink_to(forged)
    before = forged.read_bytes()
    assert doc_of(run(ckpt, cache), 1)["read"]["computed_tensors"] == 3
    # Neither written through nor replaced (the one door out's rule: docs/safety.md): the
    # link stays, its target unchanged, and the figures are computed again each time.
    assert p.is_symlink() and forged.read_bytes() == before
    assert doc_of(run(ckpt, cache), 1)["read"]["computed_tensors"] == 3


def test_an_entry_that_is_a_fifo_is_not_waited_for(ckpt: Path, cache: Path) -> None:
    doc_of(run(ckpt, cache), 1)
    (p,) = entries(cache)
    p.unlink()
    os.mkfifo(p)
    assert doc_of(run(ckpt, cache), 1)["read"]["computed_tensors"] == 3


# --- bound to the file's full stamp -------------------------------------------------------------

def test_a_rewrite_that_restores_size_and_mtime_is_recomputed(tmp_path: Path,
                                                              cache: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file({"a.weight": np.arange(4, dtype=np.float32)}, str(path))
    assert doc_of(run(path, cache), 0)["read"]["computed_tensors"] == 1
    st = path.stat()
    save_file({"a.weight": np.array([0.0, float("nan"), 2.0, 3.0], dtype=np.float32)},
              str(path))  # same size, in place (same inode), a NaN in it
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # touch -r: the old time back
    assert path.stat().st_size == st.st_size
    doc = doc_of(run(path, cache), 1)
    assert doc["read"]["computed_tensors"] == 1 and doc["anomalies"][0]["kind"] == "nan"


def test_the_key_holds_each_files_inode_and_change_time(tmp_path: Path) -> None:
    path = nan_checkpoint(tmp_path / "model.safetensors")
    ident = identity(read_index(path))
    st = path.stat()
    assert ident[0] == VERSION
    assert ident[3][0][2:] == [st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]


# --- bounded by the checkpoint ------------------------------------------------------------------

@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many figure lists and documents the cache parsed."""
    calls = [0, 0]
    from_list = cache_mod.Moments.from_list
    loads = cache_mod.orjson.loads

    def counting_from_list(data: Any) -> Any:
        calls[0] += 1
        return from_list(data)

    def counting_loads(data: Any) -> Any:
        calls[1] += 1
        return loads(data)

    monkeypatch.setattr(cache_mod.Moments, "from_list", staticmethod(counting_from_list))
    monkeypatch.setattr(cache_mod.orjson, "loads", counting_loads)
    return calls


def _entry_path(ckpt: Path, cache: Path) -> tuple[str, Path]:
    key = key_of(identity(read_index(ckpt)))
    return key, cache / SUBDIR / key[:2] / f"{key}.json"


def test_an_entry_padded_with_two_million_names_is_refused_unread(
        ckpt: Path, cache: Path, counted: list[int]) -> None:
    doc_of(run(ckpt, cache), 1)
    key, p = _entry_path(ckpt, cache)
    figs = json.dumps(json.loads(p.read_bytes())["tensors"]["b.weight"]).encode()
    p.write_bytes(b'{"version":%d,"key":"%s","updates":{},"tensors":{' % (VERSION, key.encode())
                  + b",".join(b'"p%d":%s' % (i, figs) for i in range(2_000_000)) + b"}}")
    fc = FigureCache(cache)
    counted[:] = [0, 0]
    assert not fc.load(key, dict.fromkeys(NAMES)).tensors
    assert counted == [0, 0], "the padded entry was parsed"
    assert "over the" in fc.rejected[str(p)], fc.rejected
    doc = doc_of(run(ckpt, cache), 1)  # recomputed, and the NaN found
    assert doc["read"]["computed_tensors"] == 3


def test_an_entry_with_more_names_than_its_checkpoint_is_refused_uncounted(
        ckpt: Path, cache: Path, counted: list[int]) -> None:
    doc_of(run(ckpt, cache), 1)
    key, p = _entry_path(ckpt, cache)
    doc = json.loads(p.read_bytes())
    figs = doc["tensors"]["b.weight"]
    doc["tensors"].update({f"p{i}": figs for i in range(20)})  # small: under the size cap
    p.write_text(json.dumps(doc))
    fc = FigureCache(cache)
    counted[:] = [0, 0]
    assert not fc.load(key, dict.fromkeys(NAMES)).tensors
    assert counted == [0, 1], "figures of the padded entry were parsed"
    assert "more than the checkpoint's 3" in fc.rejected[str(p)], fc.rejected


def test_an_entry_naming_a_tensor_its_checkpoint_lacks_is_not_trusted(ckpt: Path,
                                                                      cache: Path) -> None:
    doc_of(run(ckpt, cache), 1)
    key, p = _entry_path(ckpt, cache)
    doc = json.loads(p.read_bytes())
    doc["tensors"]["not.there"] = doc["tensors"].pop("c.bias")
    p.write_text(json.dumps(doc))
    assert not FigureCache(cache).load(key, dict.fromkeys(NAMES)).tensors


def test_the_default_cache_directory_an_older_ckpt_left_group_writable_is_tightened(
        ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Older versions made ``~/.cache/ckpt`` under the umask (0775 under umask 002, Debian's
    and Ubuntu's default): the default location is ckpt's own, so its others' write bits go
    instead of every ``stats`` run being refused. A directory the user named is still
    refused (the test above)."""
    monkeypatch.delenv("CKPT_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    root = tmp_path / "xdg" / "ckpt"
    root.mkdir(parents=True)
    os.chmod(root, 0o775)
    r = run_cli("stats", ckpt, "--json")
    assert r.exit_code == 1, r.output  # the NaN: computed and reported, not refused
    assert stat.S_IMODE(root.stat().st_mode) == 0o755
    assert entries(root)
    r = run_cli("stats", ckpt, "--json", "--cache-dir", root)  # tight now: trusted as named
    assert r.exit_code == 1, r.output
