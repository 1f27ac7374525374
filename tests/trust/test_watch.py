"""``ckpt watch``, the run ledger it writes, and resuming from a verified checkpoint.

Runs are written by a real DCP training loop in a subprocess (tests/helpers/dcp_loop.py); the
watcher runs as a separate ``ckpt watch`` process beside it, or as ``--once`` from cron.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from ckpt_cli.ops.resume import choose, latest_verified
from ckpt_cli.ops.watch import Watcher, WatchEvent, WatchOptions
from ckpt_cli.trust import ledger
from tests.conftest import run_cli

pytestmark = pytest.mark.requires_torch

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(ROOT), NO_COLOR="1")


def train(run: Path, saves: int, kill_at: int | None = None) -> int:
    """Run the DCP loop to its end (or its kill -9); its exit status."""
    cmd = [sys.executable, "-m", "tests.helpers.dcp_loop", str(run), str(saves)]
    if kill_at is not None:
        cmd += ["--kill-at", str(kill_at)]
    return subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, check=False).returncode


def watch_once(run: Path, *args: str) -> tuple[int, list[dict[str, Any]], str]:
    r = subprocess.run([sys.executable, "-m", "ckpt_cli", "watch", str(run), "--once",
                        "--json", "--settle", "0s", *args], env=ENV, cwd=ROOT,
                       capture_output=True, text=True, check=False)
    return r.returncode, [json.loads(line) for line in r.stdout.splitlines()], r.stderr


def watcher(run: Path, *args: str, stderr: int = subprocess.DEVNULL,
            ) -> tuple[subprocess.Popen[str], IO[str], queue.Queue[str]]:
    """``ckpt watch RUN --json ARGS`` as a process beside the test, its stdout, and a queue a
    reader thread fills with its stdout lines."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckpt_cli", "watch", str(run), "--json", *args],
        env=ENV, cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True)
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    out = proc.stdout
    threading.Thread(target=lambda: [lines.put(s) for s in out], daemon=True).start()
    return proc, out, lines


def watch_events(lines: queue.Queue[str], enough: Callable[[], bool]) -> Iterator[dict[str, Any]]:
    """The watcher's JSON events as they come, until ``enough()`` is true; stops after 120 s
    all the same (a hang guard, not a timing assertion)."""
    deadline = time.monotonic() + 120
    while not enough() and time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            continue
        yield json.loads(line)


def verdicts(run: Path) -> dict[str, str]:
    book = ledger.read_ledger(run)
    assert book is not None
    return {p: e.verdict for p, e in book.latest().items()}


@pytest.mark.parametrize("wake", ["poll", "events"])
def test_sidecar_beside_a_training_loop_killed_mid_save(tmp_path: Path, wake: str) -> None:
    if wake == "events":
        pytest.importorskip("watchfiles")
    run = tmp_path / "run"
    run.mkdir()
    proc, out, lines = watcher(run, "--interval", "0.1s", "--settle", "0", "--abandon-after",
                               "1h", "--wake", wake)
    try:
        assert train(run, 4, kill_at=4) == -9  # step_8 killed before its .metadata
        seen: dict[str, dict[str, Any]] = {}
        for ev in watch_events(lines, lambda: len(seen) >= 3):
            seen[ev["path"]] = ev
        # A few more passes over the partial step_8: it must never be verified.
        time.sleep(0.5)
    finally:
        proc.terminate()
        proc.wait()
        out.close()
    while not lines.empty():
        ev = json.loads(lines.get())
        seen[ev["path"]] = ev
    assert {p: e["verdict"] for p, e in seen.items()} == {
        "step_2": "good", "step_4": "good", "step_6": "good"}
    assert "step_8" not in verdicts(run)
    assert latest_verified(run) == run / "step_6"
    r = run_cli("resume-path", run)
    assert r.exit_code == 0 and r.stdout.strip() == str(run / "step_6")


