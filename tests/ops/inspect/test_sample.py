"""ckpt sample."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import run_cli
from tests.helpers.child import ckpt_in_child


def test_sample_overwrite_replaces_only_a_sample(tmp_path: Path) -> None:
    d = tmp_path / "sm"
    d.mkdir()
    (d / "thesis.tex").write_text("four years of work")
    (d / "latest").write_text("step_000400\n")
    r = run_cli("sample", d, "--overwrite")
    assert r.exit_code == 2 and "thesis.tex" in r.stderr and "not a sample run" in r.stderr
    assert (d / "thesis.tex").read_text() == "four years of work"


def test_sample_overwrite_never_replaces_a_file_or_a_link(tmp_path: Path) -> None:
    f = tmp_path / "notes.txt"
    f.write_text("keep me")
    r = run_cli("sample", f, "--overwrite")
    assert r.exit_code == 2 and "is a file, not a sample run" in r.stderr, r.stderr
    assert f.read_text() == "keep me"
    target = tmp_path / "elsewhere"
    target.mkdir()
    link = tmp_path / "link"
    link.symlink_to(target)
    r = run_cli("sample", link, "--overwrite")
    assert r.exit_code == 2 and "is a symbolic link, not a sample run" in r.stderr, r.stderr
    assert link.is_symlink() and list(target.iterdir()) == []


def test_sample_into_an_existing_directory_stops_before_importing_torch(tmp_path: Path) -> None:
    """Refused at once (exit 2), not after importing torch (1.5 s, 230 MB)."""
    d = tmp_path / "demo-run"
    d.mkdir()
    r = ckpt_in_child("sample", str(d),
                      report="'\\nEXIT=%s TORCH=%s' % (code, 'torch' in sys.modules)")
    assert r.stderr.endswith("EXIT=2 TORCH=False"), r.stderr
    assert f"{d}: already exists" in r.stderr and "--overwrite" in r.stderr
    assert list(d.iterdir()) == []
