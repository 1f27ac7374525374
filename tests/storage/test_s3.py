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
from pathlib import Path

import pytest

from ckpt_cli import storage
from tests.conftest import run_cli
from tests.helpers import s3
from tests.helpers.child import ckpt_in_child
from tests.storage.conftest import (
    _doc,
    _fails,
    _normal,
)

pytestmark = pytest.mark.filterwarnings(
    # botocore and moto call datetime.utcnow() and friends; not ckpt's code.
    "ignore::DeprecationWarning")


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
