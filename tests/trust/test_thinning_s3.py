"""``prune --thin-after`` on object storage, through a real moto S3 server: torch single-file
checkpoints and HF Trainer ``checkpoint-N`` prefixes thinned, each object replaced whole (DCP
prefixes and HF ``--thin-to bf16``: test_thinning_s3_dcp.py)."""

from __future__ import annotations

import io
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ckpt_cli.trust import ledger
from tests.conftest import run_cli, third_party_quiet
from tests.helpers import s3
from tests.helpers.loads import holds_optimizer_state
from tests.trust.conftest import _training_run

pytestmark = [pytest.mark.requires_torch, pytest.mark.filterwarnings(
    "ignore::DeprecationWarning")]


@pytest.fixture
def bucket(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, str]]:
    """A fresh bucket on a moto server; yields (moto URL, bucket)."""
    with s3.moto_endpoint() as (moto, proxy), s3.client_env(proxy, monkeypatch):
        name = s3.new_bucket(moto)
        yield moto, name


def _get(moto: str, bucket: str, key: str) -> bytes:
    body: bytes = s3.client(moto).get_object(Bucket=bucket, Key=key)["Body"].read()
    return body


def test_thin_torch_files_on_object_storage(bucket: tuple[str, str], tmp_path: Path) -> None:
    moto, name = bucket
    local = tmp_path / "run"
    _training_run(local, (100, 200, 300))
    before = {p.name: torch.load(p, weights_only=True) for p in local.iterdir()}
    s3.upload(moto, local, name, "run")
    url = f"s3://{name}/run"
    r = run_cli("watch", url, "--once", "--settle", "0s")
    assert r.exit_code == 0, r.stdout + r.stderr
    r = run_cli("prune", url, "--thin-after", "1", "--thin-to", "bf16", "--grace", "0",
                "--yes", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)["thinning"]
    assert sorted(doc["thinned"]) == ["step_0100.pt", "step_0200.pt"] and not doc["skipped"]
    t = doc["thinned"]["step_0100.pt"]
    assert t["dropped"] == ["optimizer"] and t["dtype"] == "bf16"
    assert t["bytes_after"] < t["bytes_before"] / 3
    print(f"S3 torch file to bf16: {t['bytes_before']:,} -> {t['bytes_after']:,} bytes; "
          f"{doc['bytes_saved']:,} saved over 2")
    for n in ("step_0100.pt", "step_0200.pt"):
        thin = torch.load(io.BytesIO(_get(moto, name, f"run/{n}")), weights_only=True)
        assert not holds_optimizer_state(thin) and thin["step"] == before[n]["step"]
        for k, v in before[n]["model"].items():
            assert torch.equal(thin["model"][k], v.to(torch.bfloat16))
    whole = torch.load(io.BytesIO(_get(moto, name, "run/step_0300.pt")), weights_only=True)
    assert holds_optimizer_state(whole)
    keys = {o["Key"] for o in s3.client(moto).list_objects_v2(Bucket=name)["Contents"]}
    assert not [k for k in keys if "ckpt-tmp" in k]
    book = ledger.read_ledger(url)
    assert book is not None
    line = book.latest()["step_0100.pt"]
    assert line.event == "thinned" and "pending" not in line.detail
    assert line.manifest_digest == ledger.manifest_digest(f"{url}/step_0100.pt")
    assert run_cli("validate", f"{url}/step_0100.pt").exit_code == 0
    r = run_cli("watch", url, "--once", "--settle", "0s")
    assert r.exit_code == 0 and "bad" not in r.stderr, r.stderr
    r = run_cli("resume-path", url)
    assert r.exit_code == 0 and r.stdout.strip().endswith("run/step_0300.pt")


def test_thin_hf_checkpoint_prefixes_on_object_storage(bucket: tuple[str, str],
                                                       hf_trainer_dir: Path,
                                                       tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    moto, name = bucket
    local = tmp_path / "out"
    shutil.copytree(hf_trainer_dir, local, symlinks=True)
    s3.upload(moto, local, name, "out")
    url = f"s3://{name}/out"
    oldest = min((p for p in local.glob("checkpoint-*")), key=lambda p: int(p.name[11:]))
    assert run_cli("watch", url, "--once", "--settle", "0s").exit_code == 0
    r = run_cli("prune", url, "--thin-after", "1", "--grace", "0", "--yes", "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)["thinning"]
    t = doc["thinned"][oldest.name]
    assert t["dropped"] == ["optimizer.pt"] and doc["bytes_saved"] > 0
    print(f"S3 HF checkpoint: {t['bytes_before']:,} -> {t['bytes_after']:,} bytes")
    keys = {o["Key"] for o in s3.client(moto).list_objects_v2(Bucket=name)["Contents"]}
    opt = torch.load(io.BytesIO(_get(moto, name, f"out/{oldest.name}/optimizer.pt")),
                     weights_only=True)
    assert opt["state"] == {} and opt["param_groups"]  # the hyperparameters kept
    assert f"out/{oldest.name}/trainer_state.json" in keys
    newest = max((p for p in local.glob("checkpoint-*")), key=lambda p: int(p.name[11:]))
    assert f"out/{newest.name}/optimizer.pt" in keys
    got = tmp_path / "got"
    got.mkdir()
    for k in keys:
        if k.startswith(f"out/{oldest.name}/"):
            (got / k.rsplit("/", 1)[1]).write_bytes(_get(moto, name, k))
    with third_party_quiet():
        orig = AutoModelForCausalLM.from_pretrained(oldest).state_dict()
        thin = AutoModelForCausalLM.from_pretrained(got).state_dict()
    assert all(torch.equal(thin[k], v) for k, v in orig.items())
    assert run_cli("validate", f"{url}/{oldest.name}").exit_code == 0
    r = run_cli("watch", url, "--once", "--settle", "0s")
    assert r.exit_code == 0 and "bad" not in r.stderr, r.stderr
