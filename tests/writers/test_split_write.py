"""convert and consolidate split over parts (--part K/N|auto, --finalize): each part writes its
own shards and a receipt, the last one the index; the result is byte-identical to one process.

Sources are written by the real libraries (torch.save, and torch.distributed.checkpoint from a
2-process torchrun world); parts run as sequential CLI runs (a simulated SLURM array, its
environment variables set) and as real torchrun worlds of 2 and 3 processes.
"""

from __future__ import annotations

import filecmp
import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import torch

from ckpt_cli.parts import staging_dir
from tests.conftest import run_cli

pytestmark = pytest.mark.requires_torch

TORCHRUN = Path(sys.executable).with_name("torchrun")
HELPERS = Path(__file__).parents[1] / "helpers"


@pytest.fixture(scope="module")
def train_pt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A training checkpoint: 12 model tensors, AdamW state, step."""
    d = tmp_path_factory.mktemp("train")
    g = torch.Generator().manual_seed(3)
    model = {f"blocks.{i}.w": torch.randn(200, 160, generator=g) for i in range(12)}
    model["emb"] = torch.randn(500, 160, generator=g)
    opt = {"state": {i: {"exp_avg": torch.zeros(4), "exp_avg_sq": torch.zeros(4),
                         "step": torch.tensor(5.0)} for i in range(3)},
           "param_groups": [{"lr": 1e-3, "params": [0, 1, 2]}]}
    path = d / "train.pt"
    torch.save({"model": model, "optimizer": opt, "step": 5}, path)
    return path


@pytest.fixture(scope="module")
def dcp_2rank(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DCP checkpoint saved by a 2-process torchrun world (gloo)."""
    out = tmp_path_factory.mktemp("dcp") / "step_100"
    _torchrun(2, str(HELPERS / "dcp_world.py"), str(out))
    assert (out / ".metadata").is_file() and len(list(out.glob("*.distcp"))) == 2
    return out


def _torchrun(n: int, *argv: str, logs: Path | None = None) -> list[str]:
    """Run a torchrun world of ``n`` processes; each rank's stdout (with ``logs``)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", NO_COLOR="1", PYTHONPATH=str(Path(__file__).parents[2]))
    opts = [f"--log-dir={logs}", "--redirects=1"] if logs else []
    p = subprocess.run([str(TORCHRUN), "--standalone", f"--nproc-per-node={n}", *opts, *argv],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    if logs is None:
        return []
    outs = sorted(logs.rglob("stdout.log"), key=lambda f: int(f.parent.name))
    assert len(outs) == n
    return [f.read_text() for f in outs]


def _same_tree(a: Path, b: Path, *, manifest_entries: bool = False) -> None:
    names_a = sorted(p.name for p in a.iterdir())
    assert names_a == sorted(p.name for p in b.iterdir())
    for name in names_a:
        if name == "ckpt-manifest.json" and manifest_entries:
            # made at a different time: the entries (paths, sizes, digests) are what matters
            fa, fb = (orjson.loads((d / name).read_bytes())["files"] for d in (a, b))
            assert fa == fb
            continue
        assert filecmp.cmp(a / name, b / name, shallow=False), name


CONVERT = ("convert", "--to", "fp16", "--max-shard-size", "200KB")


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_convert_simulated_slurm_array_is_byte_identical(train_pt: Path, tmp_path: Path,
                                                         fmt: str,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    single, split = tmp_path / "single", tmp_path / "split"
    r = run_cli(*CONVERT, train_pt, "-o", single, "--format", fmt, "-q")
    assert r.exit_code == 0, r.output
    assert len(list(single.iterdir())) > 3  # sharded: several shards and the index
    for task in (3, 1, 2):  # an array runs its tasks in any order: --array=1-3
        monkeypatch.setenv("SLURM_ARRAY_TASK_ID", str(task))
        monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "3")
        monkeypatch.setenv("SLURM_ARRAY_TASK_MIN", "1")
        r = run_cli(*CONVERT, train_pt, "-o", split, "--format", fmt, "--part", "auto",
                    "--json")
        assert r.exit_code == 0, r.output
        doc = orjson.loads(r.stdout)
        assert doc["part"]["index"] == task and doc["part"]["count"] == 3
        assert doc["part"]["finalized_here"] == (task == 2)
        assert split.exists() == (task == 2)  # nothing at the destination until finalized
    _same_tree(single, split)
    assert not staging_dir(split).exists()
    assert doc["index_file"] and len(doc["files"]) == len(list(single.iterdir()))


def test_two_single_runs_of_pt_are_identical(train_pt: Path, tmp_path: Path) -> None:
    """The torch zip's serialization id comes from the content, not from chance."""
    for out in ("a.pt", "b.pt"):
        assert run_cli("convert", train_pt, "-o", tmp_path / out, "-q").exit_code == 0
    assert filecmp.cmp(tmp_path / "a.pt", tmp_path / "b.pt", shallow=False)
    loaded = torch.load(tmp_path / "a.pt", weights_only=True)
    assert set(loaded) == {f"blocks.{i}.w" for i in range(12)} | {"emb"}


