"""Torch zips on object storage through a real S3 endpoint: records placed without a request per
local header.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ckpt_cli import storage
from ckpt_cli.storage import objects
from tests.conftest import run_cli
from tests.helpers import s3
from tests.storage.conftest import (
    _bucket,
    _doc,
    _fails,
    _get,
    _keys,
    _normal,
    _pending_uploads,
)

pytestmark = pytest.mark.filterwarnings(
    # botocore and moto call datetime.utcnow() and friends; not ckpt's code.
    "ignore::DeprecationWarning")


# -- torch zips on a store: records placed without a request per local header --------------


def _upload_one(endpoint: tuple[str, s3.Proxy], path: Path, key: str) -> str:
    bucket = _bucket(endpoint)
    s3.upload(endpoint[0], path, bucket, key)
    return f"s3://{bucket}/{key}"


def test_a_zip_not_written_by_torch_is_read_right(s3env: s3.Proxy,
                                                   endpoint: tuple[str, s3.Proxy],
                                                   sample_run: Path, tmp_path: Path) -> None:
    """Repacked by Python's zipfile, records no longer sit where torch's writer puts them:
    the check against the headers at hand catches it, every header is fetched, and inspect,
    validate and diff give what they give for the local file."""
    import zipfile

    src = sample_run / "step_000100" / "checkpoint.pt"
    repacked = tmp_path / "repacked.pt"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(repacked, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info.filename))
    url = _upload_one(endpoint, repacked, "repacked.pt")
    for cmd in (["inspect"], ["validate"], ["diff", str(src)]):
        remote = _doc(cmd[0], url, *cmd[1:], code=0)
        local = _doc(cmd[0], repacked, *cmd[1:], code=0)
        assert _normal(remote, "", "") == _normal(local, str(repacked), url), cmd


def test_a_damaged_local_header_is_found_on_a_store(s3env: s3.Proxy,
                                                    endpoint: tuple[str, s3.Proxy],
                                                    sample_run: Path, tmp_path: Path) -> None:
    import zipfile

    src = sample_run / "step_000100" / "checkpoint.pt"
    with zipfile.ZipFile(src) as z:
        # A record in the middle: its header lies in no block the parse fetched anyway.
        info = sorted(z.infolist(), key=lambda i: i.header_offset)[len(z.infolist()) // 2]
    data = bytearray(src.read_bytes())
    data[info.header_offset + 30] ^= 0x20  # a letter of the record's name, in its local header
    bad = tmp_path / "bad.pt"
    bad.write_bytes(bytes(data))
    url = _upload_one(endpoint, bad, "bad.pt")
    remote = _doc("validate", url, code=1)
    local = _doc("validate", bad, code=1)
    assert _normal(remote, "", "") == _normal(local, str(bad), url)
    codes = {f["code"] for f in remote["checkpoints"][0]["findings"]}
    assert "zip-local-header" in codes, codes


def test_a_killed_write_is_reported_by_validate_and_aborted_by_prune(
        s3env: s3.Proxy, endpoint: tuple[str, s3.Proxy], sample_run: Path) -> None:
    """kill -9 in the middle of an upload leaves a multipart upload that no listing shows but
    whose parts are billed: validate warns of it; prune aborts it once no part has come for
    an hour (and --grace), never one under the checkpoint `latest` names."""
    import time

    from ckpt_cli.ops.prune import prune
    from ckpt_cli.ops.prune.retention import PrunePolicy

    bucket = _bucket(endpoint)
    s3.upload(endpoint[0], sample_run, bucket, "run")
    c = s3.client(endpoint[0])
    # The first of two shards went up; the writer died uploading the second.
    c.put_object(Bucket=bucket, Key="run/step_000500/model-00001-of-00002.safetensors",
                 Body=(sample_run / "export" / "model-00001-of-00004.safetensors").read_bytes())
    key = "run/step_000500/model-00002-of-00002.safetensors"
    latest_key = "run/step_000400/extra.bin"  # under the checkpoint `latest` names
    for k in (key, latest_key):
        up = c.create_multipart_upload(Bucket=bucket, Key=k)["UploadId"]
        c.upload_part(Bucket=bucket, Key=k, UploadId=up, PartNumber=1, Body=b"x" * (5 << 20))
    doc = _doc("validate", f"s3://{bucket}/run/step_000500", code=1)
    findings = doc["checkpoints"][0]["findings"]
    assert any(f["code"] == "unfinished-upload" for f in findings), findings
    url = f"s3://{bucket}/run"
    # Idle for seconds, not an hour: a write that may still be running, even at --grace 0.
    fresh = _doc("prune", url, "--keep", "1", "--grace", "0", "--dry-run")
    assert fresh["object_store"]["stale_uploads"] == []
    later = time.time() + 7200
    policy = PrunePolicy(keep=10, grace=0)
    dry = prune(url, policy, dry_run=True, now=later)
    assert dry.stale_uploads and [k for k, _ in dry.stale_uploads] == [f"{bucket}/{key}"]
    assert sorted(_pending_uploads(endpoint, bucket)) == sorted([key, latest_key])
    done = prune(url, policy, now=later)
    assert done.uploads_aborted == [f"{bucket}/{key}"]
    assert _pending_uploads(endpoint, bucket) == [latest_key]


def test_without_permission_to_list_uploads_validate_still_works(
        s3env: s3.Proxy, bucket_run: str) -> None:
    """A read-only role often lacks s3:ListBucketMultipartUploads."""
    s3env.faults.status, s3env.faults.only_path = 403, "?uploads"
    doc = _doc("validate", f"s3://{bucket_run}/run/step_000100")
    assert doc["valid"] is True
    assert any("?uploads" in line for line in s3env.traffic.log)  # it was refused


def test_prune_and_force_never_touch_keys_that_match_as_a_glob(
        s3env: s3.Proxy, endpoint: tuple[str, s3.Proxy], sample_run: Path) -> None:
    """fsspec's rm expands [ ] ? * as globs: deleting exp[1]/... must not delete exp1/..."""
    bucket = _bucket(endpoint)
    s3.upload(endpoint[0], sample_run, bucket, "exp[1]/run")
    s3.upload(endpoint[0], sample_run, bucket, "exp1/run")
    other = _keys(endpoint, bucket, "exp1/")
    done = _doc("prune", f"s3://{bucket}/exp[1]/run", "--keep", "1", "--grace", "0", "--yes")
    assert done["summary"]["deleted"] == 3
    assert _keys(endpoint, bucket, "exp1/") == other
    assert not [k for k in _keys(endpoint, bucket, "exp[1]/run/") if "step_0001" in k]


