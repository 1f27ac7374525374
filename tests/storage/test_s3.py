"""Checkpoints on object storage, read through a real S3 endpoint.

moto's server runs on 127.0.0.1 (started here); every request is real HTTP, signed by
botocore, and passes through a proxy that counts requests and bytes and injects faults. The
checkpoints are the ones torch, DCP and safetensors write (``ckpt sample``'s run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckpt_cli import storage
from ckpt_cli.storage import objects
from tests.conftest import run_cli
from tests.helpers import s3
from tests.helpers.child import ckpt_in_child

pytestmark = pytest.mark.filterwarnings(
    # botocore and moto call datetime.utcnow() and friends; not ckpt's code.
    "ignore::DeprecationWarning")


@pytest.fixture(scope="session")
def endpoint() -> Iterator[tuple[str, s3.Proxy]]:
    """moto's S3 server and the proxy in front of it, for the whole session."""
    with s3.moto_endpoint() as pair:
        yield pair


@pytest.fixture(scope="session")
def bucket_run(endpoint: tuple[str, s3.Proxy], sample_run: Path) -> str:
    """The sample run uploaded to ``s3://<bucket>/run``; returns the bucket."""
    moto, _ = endpoint
    name = s3.new_bucket(moto)
    s3.upload(moto, sample_run, name, "run")
    return name


def _doc(*args: str | Path, code: int = 0) -> dict[str, Any]:
    r = run_cli(*args, "--json")
    assert r.exit_code == code, r.output
    doc: dict[str, Any] = json.loads(r.stdout)
    return doc


_VARYING = {"mtime", "age_seconds", "modified", "created", "elapsed_seconds", "seconds",
            "changed", "duration_seconds"}


def _normal(doc: Any, local: str, url: str) -> Any:
    """``doc`` with the local root spelled as the URL and times dropped."""
    if isinstance(doc, dict):
        return {k: _normal(v, local, url) for k, v in doc.items() if k not in _VARYING}
    if isinstance(doc, list):
        return [_normal(v, local, url) for v in doc]
    if isinstance(doc, str):
        return doc.replace(local, url)
    return doc


@pytest.mark.parametrize("rel", ["", "/step_000100/checkpoint.pt", "/step_000100",
                                 "/step_000400", "/export",
                                 "/export/model-00001-of-00004.safetensors"])
def test_inspect_json_is_the_same_as_local(s3env: s3.Proxy, bucket_run: str, sample_run: Path,
                                           rel: str) -> None:
    url = f"s3://{bucket_run}/run{rel}"
    remote = _doc("inspect", url)
    local = _doc("inspect", f"{sample_run}{rel}")
    assert remote["path"] == url
    assert _normal(remote, "", "") == _normal(local, str(sample_run), f"s3://{bucket_run}/run")
    assert s3env.traffic.requests > 0  # it did go over the wire


def test_inspect_of_a_run_lists_the_prefix_instead_of_a_head_per_file(
        s3env: s3.Proxy, bucket_run: str) -> None:
    doc = _doc("inspect", f"s3://{bucket_run}/run")
    assert [e["name"] for e in doc["checkpoints"]] == [
        "step_000100", "step_000200", "step_000300", "step_000400"]
    # One recursive LIST; no HEAD of the 18 objects; GETs only for headers and pickles.
    assert s3env.traffic.by_method.get("HEAD", 0) == 0
    assert s3env.traffic.requests <= 20


@pytest.mark.requires_torch
def test_inspect_of_a_big_torch_file_moves_only_its_structure(
        s3env: s3.Proxy, endpoint: tuple[str, s3.Proxy], tmp_path: Path) -> None:
    """A 79 MB training checkpoint with 400 tensors: the central directory, data.pkl and
    little else cross the wire (never the tensor data), in a handful of requests."""
    import torch

    torch.manual_seed(0)
    model = {f"layer{i}.weight": torch.randn(512, 128) for i in range(100)}
    opt = {"state": {i: {"exp_avg": torch.zeros(512, 128), "exp_avg_sq": torch.zeros(512, 128),
                         "step": torch.tensor(7.0)} for i in range(100)},
           "param_groups": [{"lr": 1e-3, "params": list(range(100))}]}
    src = tmp_path / "train.pt"
    torch.save({"model": model, "optimizer": opt, "step": 7}, src)
    name = f"big-{uuid.uuid4().hex[:8]}"
    s3.client(endpoint[0]).create_bucket(Bucket=name)
    s3.upload(endpoint[0], src, name, "train.pt")
    s3env.traffic.reset()
    remote = _doc("inspect", f"s3://{name}/train.pt")
    moved, requests = s3env.traffic.bytes_out, s3env.traffic.requests
    local = _doc("inspect", src)
    assert _normal(remote, "", "") == _normal(local, str(src), f"s3://{name}/train.pt")
    assert remote["num_tensors"] == 400 and remote["step"] == 7
    size = src.stat().st_size
    assert size > 60e6
    assert moved < 2e6, f"{moved:,} bytes moved for a {size:,}-byte file"
    assert requests <= 10, s3env.traffic.by_method