def test_a_partial_save_is_reported_abandoned_after_the_grace_period(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert train(run, 2, kill_at=2) == -9
    code, events, _ = watch_once(run)
    # The partial step_4 is named as not committed yet, not judged: still exit 0.
    assert code == 0 and [(e["event"], e["path"], e["verdict"]) for e in events] == [
        ("verified", "step_2", "good"), ("pending", "step_4", None)]
    assert events[1]["pending"]["state"] == "incomplete"
    assert "no .metadata" in events[1]["pending"]["detail"]
    assert verdicts(run) == {"step_2": "good"}
    old = time.time() - 3600
    for p in [*(run / "step_4").iterdir(), run / "step_4"]:
        os.utime(p, (old, old))
    code, events, err = watch_once(run, "--abandon-after", "10m")
    assert code == 1
    assert [(e["event"], e["path"], e["verdict"]) for e in events] == [
        ("abandoned", "step_4", "bad")]
    assert "abandoned" in err and "step_4" in err
    assert verdicts(run) == {"step_2": "good", "step_4": "bad"}
    assert latest_verified(run) == run / "step_2"


def test_restart_does_not_revalidate_and_a_corrupted_shard_is_rejected(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert train(run, 3) == 0
    code, events, _ = watch_once(run)
    assert code == 0 and [e["path"] for e in events] == ["step_2", "step_4", "step_6"]
    lines = len(ledger.read_ledger(run).entries)  # type: ignore[union-attr]
    code, events, _ = watch_once(run)  # a restarted watcher: the ledger is its state
    assert code == 0 and events == []
    assert len(ledger.read_ledger(run).entries) == lines  # type: ignore[union-attr]

    # The newest shard is cut short after its save: resume and the next pass reject it.
    shard = run / "step_6" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-16])
    choice = choose(run)
    assert choice is not None and choice.path == run / "step_4"
    assert choice.rejected and choice.rejected[0][0] == "step_6"
    hook = tmp_path / "bad.txt"
    code, events, err = watch_once(
        run, "--on-bad", f"{sys.executable} -c \"import os,sys; "
        f"open(sys.argv[1], 'a').write(os.environ['CKPT_BAD_PATH'] + chr(10))\" {hook}")
    assert code == 1
    assert [(e["path"], e["verdict"]) for e in events] == [("step_6", "bad")]
    assert "BAD" in err and "step_6" in err
    assert hook.read_text().splitlines() == [str(run / "step_6")]
    r = run_cli("resume-path", run, "--json")
    assert r.exit_code == 0
    assert json.loads(r.stdout)["path"] == str(run / "step_4")


