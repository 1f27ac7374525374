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


@pytest.mark.requires_torch
def test_sample_counts_its_steps_when_not_a_terminal(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A CI log shows the run moving, step N of M, not five lines over minutes (issue 46).
    A shorter run (real training, 40 steps), and the 4-process save left out (tested above)."""
    from ckpt_cli.ops import sample

    monkeypatch.setattr(sample, "STEPS", (10, 20, 30))
    monkeypatch.setattr(sample, "DCP_STEP", 40)
    monkeypatch.setattr(sample, "_save_dcp", lambda _m, _o, out, _x: out.mkdir())
    r = run_cli("sample", tmp_path / "demo")
    assert r.exit_code == 0, r.output
    lines = r.stderr.splitlines()
    assert lines[0].startswith("sample: step 0/40: training ("), lines
    assert lines[1].startswith("sample: step 40/40: training ("), lines
    assert lines[2].startswith("sample: step 40/40: saving step 40 with torch.distributed"), \
        lines
    assert lines[3].startswith("sample: step 40/40: exporting HF-style"), lines
    assert len(lines) == 4
    assert (tmp_path / "demo" / "step_000030" / "checkpoint.pt").is_file()
    quiet = run_cli("sample", tmp_path / "quiet", "--quiet")
    assert quiet.exit_code == 0 and quiet.stderr == ""


def test_step_lines_every_n_steps_and_at_each_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from rich.console import Console

    from ckpt_cli.cli import progress

    buf = io.StringIO()
    monkeypatch.setattr(progress, "is_tty", lambda: False)
    monkeypatch.setattr(progress, "stderr", lambda: Console(file=buf, width=100))
    with progress.step_progress("sample", every=50) as report:
        for step in (*range(0, 200), 200, *range(200, 400), 400):
            report("training", step, 400)
        report("exporting", 400, 400)
    steps = [int(line.split()[2].split("/")[0]) for line in buf.getvalue().splitlines()]
    assert steps == [0, 50, 100, 150, 200, 250, 300, 350, 400, 400]
    assert buf.getvalue().splitlines()[-1].startswith("sample: step 400/400: exporting (")


def test_step_bar_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from rich.console import Console

    from ckpt_cli.cli import progress

    buf = io.StringIO()
    monkeypatch.setattr(progress, "is_tty", lambda: True)
    monkeypatch.setattr(progress, "stderr", lambda: Console(file=buf, force_terminal=True,
                                                            width=100))
    with progress.step_progress("sample") as report:
        report("training", 150, 400)
    assert "sample: training" in buf.getvalue() and "150/400" in buf.getvalue()


@pytest.mark.requires_torch
def test_the_untrained_sample_files_have_the_trained_sample_layout(
        trained_sample_run: Path, sample_run: Path) -> None:
    """The fast tier's ``sample_run`` (tests/helpers/sample_files.py, no training) stands for
    ``ckpt sample``'s output: the same files, and in each checkpoint the same tensor names,
    dtypes and shapes; only the values differ. ``ckpt sample``'s own loss falls."""
    import torch

    from ckpt_cli.formats import read_index

    def files(root: Path) -> list[str]:
        return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())

    assert files(sample_run) == files(trained_sample_run)
    for ckpt in ("step_000100", "step_000200", "step_000300", "step_000400", "export"):
        want, got = read_index(trained_sample_run / ckpt), read_index(sample_run / ckpt)
        assert got.format == want.format, ckpt
        assert {n: (t.dtype, t.shape) for n, t in got.tensors.items()} == {
            n: (t.dtype, t.shape) for n, t in want.tensors.items()}, ckpt
    losses = [torch.load(trained_sample_run / f"step_{s:06d}" / "checkpoint.pt",
                         weights_only=True)["loss"] for s in (100, 200, 300)]
    assert losses[-1] < losses[0], losses
