"""The run ledger: durable appends, torn lines, hostile files, many writers, object storage."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from ckpt_cli import storage
from ckpt_cli.errors import CkptError
from ckpt_cli.trust import ledger
from ckpt_cli.trust.ledger import LedgerEntry
from tests.helpers import s3


def _entry(path: str, step: int | None = None, verdict: str = ledger.GOOD,
           event: str = ledger.VERIFIED, **kw: object) -> LedgerEntry:
    return LedgerEntry(path=path, step=step, time=1_700_000_000.5, event=event,
                       verdict=verdict, bytes=1234, **kw)  # type: ignore[arg-type]


def test_missing_ledger_is_none(tmp_path: Path) -> None:
    assert ledger.read_ledger(tmp_path) is None


def test_append_then_read_round_trips_every_field(tmp_path: Path) -> None:
    a = _entry("checkpoint-100", 100, manifest_digest="ab" * 32)
    b = _entry("checkpoint-200", 200, verdict=ledger.BAD, problems=("shard truncated",))
    c = _entry("checkpoint-100", 100, event=ledger.THINNED,
               detail={"dropped": ["optimizer"], "bytes_before": 99})
    ledger.append(tmp_path, a)
    ledger.append(tmp_path, [b, c])
    got = ledger.read_ledger(tmp_path)
    assert got is not None
    assert got.entries == (a, b, c)
    assert got.skipped == 0
    latest = got.latest()
    assert latest["checkpoint-100"] == c  # the newest line about a checkpoint holds
    assert not latest["checkpoint-200"].good
    assert got.verdict_of("checkpoint-300") is None
    # every line is one sorted-keys JSON object carrying the schema version
    lines = (tmp_path / ledger.LEDGER_NAME).read_bytes().splitlines()
    assert len(lines) == 3
    assert all(orjson.loads(x)["schema_version"] == 1 for x in lines)


def test_a_torn_last_line_is_skipped_and_the_next_append_starts_a_new_line(
        tmp_path: Path) -> None:
    ledger.append(tmp_path, _entry("checkpoint-1", 1))
    with open(tmp_path / ledger.LEDGER_NAME, "ab") as f:
        f.write(b'{"path": "checkpoint-2", "ste')  # a crash mid-write
    got = ledger.read_ledger(tmp_path)
    assert got is not None and got.skipped == 1 and len(got.entries) == 1
    ledger.append(tmp_path, _entry("checkpoint-3", 3))
    got = ledger.read_ledger(tmp_path)
    assert got is not None
    assert [e.path for e in got.entries] == ["checkpoint-1", "checkpoint-3"]
    assert got.skipped == 1


@pytest.mark.parametrize("line", [
    b"[1, 2]",
    b'{"path": "x", "step": "10", "time": 1, "event": "verified", "verdict": "good", "bytes": 1}',
    b'{"path": "x", "step": true, "time": 1, "event": "verified", "verdict": "good", "bytes": 1}',
    b'{"path": "/etc", "step": 1, "time": 1, "event": "verified", "verdict": "good", "bytes": 1}',
    b'{"path": "../x", "step": 1, "time": 1, "event": "verified", "verdict": "good", "bytes": 1}',
    b'{"path": "x", "step": 1, "time": 1, "event": "verified", "verdict": "fine", "bytes": 1}',
    b'{"path": "x", "step": 1, "time": 1, "event": "deleted", "verdict": "good", "bytes": 1}',
])
def test_lines_that_are_not_ledger_entries_are_never_trusted(tmp_path: Path,
                                                             line: bytes) -> None:
    (tmp_path / ledger.LEDGER_NAME).write_bytes(line + b"\n")
    got = ledger.read_ledger(tmp_path)
    assert got is not None and got.entries == () and got.skipped + len(got.ignored) == 1


def test_entries_refuse_bad_values() -> None:
    with pytest.raises(ValueError, match="verdict"):
        _entry("x", verdict="maybe")
    with pytest.raises(ValueError, match="path"):
        _entry("")
    for name in ("../outside", ".", "sub/checkpoint-1", "/etc"):  # never written
        with pytest.raises(ValueError, match="directly in the run"):
            ledger.append(Path("/nonexistent-run"), _entry(name))


def test_a_symlinked_ledger_is_neither_read_nor_written(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.jsonl"
    target.write_bytes(b"")
    run = tmp_path / "run"
    run.mkdir()
    (run / ledger.LEDGER_NAME).symlink_to(target)
    with pytest.raises(CkptError, match="ledger"):
        ledger.append(run, _entry("checkpoint-1", 1))
    with pytest.raises(CkptError, match="ledger"):
        ledger.read_ledger(run)
    assert target.read_bytes() == b""


def test_a_directory_in_the_ledgers_place_is_an_error(tmp_path: Path) -> None:
    (tmp_path / ledger.LEDGER_NAME).mkdir()
    with pytest.raises(CkptError, match="ledger"):
        ledger.read_ledger(tmp_path)
    with pytest.raises(CkptError, match="ledger"):
        ledger.append(tmp_path, _entry("checkpoint-1", 1))


def _writer(run: str, who: int, n: int) -> None:
    for i in range(n):
        ledger.append(run, _entry(f"checkpoint-{who}-{i}", i, detail={"pad": "x" * 3000}))


def test_many_processes_appending_never_interleave(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), w, 40)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    got = ledger.read_ledger(tmp_path)
    assert got is not None
    assert got.skipped == 0
    assert len(got.entries) == 160
    assert len(got.latest()) == 160


@pytest.fixture
def s3run(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    with s3.moto_endpoint() as (moto, proxy), s3.client_env(proxy, monkeypatch):
        bucket = s3.new_bucket(moto)
        yield f"s3://{bucket}/run"


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_the_ledger_on_object_storage(s3run: str) -> None:
    assert ledger.read_ledger(s3run) is None
    a, b = _entry("checkpoint-1", 1), _entry("checkpoint-2", 2, verdict=ledger.BAD)
    ledger.append(s3run, a)
    ledger.append(s3run, b)
    storage.configure({})  # a fresh process's view: nothing cached
    got = ledger.read_ledger(s3run)
    assert got is not None and got.entries == (a, b)
    assert str(ledger.ledger_path(s3run)).startswith("s3://")