def test_same_size_corruption_is_caught_with_full_verification(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert train(run, 2) == 0
    assert watch_once(run)[0] == 0
    shard = run / "step_4" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert latest_verified(run, verify="full") == run / "step_2"
    assert run_cli("resume-path", run, "--full").stdout.strip() == str(run / "step_2")


def test_the_on_bad_path_never_reaches_a_shell(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert train(run, 1) == 0
    evil = run / "step_2; touch pwned"
    (run / "step_2").rename(evil)
    (evil / "__0_0.distcp").write_bytes(b"garbage")
    code, events, _ = watch_once(run, "--on-bad", "true $CKPT_BAD_PATH")
    assert code == 1 and events and events[0]["verdict"] == "bad"
    assert not (ROOT / "pwned").exists() and not (tmp_path / "pwned").exists()


def test_no_verified_checkpoint_is_exit_1_with_a_message(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    r = run_cli("resume-path", run)
    assert r.exit_code == 1 and "no verified checkpoint" in r.stderr
    assert latest_verified(run) is None


def test_retention_counts_only_verified_and_survives_a_concurrent_cron_prune(
        tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert train(run, 5) == 0
    # A cron prune runs while the watcher applies its own retention.
    cron = subprocess.Popen([sys.executable, "-m", "ckpt_cli", "prune", str(run), "--keep", "2",
                             "--grace", "0", "--yes"], env=ENV, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    code, _events, err = watch_once(run, "--keep", "2", "--grace", "0")
    cron.wait()
    assert code in (0, 1), err
    # Which of the two held the lock decides what went in this round (the cron prune, started
    # before anything was verified, counts nothing yet; the watcher may find the lock taken):
    # whatever happened, the newest two are there. The next cron round finishes the job.
    left = {p.name for p in run.iterdir() if p.name.startswith("step_")}
    assert {"step_8", "step_10"} <= left
    r = subprocess.run([sys.executable, "-m", "ckpt_cli", "prune", str(run), "--keep", "2",
                        "--grace", "0", "--yes"], env=ENV, cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    left = {p.name for p in run.iterdir() if p.name.startswith("step_")}
    assert left == {"step_8", "step_10"}
    assert {p: v for p, v in verdicts(run).items() if p in left} == {
        "step_8": "good", "step_10": "good"}
    # Whatever was deleted, the newest verified one is there and still resumable.
    assert latest_verified(run, verify="full") == run / "step_10"


def test_many_runs_under_one_root(tmp_path: Path) -> None:
    for name in ("a", "b"):
        assert train(tmp_path / name, 1) == 0
    got: list[WatchEvent] = []
    w = Watcher(tmp_path, WatchOptions(settle=0), got.append)
    w.run_pass()
    assert sorted((Path(e.run).name, e.path, e.verdict) for e in got) == [
        ("a", "step_2", "good"), ("b", "step_2", "good")]
    assert w.run_pass() == []  # an idle pass: nothing changed, nothing said
    assert latest_verified(tmp_path / "a") == tmp_path / "a" / "step_2"


def test_an_idle_pass_reads_no_checkpoint_again(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import ckpt_cli.ops.watch as watch

    run = tmp_path / "run"
    assert train(run, 2) == 0
    w = Watcher(run, WatchOptions(settle=0), lambda _e: None)
    assert [e.verdict for e in w.run_pass()] == ["good", "good"]

    def never(*_a: object, **_k: object) -> None:
        raise AssertionError("an unchanged checkpoint was read again")

    monkeypatch.setattr(watch, "verify_checkpoint", never)
    monkeypatch.setattr(watch.ledger, "recheck", never)
    assert w.run_pass() == []
    assert w.run_pass() == []


def test_a_checkpoint_a_writer_still_locks_waits(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert train(run, 1) == 0
    lock = run / "step_2.lock"
    lock.write_text("")
    w = Watcher(run, WatchOptions(settle=0), lambda _e: None)
    assert w.run_pass() == []
    assert ledger.read_ledger(run) is None
    lock.unlink()
    assert [(e.path, e.verdict) for e in w.run_pass()] == [("step_2", "good")]


def test_the_cli_never_imports_the_integrations() -> None:
    code = ("import sys; from ckpt_cli.cli.app import app; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('transformers', 'lightning') "
            "or m.startswith('ckpt_cli.integrations')]; assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], env=ENV, cwd=ROOT, capture_output=True,
                       text=True, check=False)
    assert r.returncode == 0, r.stderr


def _bad_run(tmp_path: Path) -> Path:
    """A run whose only checkpoint has a garbage shard (a real DCP save, then cut)."""
    run = tmp_path / "run"
    assert train(run, 1) == 0
    (run / "step_2" / "__0_0.distcp").write_bytes(b"garbage")
    return run


def test_an_on_bad_command_that_cannot_start_is_reported(tmp_path: Path) -> None:
    run = _bad_run(tmp_path)
    code, events, err = watch_once(run, "--on-bad", "no-such-ckpt-hook --flag")
    assert code == 1
    assert [(e["event"], e["path"]) for e in events] == [("verified", "step_2"),
                                                         ("error", "step_2")]
    assert events[0]["on_bad"] is None
    hook = events[1]["on_bad"]
    assert hook["command"] == "no-such-ckpt-hook" and hook["status"] is None
    assert hook["timed_out"] is False and hook["error"]
    assert "'no-such-ckpt-hook' could not be started" in err
    assert "--flag" not in err


def test_an_on_bad_command_that_fails_is_reported_with_its_status(tmp_path: Path) -> None:
    run = _bad_run(tmp_path)
    code, events, err = watch_once(
        run, "--on-bad", f"{sys.executable} -c \"print('hook says hi'); raise SystemExit(3)\"")
    assert code == 1
    assert [(e["event"], e["path"]) for e in events] == [("verified", "step_2"),
                                                         ("error", "step_2")]
    assert events[1]["on_bad"] == {"command": sys.executable, "status": 3,
                                   "timed_out": False, "error": None}
    assert f"--on-bad command {sys.executable!r} exited with status 3" in err
    # The hook's own output goes to stderr: stdout carries only the JSON lines.
    assert "hook says hi" in err
    # From Python the message names the keyword, not the flag.
    from ckpt_cli.ops.watch.hooks import HookResult

    said = HookResult("x", 3).describe("python")
    assert said == "on_bad command 'x' exited with status 3"
    assert HookResult("x", 3).describe("cli") == f"--{said.replace('_', '-', 1)}"


def test_an_on_bad_command_that_succeeds_adds_nothing(tmp_path: Path) -> None:
    run = _bad_run(tmp_path)
    code, events, err = watch_once(run, "--on-bad", f"{sys.executable} -c pass")
    assert code == 1
    assert [(e["event"], e["on_bad"]) for e in events] == [("verified", None)]
    assert "--on-bad" not in err


def test_an_on_bad_command_past_its_timeout_is_killed_with_its_children(
        tmp_path: Path) -> None:
    run = _bad_run(tmp_path)
    pidfile = tmp_path / "child.pid"
    # The hook starts a grandchild that would outlive it, then hangs.
    script = ("import subprocess, sys, time; "
              "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
              f"open({str(pidfile)!r}, 'w').write(str(c.pid)); time.sleep(600)")
    code, events, err = watch_once(run, "--on-bad", f"{sys.executable} -c \"{script}\"",
                                   "--on-bad-timeout", "2s")
    assert code == 1
    assert events[1]["event"] == "error"
    assert events[1]["on_bad"]["timed_out"] is True
    assert events[1]["on_bad"]["status"] == -9
    assert "timed out and was killed" in err
    child = int(pidfile.read_text())
    # The grandchild was in the hook's process group: killed too (reaped by init, or gone).
    deadline = time.monotonic() + 30  # a hang guard, not a timing assertion
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{child}/stat").read_text().split(") ")[1][0]
        except (FileNotFoundError, IndexError):
            break
        if state == "Z":
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the hook's child {child} survived the timeout")


def test_on_bad_timeout_is_a_duration(tmp_path: Path) -> None:
    run = _bad_run(tmp_path)
    r = run_cli("watch", run, "--once", "--on-bad", "true", "--on-bad-timeout", "5")
    assert r.exit_code == 2 and "--on-bad-timeout" in r.stderr


def test_once_within_settle_names_what_is_settling_and_exits_0(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert train(run, 2) == 0
    # Just written (as right after a copy): within --settle 1h, nothing is judged yet.
    r = subprocess.run([sys.executable, "-m", "ckpt_cli", "watch", str(run), "--once",
                        "--json", "--settle", "1h"], env=ENV, cwd=ROOT, capture_output=True,
                       text=True, check=False)
    assert r.returncode == 0, r.stderr
    events = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(e["event"], e["path"], e["verdict"]) for e in events] == [
        ("pending", "step_2", None), ("pending", "step_4", None)]
    assert all(e["pending"]["state"] == "settling" for e in events)
    assert "within --settle" in events[0]["pending"]["detail"]
    assert all(e["on_bad"] is None for e in events)
    assert r.stderr == ""
    assert ledger.read_ledger(run) is None  # nothing recorded: the next run judges them

    r = subprocess.run([sys.executable, "-m", "ckpt_cli", "watch", str(run), "--once",
                        "--settle", "1h"], env=ENV, cwd=ROOT, capture_output=True, text=True,
                       check=False)
    assert r.returncode == 0
    lines = r.stdout.splitlines()
    assert len(lines) == 2 and all("pending" in s and "settling" in s for s in lines)
    assert lines[0].startswith(f"ckpt watch: pending: {run}/step_2: settling (changed ")
    assert lines[0].endswith("; not checked in this pass")
    # From Python the same detail names the keyword: settle=..., not --settle.
    import ckpt_cli

    python = ckpt_cli.watch_once(run, settle="1h").to_dict()["events"]
    assert [e["event"] for e in python] == ["pending", "pending"]
    detail = python[0]["pending"]["detail"]
    assert "within settle=60m00s" in detail and "--" not in detail

    # Once settled, the next --once judges both and names nothing pending.
    code, events, _ = watch_once(run)
    assert code == 0 and [(e["event"], e["verdict"]) for e in events] == [
        ("verified", "good"), ("verified", "good")]


def test_once_names_a_checkpoint_a_writer_still_locks(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert train(run, 1) == 0
    (run / "step_2.lock").write_text("")
    code, events, _ = watch_once(run)
    assert code == 0
    assert [(e["event"], e["path"], e["pending"]) for e in events] == [
        ("pending", "step_2", {"state": "locked", "detail": "a writer holds step_2.lock"})]


def test_a_long_running_watcher_does_not_repeat_pending(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert train(run, 1) == 0
    got: list[WatchEvent] = []
    w = Watcher(run, WatchOptions(settle=3600), got.append)
    assert w.run_pass() == [] and got == []


def _replace_with(dst: Path, src: Path) -> None:
    """Put ``src``'s bytes at ``dst`` by rename, as a save writing ``dst`` again would."""
    tmp = dst.with_name(dst.name + ".tmp-copy")
    tmp.write_bytes(src.read_bytes())
    os.replace(tmp, dst)


def test_a_rewritten_lightning_last_ckpt_is_a_new_save_not_damage(tmp_path: Path) -> None:
    from tests.conftest import third_party_quiet
    from tests.helpers.makers import lightning_run

    with third_party_quiet():
        run = lightning_run(tmp_path / "run", steps=4)  # last.ckpt: a copy, at step 4
        later = lightning_run(tmp_path / "later", steps=8)  # later saves of the same run
    last = run / "last.ckpt"
    assert last.is_file() and not last.is_symlink()
    got: list[WatchEvent] = []
    w = Watcher(run, WatchOptions(settle=0), got.append)
    w.run_pass()
    assert verdicts(run) == {"epoch=0-step=2.ckpt": "good", "epoch=0-step=4.ckpt": "good",
                             "last.ckpt": "good"}
    assert latest_verified(run) == last

    # Lightning writes last.ckpt again at its next save (step 6 here): a restarted watcher
    # (sizes only) and a running one (which re-hashes a changed good one) verify it afresh.
    time.sleep(0.01)  # a newer mtime than the verdict (not a timing assertion)
    _replace_with(last, later / "epoch=1-step=6.ckpt")
    code, events, err = watch_once(run)
    assert code == 0, err
    assert [(e["path"], e["verdict"], e["step"]) for e in events] == [("last.ckpt", "good", 6)]
    time.sleep(0.01)
    _replace_with(last, later / "last.ckpt")
    got.clear()
    w.run_pass()
    assert [(e.path, e.verdict, e.step) for e in got] == [("last.ckpt", "good", 8)]
    assert verdicts(run)["last.ckpt"] == "good"
    # A verified regular-file last.ckpt is a resume point: the newest verified step.
    assert latest_verified(run, verify="full") == last
    r = run_cli("resume-path", run, "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["step"] == 8

    # Damage that leaves the mtime alone is still damage (bit rot): reported bad.
    st = last.stat()
    data = bytearray(last.read_bytes())
    data[len(data) // 2] ^= 0xFF
    last.write_bytes(bytes(data))
    os.utime(last, ns=(st.st_atime_ns, st.st_mtime_ns))
    got.clear()
    w.run_pass()
    assert [(e.path, e.verdict) for e in got] == [("last.ckpt", "bad")]
    assert latest_verified(run) == run / "epoch=0-step=4.ckpt"


def test_resume_skips_a_last_ckpt_written_again_but_not_verified(tmp_path: Path) -> None:
    from tests.conftest import third_party_quiet
    from tests.helpers.makers import lightning_run

    with third_party_quiet():
        run = lightning_run(tmp_path / "run", steps=4)
        later = lightning_run(tmp_path / "later", steps=4, every=1)  # step-3 file: same size
    assert watch_once(run)[0] == 0
    last = run / "last.ckpt"
    assert latest_verified(run) == last
    newer = later / "epoch=0-step=3.ckpt"
    assert newer.stat().st_size == last.stat().st_size  # a size check would pass it
    time.sleep(0.01)  # a newer mtime than the verdict (not a timing assertion)
    _replace_with(last, newer)
    choice = choose(run)
    assert choice is not None and choice.path == run / "epoch=0-step=4.ckpt"
    assert choice.rejected == (("last.ckpt", "written again after it was verified (a newer "
                                             "save not verified yet)"),)
    # Once watch verified it (at the step it now holds, 3), nothing is passed over: the
    # step-4 file is newer than what last.ckpt holds now.
    code, events, _ = watch_once(run)
    assert code == 0 and [(e["path"], e["verdict"], e["step"]) for e in events] == [
        ("last.ckpt", "good", 3)]
    choice = choose(run)
    assert choice is not None and choice.rejected == ()
    assert choice.path == run / "epoch=0-step=4.ckpt"


def test_file_events_wake_the_watcher_long_before_its_interval(tmp_path: Path) -> None:
    pytest.importorskip("watchfiles")
    run = tmp_path / "run"
    run.mkdir()
    # --interval 1h: polling alone would not look again for an hour. A save's file events
    # wake it; the pass that finds the checkpoint settling (--settle 1s) wakes it again once
    # it is due, with no further event.
    proc, out, lines = watcher(run, "--interval", "1h", "--wake", "events", stderr=subprocess.PIPE)
    try:
        time.sleep(1)  # its first pass (an empty run) is done and it waits
        assert train(run, 2) == 0
        seen: dict[str, str] = {}
        # The 120 s hang guard is an hour short of --interval.
        for ev in watch_events(lines, lambda: len(seen) >= 2):
            seen[ev["path"]] = ev["verdict"]
    finally:
        proc.terminate()
        _, err = proc.communicate()
        out.close()
    assert seen == {"step_2": "good", "step_4": "good"}, err
    # Its own writes (ledger, manifests) do not wake it into passes that find nothing: the
    # ledger holds one line per checkpoint.
    book = ledger.read_ledger(run)
    assert book is not None and [e.path for e in book.entries] == ["step_2", "step_4"]


def test_wake_falls_back_to_polling_without_watchfiles(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from ckpt_cli.errors import UsageError
    from ckpt_cli.ops.watch.wake import PollWaker, make_waker

    run = tmp_path / "run"
    assert train(run, 1) == 0
    monkeypatch.setitem(sys.modules, "watchfiles", None)  # as if not installed
    waker, note = make_waker("auto", run)
    assert isinstance(waker, PollWaker) and note is None
    with pytest.raises(UsageError, match="watchfiles"):
        make_waker("events", run)
    r = run_cli("watch", run, "--wake", "events", "--interval", "1s")
    assert r.exit_code == 2 and "needs the optional watchfiles package" in r.stderr
    assert "pip install 'ckpt-cli[watch]'" in r.stderr
    r = run_cli("watch", run, "--once", "--wake", "sometimes")
    assert r.exit_code == 2 and "--wake must be one of auto, events, poll" in r.stderr
    # auto without watchfiles polls, and the watcher works as before.
    got: list[WatchEvent] = []
    w = Watcher(run, WatchOptions(settle=0), got.append)
    for _ in w.loop(0.01, passes=2, waker=waker):
        pass
    assert [(e.path, e.verdict) for e in got] == [("step_2", "good")]


def test_the_watchers_own_writes_are_not_events() -> None:
    from ckpt_cli.ops.watch.wake import _not_own_write

    assert not _not_own_write(None, "/r/ckpt-ledger.jsonl")
    assert not _not_own_write(None, "/r/step_2/ckpt-manifest.json")
    assert not _not_own_write(None, "/r/last.ckpt.ckpt-manifest.json")
    assert not _not_own_write(None, "/r/.last.ckpt.ckpt-tmp-abc")
    assert _not_own_write(None, "/r/step_2/.metadata")
    assert _not_own_write(None, "/r/last.ckpt")
