"""Outputs on object storage through a real S3 endpoint (moto behind a counting, fault-injecting
proxy): atomic by ordering, and prune on a prefix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ckpt_cli import storage
from ckpt_cli.storage import objects
from tests.conftest import run_cli
from tests.helpers import s3
from tests.storage.conftest import (
    _bucket,
    _doc,
    _get,
    _keys,
    _pending_uploads,
)

pytestmark = pytest.mark.filterwarnings(
    # botocore and moto call datetime.utcnow() and friends; not ckpt's code.
    "ignore::DeprecationWarning")


def test_convert_to_s3_is_byte_identical_to_a_local_convert(
        s3env: s3.Proxy, endpoint: tuple[str, s3.Proxy], sample_run: Path,
        tmp_path: Path) -> None:
    bucket = _bucket(endpoint)
    src = sample_run / "step_000100"
    url = f"s3://{bucket}/export/model.safetensors"
    r = run_cli("convert", src, "-o", url, "--to", "bf16")
    assert r.exit_code == 0, r.output
    local = tmp_path / "model.safetensors"
    assert run_cli("convert", src, "-o", local, "--to", "bf16").exit_code == 0
    assert _get(endpoint, bucket, "export/model.safetensors") == local.read_bytes()
    # An existing output is never overwritten without --force.
    r = run_cli("convert", src, "-o", f"s3://{bucket}/export/model.safetensors")
    assert r.exit_code == 2 and "exists" in r.stderr
    r = run_cli("convert", src, "-o", f"s3://{bucket}/export/model.safetensors", "--to",
                "fp16", "--force")
    assert r.exit_code == 0, r.output
    assert _doc("inspect", f"s3://{bucket}/export/model.safetensors")["params_by_dtype"] == {
        "F16": 135936}


@pytest.mark.requires_torch
def test_a_torch_file_written_to_s3_loads_in_torch(s3env: s3.Proxy,
                                                    endpoint: tuple[str, s3.Proxy],
                                                    sample_run: Path, tmp_path: Path) -> None:
    """An upload cannot seek back to patch a record's CRC into its local header, so the zip
    carries data descriptors instead (a valid zip, not the same bytes as a local write):
    torch.load reads it, and so does validate."""
    import torch

    bucket = _bucket(endpoint)
    src = sample_run / "step_000100"
    r = run_cli("convert", src, "-o", f"s3://{bucket}/model.pt", "--to", "bf16")
    assert r.exit_code == 0, r.output
    got = tmp_path / "got.pt"
    got.write_bytes(_get(endpoint, bucket, "model.pt"))
    local = tmp_path / "model.pt"
    assert run_cli("convert", src, "-o", local, "--to", "bf16").exit_code == 0
    a = torch.load(got, weights_only=True)
    b = torch.load(local, weights_only=True)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert _doc("validate", f"s3://{bucket}/model.pt")["valid"] is True


def test_consolidate_to_s3_writes_shards_then_index_then_manifest(
        s3env: s3.Proxy, endpoint: tuple[str, s3.Proxy], sample_run: Path,
        tmp_path: Path) -> None:
    bucket = _bucket(endpoint)
    url = f"s3://{bucket}/merged"
    s3env.traffic.reset()
    r = run_cli("consolidate", sample_run / "step_000400", "-o", url, "--max-shard-size",
                "200KB")
    assert r.exit_code == 0, r.output
    keys = _keys(endpoint, bucket, "merged/")
    names = [k.split("/", 1)[1] for k in keys]
    assert "model.safetensors.index.json" in names and "ckpt-manifest.json" in names
    shards = [n for n in names if n.startswith("model-")]
    assert len(shards) >= 3
    local = tmp_path / "merged"
    assert run_cli("consolidate", sample_run / "step_000400", "-o", local,
                   "--max-shard-size", "200KB").exit_code == 0
    for n in [*shards, "model.safetensors.index.json"]:
        assert _get(endpoint, bucket, f"merged/{n}") == (local / n).read_bytes(), n
    doc = _doc("validate", url)
    checks = {c["id"]: c["status"] for c in doc["checkpoints"][0]["checks"]}
    assert doc["valid"] and checks["manifest"] == "pass", checks


def test_replacing_a_sharded_output_on_s3_removes_the_old_shards(
        s3env: s3.Proxy, endpoint: tuple[str, s3.Proxy], sample_run: Path) -> None:
    bucket = _bucket(endpoint)
    url = f"s3://{bucket}/merged"
    src = sample_run / "step_000400"
    assert run_cli("consolidate", src, "-o", url, "--max-shard-size", "200KB").exit_code == 0
    assert run_cli("consolidate", src, "-o", url).exit_code == 2  # exists, no --force
    r = run_cli("consolidate", src, "-o", url, "--force")
    assert r.exit_code == 0, r.output
    names = [k.split("/", 1)[1] for k in _keys(endpoint, bucket, "merged/")]
    assert names == ["ckpt-manifest.json", "model.safetensors"]
    assert _doc("validate", url)["valid"] is True


def test_a_failed_upload_leaves_nothing_behind(s3env: s3.Proxy,
                                               endpoint: tuple[str, s3.Proxy],
                                               sample_run: Path) -> None:
    """The store refuses every PUT of a shard: no object, and no pending multipart upload."""
    bucket = _bucket(endpoint)
    s3env.faults.status, s3env.faults.only_method = 500, "PUT"
    r = run_cli("consolidate", sample_run / "step_000400", "-o", f"s3://{bucket}/merged",
                "--max-shard-size", "200KB", "-S", "retries=1")
    s3env.faults.clear()
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.stderr
    assert _keys(endpoint, bucket) == []
    assert _pending_uploads(endpoint, bucket) == []


@pytest.mark.requires_torch
def test_ctrl_c_in_a_multipart_upload_aborts_it(s3env: s3.Proxy,
                                                endpoint: tuple[str, s3.Proxy],
                                                tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C after some parts of a 24 MB output went up: the upload is aborted (its parts
    deleted), the shards already written are removed, and exit is 130."""
    import numpy as np
    from safetensors.numpy import save_file

    src = tmp_path / "big.safetensors"
    save_file({f"w{i}": np.random.default_rng(i).standard_normal((1024, 1024), np.float32)
               for i in range(6)}, str(src))
    monkeypatch.setattr(objects, "UPLOAD_PART", 5 << 20)  # S3's smallest part
    sent = {"bytes": 0}
    real_write = storage.Upload.write

    def write(self: storage.Upload, data: Any) -> int:
        # Past the first 12 MB shard and 8 MB into the second (a part of which is up).
        if sent["bytes"] > 20 << 20:
            raise KeyboardInterrupt
        sent["bytes"] += len(data)
        return real_write(self, data)

    monkeypatch.setattr(storage.Upload, "write", write)
    bucket = _bucket(endpoint)
    r = run_cli("convert", src, "-o", f"s3://{bucket}/out", "--max-shard-size", "12MB")
    assert r.exit_code == 130, r.output
    assert s3env.traffic.by_method.get("POST", 0) >= 1  # a multipart upload was started
    assert _keys(endpoint, bucket) == []
    assert _pending_uploads(endpoint, bucket) == []


