"""``ckpt plan`` end to end: human output, the JSON schema, errors and start-up cost."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Golden, run_cli
from tests.ops.inspect.test_inspect_cli import _imports_torch

WORKED = ("--params", "175B", "--precision", "fp32", "--optimizer", "adam",
          "--bandwidth", "10GB/s", "--mtbf", "4h")


def _json(*args: str | Path) -> dict[str, Any]:
    r = run_cli("plan", *args, "--json")
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)  # type: ignore[no-any-return]


def test_worked_example_human() -> None:
    r = run_cli("plan", *WORKED, "--interval", "30m", "--keep", "3")
    assert r.exit_code == 0, r.stderr
    out = r.stdout
    assert "Plan for 175.0B parameters, fp32, Adam" in out
    assert "2.1 TB  (weights 700.0 GB + optimizer 1.4 TB)" in out
    assert "12 = 4 weights (fp32) + 8 optimizer (Adam m, v in fp32); inference 4" in out
    assert "Inference checkpoint  700.0 GB" in out
    assert "Write time            3m 30s" in out
    assert "6.3 TB, 3 files (8.4 TB while the next one is written)" in out
    # Young sqrt(2 x 210 x 14400) = 40m 59s; Daly 38m 41s; then the user's 30 minutes.
    assert re.search(r"Compute between saves +40m 59s +38m 41s +30m", out)
    assert re.search(r"Expected time lost +16\.1% +16\.1% +16\.6%", out)
    assert "◆ optimum (Daly) 38m 41s: 16.1% lost" in out
    assert "● --interval 30m: 16.6% lost" in out
    assert "\x1b[" not in out  # NO_COLOR
    assert r.stderr == ""


def test_plot_marks_the_optimum_left_of_a_longer_interval() -> None:
    r = run_cli("plan", *WORKED, "--interval", "3h")
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.splitlines()
    plot = lines[lines.index("Expected time lost vs interval (log scale)") + 1:]
    diamond = next(line for line in plot if "◆" in line)
    dot = next(line for line in plot if "●" in line)
    assert diamond.index("◆") < dot.index("●")
    # 3 hours loses more than the optimum, so its mark sits higher (an earlier line).
    assert plot.index(dot) < plot.index(diamond)
    assert any(re.match(r"\s*0% ┤", line) for line in plot)
    # A tenth to ten times the optimum (the 3 h interval is inside).
    assert re.search(r"3m 52s +38m 41s +6h 27m", "\n".join(plot))


def test_worked_example_json() -> None:
    doc = _json(*WORKED, "--interval", "30m", "--keep", "3")
    assert doc["schema_version"] == 1 and doc["command"] == "plan"
    assert doc["source"] == "params" and doc["path"] is None
    assert doc["parameters"] == 175_000_000_000
    assert doc["bytes_per_parameter"] == {"weights": 4, "master": 0, "optimizer": 8,
                                          "training": 12, "inference": 4}
    assert doc["sizes"] == {"training": 2_100_000_000_000, "inference": 700_000_000_000,
                            "weights": 700_000_000_000, "master": 0,
                            "optimizer": 1_400_000_000_000, "other": 0}
    assert doc["bandwidth"] == {"bytes_per_second": 10e9, "source": "given", "measured": None}
    assert doc["write_seconds"] == pytest.approx(210)
    assert doc["cost_seconds"] == pytest.approx(210)
    assert doc["mtbf"] == {"seconds": 14400, "source": "job", "gpus": None,
                           "gpu_mtbf_seconds": None}
    young, daly, current = (doc["intervals"][k] for k in ("young", "daly", "current"))
    assert young["seconds"] == pytest.approx(2459.27, abs=0.01)
    assert daly["seconds"] == pytest.approx(2321.26, abs=0.01)
    assert current["seconds"] == 1800
    assert daly["period_seconds"] == pytest.approx(2321.26 + 210, abs=0.01)
    assert set(daly["overhead"]) == {"total", "checkpointing", "failures"}
    assert daly["overhead"]["total"] == pytest.approx(0.1612, abs=1e-4)
    assert set(daly) == {"seconds", "blocking_seconds", "period_seconds", "overhead",
                         "checkpoints_per_day", "bytes_per_day", "files_per_day",
                         "inodes_per_day"}
    assert doc["retention"] == {"keep": 3, "steady_bytes": 6_300_000_000_000,
                                "peak_bytes": 8_400_000_000_000, "steady_files": 3,
                                "kept_whole": 3}
    assert len(doc["curve"]) == 49
    assert doc["async"] is False and doc["snapshot"] is None
    assert doc["notes"] == []


def test_json_without_failure_rate() -> None:
    doc = _json("--params", "7B")
    assert doc["precision"] == "mixed" and doc["optimizer"] == "adamw"
    assert doc["sizes"]["training"] == 98_000_000_000 and doc["sizes"]["master"] == 28e9
    assert doc["bandwidth"] is None and doc["write_seconds"] is None and doc["mtbf"] is None
    assert doc["intervals"] == {"young": None, "daly": None, "current": None}
    assert doc["curve"] == [] and len(doc["notes"]) == 2
    assert doc["retention"]["keep"] is None


def test_notes_go_to_stderr() -> None:
    r = run_cli("plan", "--params", "7B", "--interval", "1h", "--ranks", "8")
    assert r.exit_code == 0
    assert "Plan for 7.0B parameters" in r.stdout and "Files per day" in r.stdout
    assert "note: give --bandwidth" in r.stderr and "note:" not in r.stdout
    assert "Expected time lost" not in r.stdout
    quiet = run_cli("plan", "--params", "7B", "-q")
    assert quiet.exit_code == 0 and quiet.stderr == ""


def test_gpus_async_and_restart() -> None:
    doc = _json("--params", "70B", "--bandwidth", "20GB/s", "--gpus", "1K", "--gpu-mtbf", "5y",
                "--async", "--ranks", "128", "--snapshot-bandwidth", "5GB/s",
                "--restart", "10m")
    assert doc["mtbf"]["seconds"] == pytest.approx(5 * 365 * 86400 / 1000)
    assert doc["mtbf"]["source"] == "gpus" and doc["mtbf"]["gpus"] == 1000
    assert doc["async"] is True and doc["restart_seconds"] == 600
    assert doc["snapshot"]["seconds"] == pytest.approx(980e9 / (5e9 * 128))
    assert doc["cost_seconds"] == doc["snapshot"]["seconds"]
    assert doc["intervals"]["daly"]["seconds"] >= doc["write_seconds"]
    r = run_cli("plan", "--params", "70B", "--bandwidth", "20GB/s", "--gpus", "1K",
                "--gpu-mtbf", "5y", "--async", "--ranks", "128")
    assert "Snapshot (blocks)" in r.stdout and "Training blocked per save" in r.stdout
    assert "5y per GPU / 1,000 GPUs" in r.stdout


# A duration written out ("3 minutes and 30 seconds", "4 hours") or with a space before its
# unit ("0.57 s"), where the rest of plan's output says "38m 41s" (issue 46).
_OTHER_DURATION = re.compile(r"\b(second|minute|hour|year)s?\b|\d days?\b|\d s\b")


@pytest.mark.parametrize("args", [
    (*WORKED, "--interval", "30m", "--keep", "3", "--restart", "10m"),
    ("--params", "70B", "--bandwidth", "20GB/s", "--gpus", "1K", "--gpu-mtbf", "5y",
     "--async", "--ranks", "128", "--interval", "2h"),
    ("--params", "1M", "--measure", "{tmp}", "--measure-size", "1MB", "--mtbf", "90s"),
])
def test_one_duration_format_everywhere(args: tuple[str, ...], tmp_path: Path) -> None:
    r = run_cli("plan", *(a.replace("{tmp}", str(tmp_path)) for a in args))
    assert r.exit_code == 0, r.stderr
    durations = re.findall(r"\d+(?:\.\d+)?[smhdy](?: \d+[smhdy])?\b", r.stdout)
    assert len(durations) >= 5, r.stdout
    assert not _OTHER_DURATION.search(r.stdout), r.stdout


def test_from_a_run_directory(sample_run: Path) -> None:
    doc = _json("--from", sample_run, "--bandwidth", "1MB/s", "--mtbf", "1h")
    assert doc["source"] == "checkpoint" and doc["format"] == "dcp"
    assert doc["path"] == str(sample_run / "step_000400")
    assert doc["files_per_checkpoint"] == 5 and doc["inodes_per_checkpoint"] == 6
    assert doc["bytes_per_parameter"] is None and doc["sizes"]["master"] is None
    assert doc["write_seconds"] == pytest.approx(doc["sizes"]["training"] / 1e6)
    r = run_cli("plan", "--from", sample_run / "step_000400", "--bandwidth", "1MB/s")
    assert r.exit_code == 0 and "step_000400 (dcp," in r.stdout and "+ other" in r.stdout


def test_measure(tmp_path: Path) -> None:
    r = run_cli("plan", "--params", "1M", "--measure", tmp_path, "--measure-size", "2MiB",
                "--measure-streams", "2", "--mtbf", "1h", "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    measured = doc["bandwidth"]["measured"]
    assert doc["bandwidth"]["source"] == "measured"
    assert measured["bytes"] == 2 << 20 and measured["streams"] == 2
    assert doc["bandwidth"]["bytes_per_second"] == pytest.approx(
        measured["bytes"] / measured["seconds"])
    assert list(tmp_path.iterdir()) == []
    human = run_cli("plan", "--params", "1M", "--measure", tmp_path, "--measure-size", "1MB")
    assert human.exit_code == 0
    assert "(measured: 1.0 MB in 4 streams, " in human.stdout
    assert "plan: measuring: writing 1.0 MB" in human.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args,fragment", [
    ((), "give the model size with --params N or --from-path PATH"),
    (("--params", "0"), "--params must be positive, not '0'"),
    (("--params", "-5B"), "cannot parse --params '-5B'"),
    (("--params", "175Q"), "unknown suffix 'Q'"),
    (("--params", "7B", "--precision", "fp16"), "--precision must be fp32, bf16 or mixed"),
    (("--params", "7B", "--optimizer", "lion"), "--optimizer must be adam, adamw, sgd or"),
    (("--params", "7B", "--bandwidth", "0GB/s"), "--bandwidth must be positive, not '0GB/s'"),
    (("--params", "7B", "--bandwidth", "fast"), "cannot parse --bandwidth 'fast'"),
    (("--params", "7B", "--bandwidth", "100Gb/s"), "looks like bits per second"),
    (("--params", "7B", "--mtbf", "0s"), "--mtbf must be positive"),
    (("--params", "7B", "--mtbf", "-4h"), "--mtbf must be positive, not '-4h'"),
    (("--params", "7B", "--mtbf", "4 parsecs"), "unknown unit 'parsecs'"),
    (("--params", "7B", "--interval", "soon"), "cannot parse --interval 'soon'"),
    (("--params", "7B", "--mtbf", "4"), "--mtbf '4' needs a unit: 4d (days), 4h (hours)"),
    (("--params", "7B", "--gpus", "8", "--gpu-mtbf", "5"), "--gpu-mtbf '5' needs a unit"),
    (("--params", "7B", "--interval", "1800"), "--interval '1800' needs a unit"),
    (("--params", "7B", "--restart", "600"), "--restart '600' needs a unit"),
    (("--params", "7B", "--keep", "2.5"), "--keep must be a whole number"),
    (("--params", "7B", "--ranks", "0"), "--ranks must be positive"),
    (("--params", "7B", "--gpus", "8"), "--gpus and --gpu-mtbf go together"),
    (("--params", "7B", "--mtbf", "4h", "--gpus", "8", "--gpu-mtbf", "5y"), "not both"),
    (("--params", "7B", "--bandwidth", "10MB/s", "--mtbf", "1h"),
     "write time (2h 43m) is at least twice the MTBF (1h): Daly's formula does not apply"),
    (("--params", "7B", "--snapshot-bandwidth", "5GB/s"), "only matters with --async-save"),
    (("--params", "7B", "--measure-size", "1GB"), "need --measure-dir DIR"),
    (("--params", "7B", "--measure", "/nonexistent-dir"), "no such directory"),
    (("--from", "/nonexistent/ckpt"), "no such file or directory"),
    (("--from", "/nonexistent/ckpt", "--precision", "fp32"), "--precision and --optimizer"),
])
def test_bad_input_is_one_line_and_exit_2(args: tuple[str, ...], fragment: str) -> None:
    r = run_cli("plan", *args)
    assert r.exit_code == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("ckpt: error: ") and fragment in lines[0], lines[0]
    assert "Traceback" not in r.stderr and r.stdout == ""


def test_plan_with_params_does_not_import_torch() -> None:
    for argv in (["plan", *WORKED, "--interval", "30m"], ["plan", *WORKED, "--json"]):
        imported, tail = _imports_torch(*argv)
        assert not imported, (argv, tail)
        assert "EXIT=0" in tail, (argv, tail)


def _rounded(x: Any) -> Any:
    """Floats to 6 significant digits: the golden file pins the schema and the figures, not
    the last bits of libm."""
    if isinstance(x, float):
        return float(f"{x:.6g}")
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    return x


def test_golden_json(golden: Golden) -> None:
    """The JSON schema is a contract: the worked example gives the same document."""
    doc = _json(*WORKED, "--interval", "30m", "--keep", "3", "--restart", "5m")
    golden("plan_worked_example.json", doc, _rounded)


def test_a_closed_stderr_pipe_ends_quietly() -> None:
    """``ckpt plan 2>&1 | head``: head is gone by the time the notes reach stderr."""
    import os
    import subprocess
    import sys

    r, w = os.pipe()
    os.close(r)  # every write to stderr meets a closed pipe
    p = subprocess.run([sys.executable, "-m", "ckpt_cli", "plan", "--params", "7B"],
                       stdout=subprocess.PIPE, stderr=w, timeout=60)
    os.close(w)
    assert p.returncode == 0 and p.stdout.startswith(b"Plan for 7.0B")


def test_thinning_storage_per_day() -> None:
    # 175B hourly, mixed precision AdamW: 14 bytes per parameter, 2.45 TB a save, 58.8 TB a day.
    # Keep the newest 3 whole and thin the rest to BF16 weights (350 GB each): 14.7 TB a day.
    doc = _json("--params", "175B", "--interval", "1h", "--thin-after", "3", "--thin-to",
                "bf16")
    thin = doc["thinning"]
    assert thin["thinned_bytes"] == 350_000_000_000
    day = thin["per_day"]
    assert day["checkpoints_per_day"] == 24.0
    assert day["bytes_per_day_whole"] == 24 * 2_450_000_000_000
    assert day["bytes_per_day_thinned"] == 3 * 2_450_000_000_000 + 21 * 350_000_000_000
    r = run_cli("plan", "--params", "175B", "--interval", "1h", "--thin-after", "3")
    # Without --thin-to: BF16 weights and metadata stay, the master copy and AdamW state go.
    assert r.exit_code == 0 and "350.0 GB per thinned checkpoint" in r.stdout, r.stdout
    assert "14.7 TB per day against 58.8 TB" in r.stdout, r.stdout
    r = run_cli("plan", "--params", "7B", "--thin-to", "bf16")
    assert r.exit_code == 2 and "--thin-after" in r.stderr
