"""--part parsing, the launcher environments, the deterministic assignment and the receipts."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import orjson
import pytest

from ckpt_cli.errors import UsageError
from ckpt_cli.parts import (
    Part,
    PartsIncompleteError,
    PartStore,
    assign,
    describe_parts,
    fingerprint,
    parse_part,
    staging_dir,
)


def test_parse_explicit() -> None:
    assert parse_part(None) is None
    assert parse_part("2/4") == Part(2, 4, "--part 2/4")
    assert parse_part(" 1 / 1 ").label == "1/1"  # type: ignore[union-attr]


@pytest.mark.parametrize("spec", ["0/4", "5/4", "1/0", "2", "a/b", "-1/3", "1/2/3", ""])
def test_parse_rejects(spec: str) -> None:
    with pytest.raises(UsageError, match=r"^part ") as e:
        parse_part(spec)
    assert e.value.param == "part"  # the CLI words it --part


def test_auto_torchrun_first() -> None:
    env = {"RANK": "2", "WORLD_SIZE": "3", "SLURM_ARRAY_TASK_ID": "0",
           "SLURM_ARRAY_TASK_COUNT": "9"}
    p = parse_part("auto", env)
    assert (p.index, p.count) == (3, 3) and "torchrun" in p.origin  # type: ignore[union-attr]


def test_auto_slurm_array_offset_by_min() -> None:
    env = {"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_COUNT": "4",
           "SLURM_ARRAY_TASK_MIN": "1"}
    p = parse_part("AUTO", env)
    assert (p.index, p.count) == (4, 4)  # type: ignore[union-attr]
    p0 = parse_part("auto", {"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_COUNT": "2"})
    assert (p0.index, p0.count) == (1, 2)  # type: ignore[union-attr]


def test_auto_slurm_array_with_step_refused() -> None:
    env = {"SLURM_ARRAY_TASK_ID": "8", "SLURM_ARRAY_TASK_COUNT": "3",
           "SLURM_ARRAY_TASK_MIN": "0"}  # --array=0-8:4
    with pytest.raises(UsageError, match="contiguous"):
        parse_part("auto", env)


def test_auto_srun_and_nothing() -> None:
    p = parse_part("auto", {"SLURM_PROCID": "0", "SLURM_NTASKS": "2"})
    assert (p.index, p.count) == (1, 2)  # type: ignore[union-attr]
    with pytest.raises(UsageError, match="no launcher"):
        parse_part("auto", {"PATH": "/bin"})


def test_assign_balances_and_is_deterministic() -> None:
    weights = [100, 1, 1, 1, 50, 50, 3]
    owner = assign(weights, 2)
    assert owner == assign(list(weights), 2)
    loads = [sum(w for w, o in zip(weights, owner, strict=True) if o == p) for p in (1, 2)]
    assert loads == [103, 103]
    assert owner[0] == 1  # the largest item goes to part 1
    assert set(assign([5] * 6, 3)) == {1, 2, 3}
    assert assign([], 4) == []
    assert assign([7, 7], 5) == [1, 2]  # more parts than items: the rest get nothing


def test_fingerprint_ignores_key_order() -> None:
    assert fingerprint({"a": 1, "b": [1, 2]}) == fingerprint({"b": [1, 2], "a": 1})
    assert fingerprint({"a": 1}) != fingerprint({"a": 2})


def test_describe_parts() -> None:
    assert describe_parts([3]) == "part 3"
    assert describe_parts([2, 5, 7]) == "parts 2, 5 and 7"
    assert describe_parts(list(range(1, 10))) == "parts 1, 2, 3, 4 and 5 more"


def test_staging_dir_reads_as_in_progress(tmp_path: Path) -> None:
    from ckpt_cli.formats.names import in_progress_reason, is_leftover

    s = staging_dir(tmp_path / "out")
    assert s.parent == tmp_path and s.name.startswith(".out")
    assert is_leftover(s.name) and in_progress_reason(s.name)


def test_receipts_round_trip_and_missing(tmp_path: Path) -> None:
    store = PartStore(tmp_path / "stage", "abc", 3, what="the output")
    store.join()
    store.join()  # a second part joining the same plan
    store.write_receipt(2, {"files": [["a", 1]]})
    got = store.receipts()
    assert list(got) == [2] and got[2]["files"] == [["a", 1]]
    assert store.missing(got) == [1, 3]
    err = store.incomplete([1, 3])
    assert "parts 1 and 3 of 3 not done" in str(err) and err.exit_code == 2
    # nothing half-written is left beside the receipts
    assert sorted(p.name for p in store.receipts_dir.iterdir()) == ["part-00002-of-00003.json"]


def test_receipt_of_another_plan_is_not_counted(tmp_path: Path) -> None:
    store = PartStore(tmp_path / "stage", "abc", 2, what="x")
    store.join()
    path = store.write_receipt(1, {})
    doc = orjson.loads(path.read_bytes())
    doc["plan"] = "other"
    path.write_bytes(orjson.dumps(doc))
    assert store.receipts() == {}


@pytest.mark.parametrize(("plan", "count"), [("xyz", 2), ("abc", 3)])
def test_join_refuses_another_plan(tmp_path: Path, plan: str, count: int) -> None:
    PartStore(tmp_path / "stage", "abc", 2, what="x").join()
    with pytest.raises(PartsIncompleteError, match="different plan"):
        PartStore(tmp_path / "stage", plan, count, what="x").join()


def _count_under_lock(root: str, n: int) -> None:
    store = PartStore(Path(root), "p", 1, what="x")
    for _ in range(n):
        with store.lock():
            f = Path(root) / "counter"
            v = int(f.read_text()) if f.exists() else 0
            f.write_text(str(v + 1))


def test_lock_excludes_other_processes(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_count_under_lock, args=(str(tmp_path), 200)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert (tmp_path / "counter").read_text() == "600"
