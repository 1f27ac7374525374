"""``convert --to dcp`` from and to object storage, through a real S3 endpoint (moto behind a
counting, fault-injecting proxy): what is uploaded loads through ``dcp.load`` bit for bit as
the local output does, ``.metadata`` goes up last, and a failed write leaves nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_cli
from tests.helpers import s3
from tests.helpers.loads import dcp_dir
from tests.storage.conftest import _bucket, _doc, _keys, _pending_uploads

pytestmark = [pytest.mark.requires_torch, pytest.mark.filterwarnings(
    # botocore and moto call datetime.utcnow() and friends; not ckpt's code.
    "ignore::DeprecationWarning")]

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def train_pt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.helpers import fsdp_resume as fr

    return fr.save_training_dict(tmp_path_factory.mktemp("dcp-src") / "train.pt")


def _download(endpoint: tuple[str, s3.Proxy], bucket: str, prefix: str, to: Path) -> Path:
    c = s3.client(endpoint[0])
    to.mkdir()
    for key in _keys(endpoint, bucket, prefix + "/"):
        c.download_file(bucket, key, str(to / key[len(prefix) + 1:]))
    return to



def _bits(t: Any) -> bytes:
    return bytes(t.reshape(-1).contiguous().view(torch.uint8).numpy())


def _same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert _bits(a) == _bits(b), where
    else:
        assert a == b, where


def test_local_s3_and_back_load_bit_for_bit(s3env: s3.Proxy, endpoint: tuple[str, s3.Proxy],
                                            train_pt: Path, tmp_path: Path) -> None:
    local = tmp_path / "local"
    assert run_cli("convert", train_pt, "--to", "dcp", "-o", local).exit_code == 0
    want = dcp_dir(local)
    assert "optimizer" in want and "train_state" in want and "rng" in want
    bucket = _bucket(endpoint)
    s3.upload(endpoint[0], train_pt, bucket, "src/train.pt")
    s3env.traffic.reset()
    # local -> s3
    r = run_cli("convert", train_pt, "--to", "dcp", "-o", f"s3://{bucket}/a")
    assert r.exit_code == 0, r.output
    # .metadata is the commit marker: the last object to go up.
    puts = [ln.split()[1] for ln in s3env.traffic.log if ln.startswith(("PUT", "POST"))]
    assert puts and ".metadata" in puts[-1] and sum(".metadata" in p for p in puts) == 1, puts
    # s3 -> s3 and s3 -> local
    r = run_cli("convert", f"s3://{bucket}/src/train.pt", "--to", "dcp", "-o",
                f"s3://{bucket}/b")
    assert r.exit_code == 0, r.output
    r = run_cli("convert", f"s3://{bucket}/src/train.pt", "--to", "dcp", "-o", tmp_path / "c")
    assert r.exit_code == 0, r.output
    for name, got in (("a", _download(endpoint, bucket, "a", tmp_path / "a")),
                      ("b", _download(endpoint, bucket, "b", tmp_path / "b")),
                      ("c", tmp_path / "c")):
        assert sorted(p.name for p in got.iterdir()) == sorted(p.name for p in
                                                               local.iterdir()), name
        _same(want, dcp_dir(got), name)
    # The other commands read it where it is.
    doc = _doc("inspect", f"s3://{bucket}/a")
    assert doc["format"] == "dcp" and doc["step"] == 2
    assert run_cli("validate", f"s3://{bucket}/a", "--require",
                   "optimizer,step").exit_code == 0
    d = run_cli("diff", train_pt, f"s3://{bucket}/a", "--all")
    assert d.exit_code == 0, d.output


def test_a_failed_upload_leaves_nothing(s3env: s3.Proxy, endpoint: tuple[str, s3.Proxy],
                                        train_pt: Path) -> None:
    bucket = _bucket(endpoint)
    # Every .distcp file goes up; then .metadata's upload is refused.
    s3env.faults.status, s3env.faults.only_path = 403, ".metadata"
    r = run_cli("convert", train_pt, "--to", "dcp", "-o", f"s3://{bucket}/out")
    s3env.faults.clear()
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.stderr and "access denied" in r.stderr, r.stderr
    assert s3.SECRET not in r.output
    assert _keys(endpoint, bucket) == [] and _pending_uploads(endpoint, bucket) == []


def test_overwrite_rules(s3env: s3.Proxy, endpoint: tuple[str, s3.Proxy],
                         train_pt: Path) -> None:
    bucket = _bucket(endpoint)
    url = f"s3://{bucket}/out"
    assert run_cli("convert", train_pt, "--to", "dcp", "-o", url).exit_code == 0
    first = _keys(endpoint, bucket)
    # An extra file from an earlier, larger output: gone once the new one is up.
    c = s3.client(endpoint[0])
    c.put_object(Bucket=bucket, Key="out/__0_90.distcp", Body=b"old")
    r = run_cli("convert", train_pt, "--to", "dcp", "-o", url)
    assert r.exit_code == 2 and "exists" in r.stderr, r.output
    r = run_cli("convert", train_pt, "--to", "dcp", "--dcp-layout", "recipe", "-o", url,
                "--force")
    assert r.exit_code == 0, r.output
    assert _keys(endpoint, bucket) == first
    names = {t["name"] for t in _doc("inspect", url, "--tensors")["tensors"]}
    assert "model.0.weight" in names  # the recipe layout's
    # A prefix holding anything else is never wiped, --force or not.
    c.put_object(Bucket=bucket, Key="out/notes.txt", Body=b"mine")
    r = run_cli("convert", train_pt, "--to", "dcp", "-o", url, "--force")
    assert r.exit_code == 2 and "notes.txt" in r.stderr, r.output
    assert _keys(endpoint, bucket) == sorted([*first, "out/notes.txt"])
    # An object where the prefix goes.
    r = run_cli("convert", train_pt, "--to", "dcp", "-o", f"{url}/.metadata", "--force")
    assert r.exit_code == 2 and "is an object" in r.stderr, r.output