def test_a_failed_force_keeps_the_old_output(s3env: s3.Proxy, endpoint: tuple[str, s3.Proxy],
                                             tmp_path: Path) -> None:
    """Replacing an output whose new version is refused (FP16 overflow) leaves the old one
    as it was, as a local --force does."""
    import numpy as np
    from safetensors.numpy import save_file

    src = tmp_path / "big-values.safetensors"
    save_file({"w": np.full((64,), 1e6, np.float32)}, str(src))
    bucket = _bucket(endpoint)
    url = f"s3://{bucket}/out"
    assert run_cli("convert", src, "--to", "bf16", "-o", url).exit_code == 0
    before = {k: _get(endpoint, bucket, k) for k in _keys(endpoint, bucket)}
    r = run_cli("convert", src, "--to", "fp16", "-o", url, "--force")
    assert r.exit_code == 2 and "FP16" in r.stderr, r.output
    assert {k: _get(endpoint, bucket, k) for k in _keys(endpoint, bucket)} == before
    assert _pending_uploads(endpoint, bucket) == []


def test_verify_of_an_output_on_a_store_is_refused(s3env: s3.Proxy, bucket_run: str,
                                                   sample_run: Path) -> None:
    r = run_cli("consolidate", sample_run / "step_000400", "-o",
                f"s3://{bucket_run}/verified.safetensors", "--verify")
    assert r.exit_code == 2 and "--verify" in r.stderr and "ckpt diff" in r.stderr


def test_folder_marker_objects_are_directories(s3env: s3.Proxy,
                                               endpoint: tuple[str, s3.Proxy],
                                               sample_run: Path) -> None:
    """S3 consoles, rclone and S3A make zero-byte 'step_000200/' objects."""
    bucket = _bucket(endpoint)
    s3.upload(endpoint[0], sample_run, bucket, "run")
    c = s3.client(endpoint[0])
    for d in ("run/", "run/step_000100/", "run/step_000200/"):
        c.put_object(Bucket=bucket, Key=d, Body=b"")
    doc = _doc("inspect", f"s3://{bucket}/run")
    assert [e["name"] for e in doc["checkpoints"]] == [
        "step_000100", "step_000200", "step_000300", "step_000400"]
    assert _doc("validate", f"s3://{bucket}/run/step_000200")["valid"] is True


