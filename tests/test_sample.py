"""ckpt sample."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import run_cli


def test_sample_overwrite_replaces_only_a_sample(tmp_path: Path) -> None:
    d = tmp_path / "sm"
    d.mkdir()
    (d / "thesis.tex").write_text("four years of work")
    (d / "latest").write_text("step_000400\n")
    r = run_cli("sample", d, "--overwrite")
    assert r.exit_code == 2 and "thesis.tex" in r.stderr and "not a sample run" in r.stderr
    assert (d / "thesis.tex").read_text() == "four years of work"