def test_validate_run_on_s3_checks_crc_and_values(s3env: s3.Proxy, bucket_run: str,
                                                 sample_run: Path) -> None:
    url = f"s3://{bucket_run}/run"
    remote = _doc("validate", url)
    local = _doc("validate", sample_run)
    assert _normal(remote, "", "") == _normal(local, str(sample_run), url)
    step = _doc("validate", f"{url}/step_000400", "--values")
    assert step["valid"] is True
    checks = {c["id"]: c["status"] for c in step["checkpoints"][0]["checks"]}
    assert checks["crc32"] == "pass" and checks["values"] == "pass", checks


def test_validate_finds_a_damaged_object(s3env: s3.Proxy, endpoint: tuple[str, s3.Proxy],
                                         sample_run: Path, tmp_path: Path) -> None:
    """A flipped byte inside a tensor of a torch file on S3 fails its CRC-32 check."""
    src = sample_run / "step_000100" / "checkpoint.pt"
    bad = tmp_path / "checkpoint.pt"
    data = bytearray(src.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    name = f"bad-{uuid.uuid4().hex[:8]}"
    s3.client(endpoint[0]).create_bucket(Bucket=name)
    s3.upload(endpoint[0], bad, name, "step_000100/checkpoint.pt")
    doc = _doc("validate", f"s3://{name}/step_000100", code=1)
    assert doc["valid"] is False
    findings = doc["checkpoints"][0]["findings"]
    assert any("crc" in f["code"] for f in findings), findings


def test_diff_across_local_and_s3(s3env: s3.Proxy, bucket_run: str, sample_run: Path) -> None:
    url = f"s3://{bucket_run}/run"
    same = _doc("diff", f"{url}/step_000300", sample_run / "step_000300")
    assert same["equal"] is True
    changed = _doc("diff", f"{url}/step_000100", f"{url}/step_000200", code=1)
    local = _doc("diff", sample_run / "step_000100", sample_run / "step_000200", code=1)
    assert changed["summary"] == local["summary"]


def test_diff_of_one_url_with_itself_answers_at_once(s3env: s3.Proxy, bucket_run: str) -> None:
    url = f"s3://{bucket_run}/run/step_000100"
    doc = _doc("diff", url, url + "/")
    assert doc["equal"] is True and doc["same_checkpoint"]


def test_convert_from_s3_to_a_local_file(s3env: s3.Proxy, bucket_run: str, sample_run: Path,
                                         tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    r = run_cli("convert", f"s3://{bucket_run}/run/step_000100", "-o", out, "--to", "fp16")
    assert r.exit_code == 0, r.output
    ref = tmp_path / "ref.safetensors"
    r = run_cli("convert", sample_run / "step_000100", "-o", ref, "--to", "fp16")
    assert r.exit_code == 0, r.output
    from safetensors import safe_open

    with safe_open(out, "np") as a, safe_open(ref, "np") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        for k in a.keys():
            assert a.get_tensor(k).tobytes() == b.get_tensor(k).tobytes()


# -- bad input and faults: one line naming the URL, exit 2, never a traceback -----------------


def _fails(*args: str, says: str) -> str:
    r = run_cli(*args)
    assert r.exit_code == 2, r.output
    err = r.stderr
    assert "Traceback" not in err and "internal error" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("ckpt: error:")]
    assert len(lines) == 1, err
    assert says in lines[0], lines[0]
    assert s3.SECRET not in r.output and s3.SECRET not in err
    return lines[0]


def test_missing_bucket_and_key(s3env: s3.Proxy, bucket_run: str) -> None:
    line = _fails("inspect", "s3://no-such-bucket-ckpt/run", says="no such bucket")
    assert "s3://no-such-bucket-ckpt/run" in line
    _fails("inspect", f"s3://{bucket_run}/run/step_999999", says="no such")


def test_endpoint_down(s3env: s3.Proxy, monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    storage.configure({})
    _fails("inspect", "s3://any-bucket/run", says="cannot reach the storage endpoint")


def test_no_credentials(s3env: s3.Proxy, monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(k)
    storage.configure({})
    _fails("inspect", "s3://any-bucket/run", says="no credentials")


def test_access_denied(s3env: s3.Proxy, bucket_run: str) -> None:
    s3env.faults.status = 403
    _fails("inspect", f"s3://{bucket_run}/run", says="access denied")


def test_throttling_is_retried_then_passes(s3env: s3.Proxy, bucket_run: str) -> None:
    s3env.faults.status, s3env.faults.remaining = 503, 2
    doc = _doc("inspect", f"s3://{bucket_run}/run/step_000100/checkpoint.pt")
    assert doc["step"] == 100
    assert s3env.faults.remaining == 0


def test_throttling_that_never_ends_is_one_line(s3env: s3.Proxy, bucket_run: str) -> None:
    s3env.faults.status = 503
    storage.configure({"retries": 1})
    r = run_cli("inspect", f"s3://{bucket_run}/run/step_000100/checkpoint.pt",
                "--storage-option", "retries=1")
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.stderr
    assert f"s3://{bucket_run}/run/step_000100/checkpoint.pt" in r.stderr


def test_connection_dropped_mid_object(s3env: s3.Proxy, bucket_run: str) -> None:
    """Every GET of the object is cut after 1 KB: the read fails with one line, no output."""
    s3env.faults.cut_after = 1024
    r = run_cli("validate", f"s3://{bucket_run}/run/step_000100", "--json",
                "--storage-option", "retries=1")
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.stderr
    doc = json.loads(r.stdout)
    assert doc["error"]["kind"] == "storage"
    assert f"s3://{bucket_run}/run/step_000100" in doc["error"]["message"] + (
        doc["error"]["path"] or "")


def test_a_connection_dropped_once_is_retried(s3env: s3.Proxy, bucket_run: str) -> None:
    s3env.faults.cut_after, s3env.faults.cut_remaining = 1024, 1
    doc = _doc("inspect", f"s3://{bucket_run}/run/step_000100/checkpoint.pt")
    assert doc["step"] == 100
    assert s3env.faults.cut_remaining == 0  # the cut happened, and the read was retried


def test_secrets_never_printed(s3env: s3.Proxy, bucket_run: str,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The secret key appears in no output, error or --json document, whichever way it came."""
    outs: list[str] = []
    s3env.faults.status = 403
    for args in (["inspect", f"s3://{bucket_run}/run"],
                 ["inspect", f"s3://{bucket_run}/run", "--json"],
                 ["validate", f"s3://{bucket_run}/run", "--json"],
                 ["inspect", f"s3://{bucket_run}/run", "-S", f"secret={s3.SECRET}",
                  "-S", f"key={s3.ACCESS_KEY}"]):
        r = run_cli(*args)
        assert r.exit_code == 2
        outs.append(r.output + r.stderr)
    s3env.faults.clear()
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    r = run_cli("inspect", f"s3://{bucket_run}/run/step_000100", "--json",
                "-S", f"secret={s3.SECRET}", "-S", f"key={s3.ACCESS_KEY}")
    assert r.exit_code == 0, r.output
    outs.append(r.output + r.stderr)
    r = run_cli("inspect", f"s3://{bucket_run}/run", "-S", "secret", "--json")
    assert r.exit_code == 2
    outs.append(r.output + r.stderr)
    for out in outs:
        assert s3.SECRET not in out
    assert "KEY=VALUE" in outs[-1]


def test_credentials_in_a_url_are_refused_and_not_echoed(s3env: s3.Proxy) -> None:
    r = run_cli("inspect", f"s3://{s3.ACCESS_KEY}:{s3.SECRET}@bucket/run")
    assert r.exit_code == 2
    assert s3.SECRET not in r.output + r.stderr
    assert "credentials in a URL" in r.output + r.stderr


def test_local_only_paths_refuse_urls(s3env: s3.Proxy, bucket_run: str,
                                      sample_run: Path) -> None:
    """Where a local file is written (a JUnit report, a sample run, ...), a URL is a usage
    error, never a local directory named 's3:'."""
    for args in (["validate", sample_run / "step_000100", "--junit", f"s3://{bucket_run}/j"],
                 ["sample", f"s3://{bucket_run}/demo"],
                 ["plan", "--measure", f"s3://{bucket_run}/x"],
                 ["validate", f"s3://{bucket_run}/run/step_000100", "--write-manifest"]):
        r = run_cli(*args)
        assert r.exit_code == 2, (args, r.output)
        assert "must be a local path, not a URL" in r.stderr, r.stderr
    assert not Path("s3:").exists()


def test_parts_with_an_output_on_object_storage_are_refused(s3env: s3.Proxy, bucket_run: str,
                                                            sample_run: Path) -> None:
    r = run_cli("consolidate", sample_run / "step_000400", "-o", f"s3://{bucket_run}/m",
                "--part", "1/2")
    assert r.exit_code == 2
    assert "--part needs a local" in r.stderr


# -- lean local paths ----------------------------------------------------------------------


def test_local_paths_never_import_fsspec(sample_run: Path) -> None:
    r = ckpt_in_child("inspect", str(sample_run / "export"), "--json",
                      report="'FSSPEC=%s' % ('fsspec' in sys.modules)")
    assert "FSSPEC=False" in r.stderr, r.stderr


def test_a_url_without_the_extra_names_it(tmp_path: Path) -> None:
    code = ("import sys\n"
            "sys.modules['fsspec'] = None  # as if it were not installed\n"
            "from ckpt_cli.cli.app import main\n"
            "sys.argv = ['ckpt', 'inspect', 's3://bucket/run']\n"
            "main()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stderr
    assert "pip install 'ckpt-cli[s3]'" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("url,without,hint", [
    ("gs://bucket/run", "gcsfs", "pip install gcsfs"),
    ("az://container/run", "adlfs", "pip install adlfs"),
    ("abfs://container/run", "adlfs", "pip install adlfs"),
    ("s3://bucket/run", "s3fs", "pip install 'ckpt-cli[s3]'"),
    ("gs://bucket/run", "fsspec", "pip install fsspec gcsfs"),
    ("az://container/run", "fsspec", "pip install fsspec adlfs"),
])
def test_a_url_names_the_package_its_scheme_needs(url: str, without: str, hint: str) -> None:
    """``gs://`` needs gcsfs and ``az://`` adlfs, which the s3 extra does not install."""
    code = ("import sys\n"
            f"sys.modules[{without!r}] = None  # as if it were not installed\n"
            "from ckpt_cli.cli.app import main\n"
            f"sys.argv = ['ckpt', 'inspect', {url!r}]\n"
            "main()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "NO_COLOR": "1"})
    assert r.returncode == 2, r.stderr
    assert r.stderr.rstrip().endswith(f": {hint}"), r.stderr
    assert "Traceback" not in r.stderr


def test_storage_options_parse() -> None:
    got = storage.parse_options(["anon=true", "retries=3", "client_kwargs.region_name=eu-1",
                                 "endpoint_url=http://h:9000", "x=none"])
    assert got == {"anon": True, "retries": 3, "client_kwargs": {"region_name": "eu-1"},
                   "endpoint_url": "http://h:9000", "x": None}
    with pytest.raises(storage.UsageError):
        storage.parse_options(["novalue"])


def test_redact_covers_options_env_and_userinfo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SESSION_TOKEN", "tok-123456789")
    storage.configure({"secret": "opt-secret-42", "client_kwargs": {"aws_secret_access_key":
                                                                    "nested-secret-9"}})
    try:
        text = ("a opt-secret-42 b tok-123456789 c nested-secret-9 "
                "https://user:pw@host/x")
        out = storage.redact(text)
        for s in ("opt-secret-42", "tok-123456789", "nested-secret-9", "user:pw"):
            assert s not in out
    finally:
        storage.configure({})


def test_object_path_behaves_like_a_path() -> None:
    p = storage.locate("s3://bucket/run/step_1/model.safetensors")
    assert str(p) == "s3://bucket/run/step_1/model.safetensors"
    assert p.name == "model.safetensors" and p.suffix == ".safetensors"
    assert str(p.parent) == "s3://bucket/run/step_1"
    assert str(p.parent / "x.json") == "s3://bucket/run/step_1/x.json"
    assert p.relative_to(p.parent.parent).as_posix() == "step_1/model.safetensors"
    assert storage.is_remote(p) and not storage.is_remote(Path("/tmp"))
    assert storage.locate("file:///tmp/x") == Path("/tmp/x")
    assert storage.locate("relative/dir") == Path("relative/dir")
    with pytest.raises(storage.UsageError):
        os.fspath(p)  # nothing may treat it as a local file by accident


# -- outputs on object storage: atomic by ordering -----------------------------------------


def _bucket(endpoint: tuple[str, s3.Proxy]) -> str:
    name = f"out-{uuid.uuid4().hex[:10]}"
    s3.client(endpoint[0]).create_bucket(Bucket=name)
    return name


def _keys(endpoint: tuple[str, s3.Proxy], bucket: str, prefix: str = "") -> list[str]:
    c = s3.client(endpoint[0])
    pages = c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


def _pending_uploads(endpoint: tuple[str, s3.Proxy], bucket: str) -> list[str]:
    got = s3.client(endpoint[0]).list_multipart_uploads(Bucket=bucket)
    return [u["Key"] for u in got.get("Uploads", [])]


def _get(endpoint: tuple[str, s3.Proxy], bucket: str, key: str) -> bytes:
    body: bytes = s3.client(endpoint[0]).get_object(Bucket=bucket, Key=key)["Body"].read()
    return body


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