def test_single_file_output_in_parts(train_pt: Path, tmp_path: Path) -> None:
    one, split = tmp_path / "one.safetensors", tmp_path / "split.safetensors"
    assert run_cli("convert", train_pt, "-o", one, "-q").exit_code == 0
    r2 = run_cli("convert", train_pt, "-o", split, "--part", "2/2", "--json")
    assert r2.exit_code == 0 and orjson.loads(r2.stdout)["part"]["files"] == []
    assert not split.exists()
    r1 = run_cli("convert", train_pt, "-o", split, "--part", "1/2")
    assert r1.exit_code == 0, r1.output
    assert "finalized the output" in r1.stdout
    assert filecmp.cmp(one, split, shallow=False)
    assert not staging_dir(split).exists()


def test_finalize_names_missing_parts_and_leaves_no_output(train_pt: Path,
                                                            tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run_cli(*CONVERT, train_pt, "-o", out, "--part", "2/4", "-q").exit_code == 0
    r = run_cli(*CONVERT, train_pt, "-o", out, "--finalize")
    assert r.exit_code == 2
    assert "parts 1, 3 and 4 of 4 not done" in r.stderr and "Traceback" not in r.output
    assert not out.exists()
    # the last part asked to finalize with others missing is an error too
    r = run_cli(*CONVERT, train_pt, "-o", out, "--part", "3/4", "--finalize")
    assert r.exit_code == 2 and "parts 1 and 4 of 4" in r.stderr
    assert not out.exists()
    for k in (1, 4):
        assert run_cli(*CONVERT, train_pt, "-o", out, "--part", f"{k}/4", "-q").exit_code == 0
    assert (out / "model.safetensors.index.json").is_file()


def test_finalize_with_nothing_staged(train_pt: Path, tmp_path: Path) -> None:
    r = run_cli(*CONVERT, train_pt, "-o", tmp_path / "out", "--finalize")
    assert r.exit_code == 2 and "nothing to finalize" in r.stderr


def test_parts_of_another_plan_are_refused(train_pt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run_cli(*CONVERT, train_pt, "-o", out, "--part", "1/2", "-q").exit_code == 0
    other = ("convert", "--to", "bf16", "--max-shard-size", "200KB")
    r = run_cli(*other, train_pt, "-o", out, "--part", "2/2")
    assert r.exit_code == 2 and "different plan" in r.stderr
    r = run_cli(*CONVERT, train_pt, "-o", out, "--part", "2/3")
    assert r.exit_code == 2 and "different plan" in r.stderr
    assert not out.exists()


def test_source_changed_between_parts_is_refused(train_pt: Path, tmp_path: Path) -> None:
    src = tmp_path / "train.pt"
    src.write_bytes(train_pt.read_bytes())
    out = tmp_path / "out"
    assert run_cli(*CONVERT, src, "-o", out, "--part", "1/2", "-q").exit_code == 0
    os.utime(src, ns=(1, 1))  # rewritten in place (same size, new mtime)
    r = run_cli(*CONVERT, src, "-o", out, "--part", "2/2")
    assert r.exit_code == 2 and "different plan" in r.stderr


def test_failed_part_rerun_is_idempotent(train_pt: Path, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from ckpt_cli.writers import files as writers

    single, out = tmp_path / "single", tmp_path / "out"
    assert run_cli(*CONVERT, train_pt, "-o", single, "-q").exit_code == 0
    real = writers.write_shard
    calls: list[Path] = []

    def dies_on_second_shard(path: Path, *a: object, **k: object) -> None:
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt  # Ctrl-C in the middle of the part
        real(path, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(writers, "write_shard", dies_on_second_shard)
    r = run_cli(*CONVERT, train_pt, "-o", out, "--part", "1/2")
    assert r.exit_code != 0
    monkeypatch.setattr(writers, "write_shard", real)
    staged = staging_dir(out)
    # no half-written shard, no receipt, nothing at the destination
    assert not any(".ckpt-tmp-" in p.name for p in (staged / "out").iterdir())
    assert not list((staged / "receipts").iterdir()) and not out.exists()
    for spec in ("2/2", "1/2", "1/2"):  # the rerun, then once more after finalizing
        r = run_cli(*CONVERT, train_pt, "-o", out, "--part", spec, "-q")
    assert r.exit_code == 2 and "already exists" in r.stderr  # finished: not redone
    _same_tree(single, out)


def test_existing_output_needs_force_in_every_part(train_pt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run_cli(*CONVERT, train_pt, "-o", out, "-q").exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    r = run_cli(*CONVERT, train_pt, "-o", out, "--part", "1/2")
    assert r.exit_code == 2 and "already exists" in r.stderr
    assert not staging_dir(out).exists()
    for k in (1, 2):
        r = run_cli(*CONVERT, train_pt, "-o", out, "--part", f"{k}/2", "--force", "-q")
        assert r.exit_code == 0, r.output
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_overflow_in_one_part_blocks_the_output(tmp_path: Path) -> None:
    src = tmp_path / "big.pt"
    g = torch.Generator().manual_seed(0)
    sd = {f"w{i}": torch.randn(100, 100, generator=g) for i in range(6)}
    sd["w5"][0, 0] = 1e6  # beyond FP16
    torch.save(sd, src)
    out = tmp_path / "out"
    spec = ("convert", "--to", "fp16", "--max-shard-size", "25KB")
    codes = [run_cli(*spec, src, "-o", out, "--part", f"{k}/3").exit_code for k in (1, 2, 3)]
    assert sorted(codes) == [0, 0, 2]  # the part holding w5 refuses; the others wait
    assert not out.exists()
    r = run_cli(*spec, src, "-o", out, "--finalize")
    assert r.exit_code == 2 and "of 3 not done" in r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 3])
def test_consolidate_under_torchrun_is_byte_identical(dcp_2rank: Path, tmp_path: Path,
                                                      n: int) -> None:
    single, split = tmp_path / "single", tmp_path / "split"
    args = ("consolidate", "--max-shard-size", "60KB", "--verify")
    r = run_cli(*args, dcp_2rank, "-o", single, "-q")
    assert r.exit_code == 0, r.output
    shards = [p for p in single.iterdir() if p.suffix == ".safetensors"]
    assert len(shards) >= n  # every process has work
    outs = _torchrun(n, "-m", "ckpt_cli", *args, str(dcp_2rank), "-o", str(split),
                     "--part", "auto", "--json", logs=tmp_path / "logs")
    docs = [orjson.loads(out) for out in outs]
    assert [d["part"]["index"] for d in docs] == list(range(1, n + 1))  # rank r: part r+1
    final = [d for d in docs if d["part"]["finalized_here"]]
    assert len(final) == 1 and all(d["part"]["finalized"] or d["part"]["waiting_for"]
                                   for d in docs)
    assert final[0]["verified"] == 10  # every tensor, verified by the part that wrote it
    assert sum(len(d["part"]["files"]) for d in docs) == len(shards)
    _same_tree(single, split, manifest_entries=True)
    assert not staging_dir(split).exists()
    v = run_cli("validate", split)
    assert v.exit_code == 0, v.output


@pytest.mark.slow
def test_convert_under_torchrun_is_byte_identical(dcp_2rank: Path, tmp_path: Path) -> None:
    single, split = tmp_path / "single", tmp_path / "split"
    args = ("convert", "--to", "bf16", "--max-shard-size", "40KB")
    assert run_cli(*args, dcp_2rank, "-o", single, "-q").exit_code == 0
    _torchrun(2, "-m", "ckpt_cli", *args, str(dcp_2rank), "-o", str(split), "--part", "auto",
              "-q")
    _same_tree(single, split)


def test_shards_removed_from_staging_are_named_at_finalize(train_pt: Path, tmp_path: Path) -> None:
    import shutil

    out = tmp_path / "out"
    assert run_cli(*CONVERT, train_pt, "-o", out, "--part", "1/2", "-q").exit_code == 0
    shutil.rmtree(staging_dir(out) / "out")  # someone cleaned up the shards meanwhile
    r = run_cli(*CONVERT, train_pt, "-o", out, "--part", "2/2")
    assert r.exit_code == 2 and "part 1: model-00001-of-" in r.stderr  # names what is gone
    assert not out.exists()
    r = run_cli(*CONVERT, train_pt, "-o", out, "--part", "1/2", "-q")  # the rerun mends it
    assert r.exit_code == 0 and (out / "model.safetensors.index.json").is_file()