def test_fp16_overflow_refusal_leaves_no_object(s3env: s3.Proxy,
                                                endpoint: tuple[str, s3.Proxy],
                                                tmp_path: Path) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    src = tmp_path / "big-values.safetensors"
    save_file({"w": np.full((64,), 1e6, np.float32)}, str(src))
    bucket = _bucket(endpoint)
    r = run_cli("convert", src, "-o", f"s3://{bucket}/m.safetensors", "--to", "fp16")
    assert r.exit_code == 2 and "FP16" in r.stderr, r.output
    assert _keys(endpoint, bucket) == []
    assert _pending_uploads(endpoint, bucket) == []


# -- prune on a prefix -----------------------------------------------------------------------


def test_prune_on_a_prefix(s3env: s3.Proxy, endpoint: tuple[str, s3.Proxy],
                           sample_run: Path) -> None:
    bucket = _bucket(endpoint)
    s3.upload(endpoint[0], sample_run, bucket, "run")
    # Neighbours that share the prefix's spelling but lie outside it.
    s3.upload(endpoint[0], sample_run / "step_000100", bucket, "run2/step_000100")
    s3.upload(endpoint[0], sample_run / "step_000100", bucket, "runs/step_000100")
    before = _keys(endpoint, bucket)
    url = f"s3://{bucket}/run"
    dry = _doc("prune", url, "--keep", "1", "--grace", "0", "--dry-run")
    assert dry["object_store"]["keys"] == {
        "step_000100": [f"s3://{bucket}/run/step_000100/checkpoint.pt"],
        "step_000200": [f"s3://{bucket}/run/step_000200/checkpoint.pt"],
        "step_000300": [f"s3://{bucket}/run/step_000300/checkpoint.pt"]}
    assert _keys(endpoint, bucket) == before  # a dry run changes nothing
    # Written a moment ago: protected by the default grace period.
    fresh = _doc("prune", url, "--keep", "1", "--yes")
    assert fresh["summary"]["deleted"] == 0
    done = _doc("prune", url, "--keep", "1", "--grace", "0", "--yes")
    assert done["summary"]["deleted"] == 3
    after = _keys(endpoint, bucket)
    assert [k for k in before if k not in after] == [
        "run/step_000100/checkpoint.pt", "run/step_000200/checkpoint.pt",
        "run/step_000300/checkpoint.pt"]
    # latest's target stays; validate agrees the run is whole.
    assert _doc("validate", url)["valid"] is True


def test_prune_keeps_a_checkpoint_still_being_written(
        s3env: s3.Proxy, endpoint: tuple[str, s3.Proxy], sample_run: Path) -> None:
    """A DCP step without its .metadata (the commit marker DCP writes last) is never
    deleted, nor counted as the newest valid one."""
    bucket = _bucket(endpoint)
    s3.upload(endpoint[0], sample_run, bucket, "run")
    c = s3.client(endpoint[0])
    for k in _keys(endpoint, bucket, "run/step_000400/"):
        c.copy_object(Bucket=bucket, Key=k.replace("step_000400", "step_000500"),
                      CopySource={"Bucket": bucket, "Key": k})
    c.delete_object(Bucket=bucket, Key="run/step_000500/.metadata")
    doc = _doc("prune", f"s3://{bucket}/run", "--keep", "1", "--grace", "0", "--yes")
    status = {d["name"]: d["status"] for d in doc["checkpoints"]}
    assert status["step_000500"] == "kept" and status["step_000400"] == "kept"
    assert _keys(endpoint, bucket, "run/step_000500/")


def test_prune_says_when_the_bucket_is_versioned(
        s3env: s3.Proxy, endpoint: tuple[str, s3.Proxy], sample_run: Path) -> None:
    bucket = _bucket(endpoint)
    s3.client(endpoint[0]).put_bucket_versioning(
        Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    s3.upload(endpoint[0], sample_run, bucket, "run")
    r = run_cli("prune", f"s3://{bucket}/run", "--keep", "1", "--grace", "0", "--dry-run")
    assert r.exit_code == 0, r.output
    assert "versioned" in r.stdout
    assert _doc("prune", f"s3://{bucket}/run", "--keep", "1", "--dry-run")[
        "object_store"]["versioned"] is True
