"""The one door out (``ckpt_cli/storage/atomic.py``; docs/safety.md, "Where ckpt writes"):
whatever a command writes lands only on a new name or a regular file. A FIFO, a device or a
symbolic link at the destination is refused before any work, and stays what it was; missing
parents are created (and removed again when the write fails); errors name the destination,
never the hidden temporary."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from ckpt_cli.errors import CkptError
from ckpt_cli.storage.atomic import atomic_dir, atomic_file
from tests.conftest import run_cli


def _one_line_error(r: object, names: Path) -> str:
    code, out, err = r.exit_code, r.stdout, r.stderr  # type: ignore[attr-defined]
    assert code == 2, out + err
    assert "Traceback" not in err and "ckpt-tmp" not in err, err
    lines = err.strip().splitlines()
    assert lines[0].startswith(f"ckpt: error: {names}: "), err
    assert all(ln.startswith("hint: ") for ln in lines[1:]), err
    return lines[0]


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    path = tmp_path / "in" / "model.safetensors"
    path.parent.mkdir()
    save_file({"w": np.arange(16, dtype=np.float32).reshape(4, 4),
               "b": np.ones(4, dtype=np.float32)}, str(path))
    return path


def _specials(where: Path, suffix: str) -> Iterator[tuple[str, Path]]:
    """Each kind of destination that is no regular file, made in ``where``."""
    fifo = where / f"fifo{suffix}"
    os.mkfifo(fifo)
    yield "fifo", fifo
    target = where / f"target{suffix}"
    target.write_text("keep")
    link = where / f"link{suffix}"
    link.symlink_to(target)
    yield "link", link
    dangling = where / f"dangling{suffix}"
    dangling.symlink_to(where / f"nowhere{suffix}")
    yield "dangling", dangling
    if suffix == ".xml":
        yield "char", Path(os.devnull)
    if os.geteuid() == 0:  # only root can make a device node (and a container may forbid it)
        dev = where / f"dev{suffix}"
        try:
            os.mknod(dev, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # as /dev/null
        except PermissionError:
            return
        yield "char", dev


def _unchanged(kind: str, path: Path, where: Path, suffix: str) -> None:
    mode = os.lstat(path).st_mode
    if kind == "fifo":
        assert stat.S_ISFIFO(mode)
    elif kind == "char":
        assert stat.S_ISCHR(mode)
    else:
        assert stat.S_ISLNK(mode)
        assert (where / f"target{suffix}").read_text() == "keep"
        assert not (where / f"nowhere{suffix}").exists()
    assert not [p for p in where.iterdir() if ".ckpt-tmp-" in p.name]


def test_junit_onto_a_fifo_device_or_link_is_refused(weights: Path, tmp_path: Path) -> None:
    # --junit used to rename its temporary over whatever the path named: /dev/null became a
    # regular file (as root), a FIFO and a link were replaced by one.
    where = tmp_path / "reports"
    where.mkdir()
    for kind, dest in _specials(where, ".xml"):
        line = _one_line_error(run_cli("validate", weights, "--junit", dest), dest)
        assert "never writes through" in line, (kind, line)
        _unchanged(kind, dest, where, ".xml")
        # Before any work: the input's own problem is not reached.
        _one_line_error(run_cli("validate", tmp_path / "missing.pt", "--junit", dest), dest)
        _unchanged(kind, dest, where, ".xml")


def test_plot_destination_is_checked_before_reading(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # stats --plot into a directory or /proc read every checkpoint, then exited 101 naming its
    # temporary; a FIFO or a link was replaced by the plot.
    pytest.importorskip("torch")
    from tests.helpers.train_loop import injected_run

    run = tmp_path / "run"
    injected_run(run, checkpoints=2, jump_at=None, nan_at=None, freeze_from=None)
    cache = tmp_path / "cache"
    monkeypatch.setenv("CKPT_CACHE_DIR", str(cache))
    where = tmp_path / "plots"
    where.mkdir()
    (where / "dir.png").mkdir()
    (where / "file").write_text("x")
    bad = [(where / "dir.png", "is a directory"),
           (where / "file" / "plot.png", "cannot be written")]
    if Path("/proc/self").is_dir():
        bad.append((Path("/proc/ckpt-plot.png"), "cannot be written"))
    for dest, words in bad:
        line = _one_line_error(run_cli("stats", run, "--plot", dest), dest)
        assert words in line
    for kind, dest in _specials(where, ".png"):
        _one_line_error(run_cli("stats", run, "--plot", dest), dest)
        _unchanged(kind, dest, where, ".png")
    assert not cache.exists()  # nothing was read


def test_convert_names_the_destination_not_its_temporary(weights: Path,
                                                         tmp_path: Path) -> None:
    if Path("/proc/self").is_dir():  # no file can be created there, root or not
        dest = Path("/proc/ckpt-out.safetensors")
        line = _one_line_error(run_cli("convert", weights, "-o", dest), dest)
        assert "cannot be written" in line
    # A name long enough that the temporary's (".NAME.ckpt-tmp-...") passed the 255-byte
    # limit of one name: "File name too long", naming the temporary.
    long = tmp_path / ("x" * 240 + ".safetensors")
    r = run_cli("convert", weights, "-o", long)
    assert r.exit_code == 0, r.stderr
    assert long.is_file() and not [p for p in tmp_path.iterdir() if ".ckpt-tmp-" in p.name]


def test_convert_onto_a_fifo_or_link_is_refused_even_with_force(weights: Path,
                                                                tmp_path: Path) -> None:
    where = tmp_path / "out"
    where.mkdir()
    for kind, dest in _specials(where, ".safetensors"):
        line = _one_line_error(run_cli("convert", weights, "-o", dest, "--force"), dest)
        assert "never writes through" in line
        _unchanged(kind, dest, where, ".safetensors")


def test_missing_output_parents_are_created(weights: Path, tmp_path: Path) -> None:
    # As save_pretrained does; they used to be refused ("parent directory does not exist").
    for name in ("a/b/out.safetensors", "c/d/outdir"):
        dest = tmp_path / name
        r = run_cli("convert", weights, "-o", dest)
        assert r.exit_code == 0, r.stderr
        assert dest.exists()
    assert (tmp_path / "c" / "d" / "outdir" / "model.safetensors").is_file()


def test_a_failed_write_removes_the_parents_it_created(tmp_path: Path) -> None:
    # FP16 overflow is found while writing: no half-made directories stay behind.
    src = tmp_path / "big.safetensors"
    save_file({"w": np.full(4, 1e10, dtype=np.float32)}, str(src))
    for name in ("new/deeper/out.safetensors", "new/deeper/outdir"):
        r = run_cli("convert", src, "-o", tmp_path / name, "--to", "fp16")
        assert r.exit_code == 2, r.stdout + r.stderr
        assert "FP16" in r.stderr and "ckpt-tmp" not in r.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == ["big.safetensors"]


def test_os_errors_inside_the_temporary_name_the_destination(tmp_path: Path) -> None:
    dest = tmp_path / "out.bin"
    with pytest.raises(CkptError) as e, atomic_file(dest) as tmp:
        tmp.write_bytes(b"x")
        open(tmp, "xb")  # FileExistsError about the temporary
    assert str(e.value).startswith(f"{dest}: cannot write: ") and "ckpt-tmp" not in str(e.value)
    d = tmp_path / "outdir"
    with pytest.raises(CkptError) as e, atomic_dir(d) as tmp:
        (tmp / "sub").write_bytes(b"x")
        (tmp / "sub" / "x").write_bytes(b"x")  # NotADirectoryError about a file in it
    assert str(e.value).startswith(f"{d}/sub/x: cannot write: ")
    assert list(tmp_path.iterdir()) == []


def test_in_place_renames_land_only_on_regular_files(tmp_path: Path) -> None:
    # The thinning's and the receipts' one-rename replacements keep their crash-safety and
    # follow the same rule.
    from ckpt_cli.errors import DestinationError
    from ckpt_cli.storage.atomic import rename_at, rename_onto

    new = tmp_path / "new"
    new.write_text("new")
    old = tmp_path / "old"
    old.write_text("old")
    rename_onto(new, old)
    assert old.read_text() == "new" and not new.exists()
    for kind, dest in _specials(tmp_path, ".pt"):
        new.write_text("new")
        with pytest.raises(DestinationError, match="never writes through"):
            rename_onto(new, dest)
        assert new.read_text() == "new"
        _unchanged(kind, dest, tmp_path, ".pt")
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(DestinationError):
            rename_at(fd, "new", "link.pt")
        rename_at(fd, "new", "old")
    finally:
        os.close(fd)
    assert (tmp_path / "link.pt").is_symlink() and (tmp_path / "old").read_text() == "new"


def test_a_manifest_through_a_link_is_refused_before_hashing(weights: Path,
                                                             tmp_path: Path) -> None:
    from ckpt_cli.errors import DestinationError
    from ckpt_cli.manifest import write_manifest

    target = tmp_path / "elsewhere.json"
    target.write_text("keep")
    link = weights.parent / "model.safetensors.ckpt-manifest.json"
    link.symlink_to(target)
    with pytest.raises(DestinationError, match="symbolic link"):
        write_manifest(weights)
    assert link.is_symlink() and target.read_text() == "keep"


def test_an_existing_output_is_a_file_exists_error(weights: Path, tmp_path: Path) -> None:
    import ckpt_cli
    from ckpt_cli.errors import DestinationExistsError

    dest = tmp_path / "out.safetensors"
    dest.write_text("old")
    with pytest.raises(FileExistsError) as e:
        ckpt_cli.convert(weights, dest)
    assert isinstance(e.value, DestinationExistsError) and e.value.errno == errno.EEXIST
    assert e.value.filename == str(dest) and dest.read_text() == "old"
