"""``ckpt validate --part K/N|auto`` and ``--finalize``: a validation split by file over processes.

The merged report (checks, findings, counts) and the manifest must be those of a single
``ckpt validate`` run, whether the parts run one after another (a SLURM array), at once
(torchrun), in any order, or are rerun.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from ckpt_cli.cli.app import app
from ckpt_cli.ops.validate.split import owner_map, plan_files
from ckpt_cli.parts import staging_dir
from tests.conftest import third_party_quiet
from tests.helpers import damage

pytestmark = pytest.mark.requires_torch

ROOT = Path(__file__).resolve().parents[3]
TORCHRUN = Path(sys.executable).with_name("torchrun")
_TIMING = {"seconds", "bytes_per_second", "threads"}


def ckpt(*args: str | Path, env: dict[str, str] | None = None) -> Result:
    """``ckpt ARGS`` in-process, with extra environment (a launcher's variables)."""
    base = {"NO_COLOR": "1", "COLUMNS": "100", "TERM": "dumb", "RANK": None,
            "WORLD_SIZE": None, "SLURM_ARRAY_TASK_ID": None, "SLURM_ARRAY_TASK_COUNT": None,
            "SLURM_ARRAY_TASK_MIN": None, "SLURM_PROCID": None, "SLURM_NTASKS": None}
    return CliRunner().invoke(app, [str(a) for a in args],
                              env={**base, **(env or {})})  # type: ignore[dict-item]


def slurm(task: int, count: int) -> dict[str, str]:
    return {"SLURM_ARRAY_TASK_ID": str(task), "SLURM_ARRAY_TASK_COUNT": str(count)}


def comparable(doc: dict[str, Any]) -> dict[str, Any]:
    """A validate document without timings, rates and the ``part`` object."""
    def strip(o: Any) -> Any:
        if isinstance(o, dict):
            return {k: strip(v) for k, v in o.items() if k not in _TIMING}
        if isinstance(o, list):
            return [strip(x) for x in o]
        if isinstance(o, str) and " GB/s" in o:
            return o.split(", ")[0]
        return o
    return strip({k: v for k, v in doc.items() if k != "part"})  # type: ignore[no-any-return]


def manifest_entries(d: Path) -> list[dict[str, Any]]:
    return json.loads((d / "ckpt-manifest.json").read_text())["files"]  # type: ignore[no-any-return]


def single_run(d: Path, *args: str) -> tuple[int, dict[str, Any], list[dict[str, Any]] | None]:
    """A plain validation, its document and manifest entries (the manifest is removed)."""
    r = ckpt("validate", d, "--json", *args)
    entries = None
    if (d / "ckpt-manifest.json").exists():
        entries = manifest_entries(d)
        (d / "ckpt-manifest.json").unlink()
    return r.exit_code, json.loads(r.stdout), entries


@pytest.fixture(scope="module")
def dcp7(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DCP checkpoint of 7 files of different sizes (one file per item)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    out = tmp_path_factory.mktemp("dcp7") / "step_000007"
    g = torch.Generator().manual_seed(7)
    sd = {f"layers.{i}.weight": torch.randn(16 * (i + 1), 32, generator=g) for i in range(7)}
    with third_party_quiet():
        dcp.save(sd, storage_writer=FileSystemWriter(str(out), single_file_per_rank=False),
                 no_dist=True)
    return out


@pytest.fixture(scope="module")
def torch_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory of three torch zips (model, optimizer, scheduler), one with a NaN."""
    import torch

    out = tmp_path_factory.mktemp("tdir") / "checkpoint-5"
    out.mkdir()
    g = torch.Generator().manual_seed(0)
    model = {f"w{i}": torch.randn(64, 64, generator=g) for i in range(4)}
    model["w2"][3, 3] = float("nan")
    torch.save(model, out / "pytorch_model.bin")
    torch.save({"state": {0: {"exp_avg": torch.zeros(64, 64)}},
                "param_groups": [{"lr": 0.1, "params": [0]}]}, out / "optimizer.pt")
    torch.save({"step": 5}, out / "scheduler.pt")
    return out


@pytest.fixture
def dcp4(sample_copy: Path) -> Path:
    """The sample's 4-rank DCP checkpoint, written by torch.distributed (a private copy)."""
    return sample_copy / "step_000400"


def _copy(src: Path, tmp_path: Path) -> Path:
    dest = tmp_path / src.name
    shutil.copytree(src, dest)
    return dest


def run_parts(d: Path, count: int, *args: str, order: list[int] | None = None,
              ) -> list[Result]:
    """Parts run one after another, as a SLURM array does (task ids from 0)."""
    return [ckpt("validate", d, "--json", "--part", "auto", *args, env=slurm(k - 1, count))
            for k in (order or list(range(1, count + 1)))]


@pytest.mark.parametrize("count", [2, 3])
@pytest.mark.parametrize(("name", "args"), [
    ("dcp4", ("--write-manifest",)),
    ("dcp7", ("--write-manifest", "--values")),
    ("torch_dir", ("--write-manifest", "--values", "--require", "optimizer,step")),
])
def test_slurm_array_gives_the_single_run_report(request: pytest.FixtureRequest,
                                                 tmp_path: Path, count: int, name: str,
                                                 args: tuple[str, ...]) -> None:
    d = _copy(request.getfixturevalue(name), tmp_path)
    code, single, entries = single_run(d, *args)
    runs = []
    for k in range(1, count + 1):
        runs += run_parts(d, count, *args, order=[k])
        if k < count:
            part = json.loads(runs[-1].stdout)["part"]
            assert not part["finalized"] and part["waiting_for"] == list(range(k + 1,
                                                                              count + 1))
            assert not (d / "ckpt-manifest.json").exists()  # only the finalizer writes it
    last = runs[-1]
    doc = json.loads(last.stdout)
    assert doc["part"]["finalized"] and doc["part"]["waiting_for"] == []
    assert last.exit_code == code
    assert comparable(doc) == comparable(single)
    if entries is not None:
        assert manifest_entries(d) == entries
    else:
        assert not (d / "ckpt-manifest.json").exists()
    assert not staging_dir(d).exists()
    # Every file was checked in depth by exactly one part.
    files = [json.loads(r.stdout)["part"]["files"] for r in runs]
    assert sum(files) == len(plan_files(d))


def test_parts_in_any_order_and_rerun(dcp7: Path, tmp_path: Path) -> None:
    d = _copy(dcp7, tmp_path)
    _, single, entries = single_run(d, "--write-manifest")
    first = run_parts(d, 3, "--write-manifest", order=[3])[0]
    again = run_parts(d, 3, "--write-manifest", order=[3])[0]  # idempotent: same receipt
    assert first.exit_code == again.exit_code == 0
    assert json.loads(again.stdout)["part"]["waiting_for"] == [1, 2]
    receipts = sorted(p.name for p in (staging_dir(d) / "receipts").iterdir())
    assert receipts == ["part-00003-of-00003.json"]
    run_parts(d, 3, "--write-manifest", order=[1])
    last = run_parts(d, 3, "--write-manifest", order=[2])[0]
    assert json.loads(last.stdout)["part"]["finalized"]
    assert comparable(json.loads(last.stdout)) == comparable(single)
    assert manifest_entries(d) == entries


def test_finalize_with_a_part_missing_names_it(dcp7: Path, tmp_path: Path) -> None:
    d = _copy(dcp7, tmp_path)
    run_parts(d, 3, "--write-manifest", order=[1, 3])
    r = ckpt("validate", d, "--write-manifest", "--finalize")
    assert r.exit_code == 2
    assert "part 2 of 3 not done" in r.stderr and "--finalize" in r.stderr, r.stderr
    assert not (d / "ckpt-manifest.json").exists()
    assert staging_dir(d).exists()  # the receipts stay for the missing part
    r = ckpt("validate", d, "--write-manifest", "--finalize", "--json")
    assert r.exit_code == 2 and json.loads(r.stdout)["error"]["kind"] == "parts-incomplete"
    # --part with --finalize: this part's receipt is written, then the finalize fails.
    r = ckpt("validate", d, "--write-manifest", "--part", "1/3", "--finalize")
    assert r.exit_code == 2 and "part 2 of 3" in r.stderr
    # The missing part, then --finalize alone merges (the part itself finalizes first).
    r = ckpt("validate", d, "--write-manifest", "--part", "2/3")
    assert r.exit_code == 0 and "every part is done" in r.stdout, r.stdout
    assert (d / "ckpt-manifest.json").exists()
    r = ckpt("validate", d, "--write-manifest", "--finalize")
    assert r.exit_code == 2 and "nothing to finalize" in r.stderr


def test_parts_dir(dcp7: Path, tmp_path: Path) -> None:
    d = _copy(dcp7, tmp_path)
    _, _, entries = single_run(d, "--write-manifest")
    parts = tmp_path / "receipts"
    for k in (1, 2):
        r = ckpt("validate", d, "--json", "--write-manifest", "--part", f"{k}/2",
                 "--parts-dir", parts)
        assert r.exit_code == 0, r.output
        assert not staging_dir(d).exists()  # nothing beside the checkpoint
    assert manifest_entries(d) == entries
    assert list(parts.iterdir()) == []  # the receipts went with the finalize


def test_finalize_alone_merges(dcp7: Path, tmp_path: Path) -> None:
    d = _copy(dcp7, tmp_path)
    _, single, entries = single_run(d, "--write-manifest", "--values")
    args = ("--write-manifest", "--values")
    run_parts(d, 2, *args, order=[1])
    # Part 2 left its receipt but did not finalize (say it was killed right after): make
    # that receipt elsewhere, where part 1's is not, and bring it over.
    other = tmp_path / "other"
    r = ckpt("validate", d, *args, "--part", "2/2", "--parts-dir", other)
    assert "waiting for part 1" in r.stdout, r.stdout
    receipt = other / staging_dir(d).name / "receipts" / "part-00002-of-00002.json"
    shutil.copy(receipt, staging_dir(d) / "receipts")
    assert not (d / "ckpt-manifest.json").exists()
    r = ckpt("validate", d, "--json", *args, "--finalize")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["part"]["index"] is None and doc["part"]["finalized"]
    assert comparable(doc) == comparable(single)
    assert manifest_entries(d) == entries
    assert not staging_dir(d).exists()
    r = ckpt("validate", d, "--finalize", *args)
    assert r.exit_code == 2 and "nothing to finalize" in r.stderr


def test_another_plan_is_refused(dcp7: Path, tmp_path: Path) -> None:
    d = _copy(dcp7, tmp_path)
    run_parts(d, 2, "--write-manifest", order=[1])
    # Other options make another plan: the part refuses to mix its receipt in.
    r = ckpt("validate", d, "--values", "--write-manifest", "--part", "2/2")
    assert r.exit_code == 2 and "different plan" in r.stderr, r.stderr
    r = ckpt("validate", d, "--part", "2/3", "--write-manifest")
    assert r.exit_code == 2 and "different plan" in r.stderr
    r = ckpt("validate", d, "--finalize", "--write-manifest", "--manifest-hash", "sha256")
    assert r.exit_code == 2 and "different plan" in r.stderr
    # A file changed size since part 1 planned: another plan too.
    with open(d / "__0_0.distcp", "ab") as f:
        f.write(b"\0")
    r = ckpt("validate", d, "--write-manifest", "--part", "2/2")
    assert r.exit_code == 2 and "different plan" in r.stderr
    assert not (d / "ckpt-manifest.json").exists()


def test_a_file_rewritten_in_place_between_parts_is_another_plan(dcp7: Path,
                                                                 tmp_path: Path) -> None:
    import os

    d = _copy(dcp7, tmp_path)
    run_parts(d, 2, "--write-manifest", order=[1])
    os.utime(d / "__0_0.distcp", ns=(1, 1))  # same size, rewritten: a new mtime
    r = ckpt("validate", d, "--write-manifest", "--part", "2/2")
    assert r.exit_code == 2 and "different plan" in r.stderr
    assert not (d / "ckpt-manifest.json").exists()


def test_a_corrupt_chunk_fails_its_part_and_the_merged_report(dcp4: Path) -> None:
    file = damage.flip_in_dcp_chunk(dcp4, "model.wte.weight", 1)
    code, single, _ = single_run(dcp4, "--write-manifest")
    assert code == 1 and any(f["code"] == "crc-mismatch" for f in single["checkpoints"][0]
                             ["findings"])
    bad = owner_map(plan_files(dcp4), 2)[file]
    good = 3 - bad
    r = ckpt("validate", dcp4, "--json", "--write-manifest", "--part", f"{good}/2")
    assert r.exit_code == 0, r.stdout  # its own files are fine
    r = ckpt("validate", dcp4, "--json", "--write-manifest", "--part", f"{bad}/2")
    assert r.exit_code == 1
    doc = json.loads(r.stdout)
    assert doc["part"]["finalized"] and not doc["valid"]
    assert comparable(doc) == comparable(single)
    assert not (dcp4 / "ckpt-manifest.json").exists()


def test_a_part_reports_its_own_damage_before_the_merge(dcp7: Path, tmp_path: Path) -> None:
    d = _copy(dcp7, tmp_path)
    owners = owner_map(plan_files(d), 2)
    victim = next(rel for rel, k in owners.items() if k == 1 and rel.endswith(".distcp"))
    data = bytearray((d / victim).read_bytes())
    data[len(data) // 2] ^= 1
    (d / victim).write_bytes(bytes(data))
    r = ckpt("validate", d, "--part", "1/2")
    assert r.exit_code == 1 and "CRC-32 mismatch" in r.stdout and "waiting for part 2" in \
        r.stdout, r.stdout
    r = ckpt("validate", d, "--part", "2/2")
    assert r.exit_code == 1 and "every part is done" in r.stdout


def test_part_on_a_run_directory_is_a_usage_error(sample_copy: Path) -> None:
    r = ckpt("validate", sample_copy, "--part", "1/2")
    assert r.exit_code == 2 and "run directory" in r.stderr and "--latest" in r.stderr
    r = ckpt("validate", sample_copy, "--finalize")
    assert r.exit_code == 2 and "run directory" in r.stderr
    r = ckpt("validate", sample_copy / "step_000400", "--parts-dir", "x")
    assert r.exit_code == 2 and "--parts-dir" in r.stderr
    r = ckpt("validate", sample_copy / "step_000400", "--part", "3/2")
    assert r.exit_code == 2 and "--part" in r.stderr
    r = ckpt("validate", sample_copy / "step_000400", "--part", "auto")
    assert r.exit_code == 2 and "no launcher" in r.stderr


def test_latest_of_a_run_directory(sample_copy: Path) -> None:
    r = ckpt("validate", sample_copy, "--latest", "--json", "--part", "1/1")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["kind"] == "run" and doc["part"]["finalized"]
    assert [c["name"] for c in doc["checkpoints"]] == ["step_000400"]


def test_json_part_object_and_human_line(dcp7: Path, tmp_path: Path) -> None:
    d = _copy(dcp7, tmp_path)
    r = ckpt("validate", d, "--json", "--part", "1/2")
    part = json.loads(r.stdout)["part"]
    total = len(plan_files(d))
    assert part == {"index": 1, "count": 2, "origin": "--part 1/2", "files": part["files"],
                    "bytes": part["bytes"], "total_files": total, "plan": part["plan"],
                    "staging": str(staging_dir(d)), "finalized": False,
                    "finalized_elsewhere": False, "waiting_for": [2]}
    assert 0 < part["files"] < total and len(part["plan"]) == 24
    r = ckpt("validate", d, "--part", "2/2")
    lines = r.stdout.strip().splitlines()
    assert lines[-1].startswith(f"part 2/2: {total - part['files']} of {total} file(s)")
    assert lines[-1].endswith(f"every part is done: the report covers all {total} file(s)")
    assert "part" not in json.loads(ckpt("validate", d, "--json").stdout)


def test_waiting_parts_are_no_leftover_of_their_own(dcp7: Path, tmp_path: Path) -> None:
    d = _copy(dcp7, tmp_path)
    r = ckpt("validate", d, "--json", "--part", "1/2")
    checks = {c["id"]: c for c in json.loads(r.stdout)["checkpoints"][0]["checks"]}
    assert checks["leftovers"]["status"] == "pass"
    # A plain validation meanwhile sees a save in progress beside the checkpoint.
    checks = {c["id"]: c for c in
              json.loads(ckpt("validate", d, "--json").stdout)["checkpoints"][0]["checks"]}
    assert checks["leftovers"]["status"] == "warn"


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed")
@pytest.mark.parametrize("nproc", [2, 3])
def test_torchrun(dcp7: Path, tmp_path: Path, nproc: int) -> None:
    d = _copy(dcp7, tmp_path)
    _, _, entries = single_run(d, "--write-manifest")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "SLURM_", "LOCAL_RANK"))}
    env.update(PYTHONPATH=str(ROOT), NO_COLOR="1", OMP_NUM_THREADS="1")
    p = subprocess.run([str(TORCHRUN), "--standalone", "--nproc-per-node", str(nproc),
                        "--log-dir", str(tmp_path / "logs"), "--tee", "1",
                        "-m", "ckpt_cli", "validate", str(d), "--part", "auto",
                        "--write-manifest"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("every part is done") + p.stdout.count("another part merged") >= 1
    assert manifest_entries(d) == entries
    assert not staging_dir(d).exists()
    r = ckpt("validate", d, "--json")  # the manifest written verifies
    assert r.exit_code == 0 and comparable(json.loads(r.stdout))["valid"]


@pytest.mark.parametrize("args", [(), ("--write-manifest",),
                                  ("--write-manifest", "--manifest-hash", "sha256")])
@pytest.mark.parametrize("damage", [False, True])
def test_an_existing_manifest_is_verified_by_parts(dcp7: Path, tmp_path: Path,
                                                   args: tuple[str, ...], damage: bool) -> None:
    d = _copy(dcp7, tmp_path)
    assert ckpt("validate", d, "--write-manifest").exit_code == 0
    (d / "notes.txt").write_text("added after the manifest\n")  # an extra file: a warning
    if damage:
        data = bytearray((d / "__0_3.distcp").read_bytes())
        data[len(data) // 2] ^= 1
        (d / "__0_3.distcp").write_bytes(bytes(data))
    before = (d / "ckpt-manifest.json").read_bytes()
    r = ckpt("validate", d, "--json", *args)
    single, after = json.loads(r.stdout), (d / "ckpt-manifest.json").read_bytes()
    (d / "ckpt-manifest.json").write_bytes(before)
    runs = run_parts(d, 2, *args)
    doc = json.loads(runs[-1].stdout)
    assert doc["part"]["finalized"] and runs[-1].exit_code == r.exit_code
    assert comparable(doc) == comparable(single)
    if after == before:
        assert (d / "ckpt-manifest.json").read_bytes() == before
    else:
        got = json.loads((d / "ckpt-manifest.json").read_bytes())
        want = json.loads(after)
        assert (got["files"], got["algorithm"]) == (want["files"], want["algorithm"])


def test_a_part_that_could_not_read_its_files_fails_the_merge(dcp7: Path,
                                                              tmp_path: Path) -> None:
    d = _copy(dcp7, tmp_path)
    run_parts(d, 2, order=[1])
    receipt = staging_dir(d) / "receipts" / "part-00001-of-00002.json"
    doc = json.loads(receipt.read_text())
    doc["aborted"] = {"severity": "error", "code": "read-error", "message": "cannot read: EIO",
                      "file": "__0_1.distcp", "location": None}
    receipt.write_text(json.dumps(doc))
    r = ckpt("validate", d, "--json", "--part", "2/2")
    assert r.exit_code == 1
    merged = json.loads(r.stdout)
    assert merged["part"]["finalized"]
    errors = [f for f in merged["checkpoints"][0]["findings"] if f["severity"] == "error"]
    assert [(f["code"], f["check"], f["file"]) for f in errors] == [
        ("read-error", "readable", "__0_1.distcp")]
