"""``ckpt watch`` and ``resume-path`` on object storage, through a real moto S3 server."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckpt_cli import storage
from ckpt_cli.trust import ledger
from tests.conftest import run_cli
from tests.helpers import s3
from tests.trust.test_watch import train

pytestmark = [pytest.mark.requires_torch, pytest.mark.filterwarnings(
    "ignore::DeprecationWarning")]


@pytest.fixture
def s3run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, str]]:
    """A DCP run (3 saves) uploaded to s3://<bucket>/run; yields (moto URL, run URL)."""
    with s3.moto_endpoint() as (moto, proxy):
        for k, v in s3.env_for(proxy.url).items():
            monkeypatch.setenv(k, v)
        monkeypatch.delenv("AWS_PROFILE", raising=False)
        storage.configure({})
        assert train(tmp_path / "run", 3) == 0
        bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
        s3.client(moto).create_bucket(Bucket=bucket)
        s3.upload(moto, tmp_path / "run", bucket, "run")
        yield moto, f"s3://{bucket}/run"
        storage.configure({})


def test_watch_on_object_storage_verifies_records_and_resumes(s3run: tuple[str, str]) -> None:
    moto, url = s3run
    r = run_cli("watch", url, "--once", "--json", "--settle", "0s")
    assert r.exit_code == 0, r.stdout + r.stderr
    events = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(e["path"], e["verdict"]) for e in events] == [
        ("step_2", "good"), ("step_4", "good"), ("step_6", "good")]
    book = ledger.read_ledger(url)
    assert book is not None and len(book.entries) == 3
    # A second pass (a restarted watcher) validates nothing again.
    r = run_cli("watch", url, "--once", "--json", "--settle", "0s")
    assert r.exit_code == 0 and r.stdout == ""
    r = run_cli("resume-path", url)
    assert r.exit_code == 0 and r.stdout.strip().endswith("run/step_6")

    # Overwrite the newest shard with a shorter object: resume falls back, watch reports it.
    bucket = url.split("/")[2]
    s3.client(moto).put_object(Bucket=bucket, Key="run/step_6/__0_0.distcp", Body=b"short")
    r = run_cli("resume-path", url, "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["path"].endswith("run/step_4")
    r = run_cli("watch", url, "--once", "--json", "--settle", "0s")
    assert r.exit_code == 1
    assert [(json.loads(s)["path"], json.loads(s)["verdict"]) for s in r.stdout.splitlines()] == [
        ("step_6", "bad")]


def test_a_same_size_overwrite_is_told_by_its_etag(s3run: tuple[str, str]) -> None:
    """An object rewritten with other bytes of the same size. S3's LastModified has whole
    seconds, so a rewrite in the second of the verdict is no later than the verdict by its
    modification time; the verdict's stamp records each object's ETag (the change field),
    which tells whenever the rewrite happens. The newest checkpoint is passed over and
    reported bad."""
    moto, url = s3run
    r = run_cli("watch", url, "--once", "--json", "--settle", "0s")
    assert r.exit_code == 0, r.stdout + r.stderr
    line = ledger.read_ledger(url).latest()["step_6"]  # type: ignore[union-attr]
    assert line.files and all(len(v) == 4 and v[2] == 0 and v[3] for v in line.files.values())
    bucket = url.split("/")[2]
    key = "run/step_6/__0_0.distcp"
    cli = s3.client(moto)
    body = bytearray(cli.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[len(body) // 2] ^= 0xFF
    cli.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    head = cli.head_object(Bucket=bucket, Key=key)
    assert head["ContentLength"] == len(body)
    storage.configure({})  # a fresh process's listing
    r = run_cli("resume-path", url, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["path"].endswith("run/step_4")
    assert doc["rejected"][0]["path"] == "step_6"
    assert "content differs from the manifest" in doc["rejected"][0]["problem"]
    r = run_cli("watch", url, "--once", "--json", "--settle", "0s")
    assert r.exit_code == 1
    assert [(json.loads(s)["path"], json.loads(s)["verdict"]) for s in r.stdout.splitlines()] == [
        ("step_6", "bad")]