def test_concurrent_readers_of_one_object_get_the_right_bytes(
        s3env: s3.Proxy, endpoint: tuple[str, s3.Proxy], tmp_path: Path) -> None:
    """8 threads streaming stretches of one object through the shared read-ahead chunks
    (2 in flight), small and large reads mixed: every byte right, nothing cancelled under
    another reader, and not much more fetched than the object holds."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    data = random.Random(0).randbytes(40 << 20)
    src = tmp_path / "blob.bin"
    src.write_bytes(data)
    url = _upload_one(endpoint, src, "blob.bin")
    storage.configure({}, concurrency=2)
    f = storage.locate(url).open_object()  # type: ignore[attr-defined]

    def stretch(i: int) -> bool:
        lo = i * (5 << 20)
        off, ok = lo, True
        step = [512 << 10, 100_000, 5 << 20, 1 << 20][i % 4]
        while off < lo + (5 << 20):
            n = min(step, lo + (5 << 20) - off)
            ok &= f.pread(n, off) == data[off:off + n]
            off += n
        return ok

    s3env.traffic.reset()
    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(stretch, range(8)))
    assert s3env.traffic.bytes_out < 2 * len(data)


def test_object_paths_of_other_stores_are_other_paths() -> None:
    a, b = storage.locate("s3://b/x"), storage.locate("gs://b/x")
    assert a != b and a != Path("/b/x") and a == storage.locate("s3://b/x")
    assert len({a, b, storage.locate("s3://b/x")}) == 2


def test_schemes_that_are_not_object_stores_are_refused() -> None:
    for url in ("ftp://127.0.0.1:1/x", "http://host/x.safetensors"):
        r = run_cli("inspect", url)
        assert r.exit_code == 2, r.output
        assert "is not an object store" in r.output + r.stderr
        assert "Traceback" not in r.output + r.stderr and "Exception" not in r.stderr


def test_a_block_wanted_by_many_threads_at_once_is_fetched_once(
        s3env: s3.Proxy, endpoint: tuple[str, s3.Proxy], tmp_path: Path) -> None:
    import random
    from concurrent.futures import ThreadPoolExecutor

    data = random.Random(1).randbytes(3 << 20)
    src = tmp_path / "blob.bin"
    src.write_bytes(data)
    url = _upload_one(endpoint, src, "blob.bin")
    storage.configure({})
    f = storage.locate(url).open_object()  # type: ignore[attr-defined]
    s3env.traffic.reset()
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda _: f.pread(1000, 1 << 20), range(16)))
    assert all(g == data[1 << 20:(1 << 20) + 1000] for g in got)
    gets = [line for line in s3env.traffic.log if line.startswith("GET") and "bytes=" in line]
    assert len(gets) == 1, gets


def test_a_multipart_upload_sends_parts_in_parallel_and_the_bytes_are_right(
        s3env: s3.Proxy, endpoint: tuple[str, s3.Proxy], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    src = tmp_path / "big.safetensors"
    save_file({f"w{i}": np.random.default_rng(i).standard_normal((1024, 1024), np.float32)
               for i in range(6)}, str(src))
    monkeypatch.setattr(objects, "UPLOAD_PART", 5 << 20)  # S3's smallest part
    bucket = _bucket(endpoint)
    s3env.traffic.reset()
    r = run_cli("convert", src, "-o", f"s3://{bucket}/m.safetensors")
    assert r.exit_code == 0, r.output
    parts = [line for line in s3env.traffic.log if line.startswith("PUT") and "partNumber" in line]
    assert len(parts) == 5, parts  # 24 MB in 5 MiB parts
    local = tmp_path / "m.safetensors"
    assert run_cli("convert", src, "-o", local).exit_code == 0
    assert _get(endpoint, bucket, "m.safetensors") == local.read_bytes()
    assert _pending_uploads(endpoint, bucket) == []


def test_errors_are_told_apart_whatever_the_port() -> None:
    """A random port such as 53403 must not read as an HTTP 403 (it once did: CI failed)."""
    down = 'Could not connect to the endpoint URL: "http://127.0.0.1:53403/b?list-type=2"'
    assert storage._describe(Exception(down)).startswith("cannot reach the storage endpoint")
    assert storage._describe(Exception("http://h:50503/x: Connection reset by peer")).startswith(
        "cannot reach")
    assert storage._describe(Exception(
        "An error occurred (403) when calling the HeadObject operation: Forbidden")).startswith(
        "access denied")
    assert storage._describe(Exception(
        "An error occurred (SlowDown) when calling the GetObject operation")).startswith(
        "the store keeps refusing")


def test_a_missing_key_whose_name_says_bucket_is_a_missing_key(s3env: s3.Proxy,
                                                                bucket_run: str) -> None:
    line = _fails("inspect", f"s3://{bucket_run}/old-bucket-copy/model.safetensors",
                  says="no such")
    assert "no such bucket" not in line
    s3env.faults.status = None  # and through the store's own not-found, for an open
    from ckpt_cli.errors import StorageError

    with pytest.raises(StorageError, match="no such key"):
        storage.locate(f"s3://{bucket_run}/old-bucket-copy/x.bin").store.call(  # type: ignore[attr-defined]
            "k", _raise_not_found)


def _raise_not_found() -> None:
    raise FileNotFoundError("ckpt-bucket/old-bucket-copy/x.bin")
