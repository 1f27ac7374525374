"""ckpt sample."""

from __future__ import annotations

from pathlib import Path

import pytest

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


@pytest.mark.requires_torch
def test_the_dcp_save_is_tried_again_once_when_a_worker_dies(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A gloo worker aborted on a busy machine (seen once in a full test run): the sample's
    4-process save runs again, on a new port, into an emptied directory; a second failure is
    one error line, not an internal error."""
    import torch
    import torch.multiprocessing as mp

    from ckpt_cli.errors import CkptError
    from ckpt_cli.ops import sample

    real = mp.spawn
    calls: list[int] = []

    def flaky(fn: object, args: tuple[object, ...], nprocs: int, join: bool) -> object:
        calls.append(int(args[3]))  # type: ignore[call-overload]
        out = Path(str(args[2]))
        if len(calls) == 1:
            (out / "__0_0.distcp").write_bytes(b"half a save")
            raise mp.ProcessExitedException("process 0 terminated with signal SIGABRT", 0, 0,
                                            -6)
        return real(fn, args=args, nprocs=nprocs, join=join)  # type: ignore[arg-type]

    monkeypatch.setattr(mp, "spawn", flaky)
    torch.manual_seed(0)
    model = sample.TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = tmp_path / "step"
    out.mkdir()
    sample._save_dcp(model, opt, out, {"step": 1})
    assert len(calls) == 2
    assert (out / ".metadata").is_file() and (out / "__0_0.distcp").stat().st_size > 100
    r = run_cli("validate", out)
    assert r.exit_code == 0, r.output

    def always(fn: object, args: tuple[object, ...], nprocs: int, join: bool) -> object:
        raise mp.ProcessExitedException("process 0 terminated with signal SIGABRT", 0, 0, -6)

    monkeypatch.setattr(mp, "spawn", always)
    with pytest.raises(CkptError, match="failed twice"):
        sample._save_dcp(model, opt, tmp_path / "other", {"step": 1})
