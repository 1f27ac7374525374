"""``prune --thin-after`` on DCP step prefixes and HF ``--thin-to bf16`` on object storage,
through a real moto S3 server.

Object stores have no rename: the thinned checkpoint's data objects are uploaded under new
(tagged) names beside the originals, then the object that names them (DCP ``.metadata``, an HF
index) is replaced with one PUT, then the originals are deleted. Every test downloads what is
left and loads it with the framework's own loader."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt_cli.trust import ledger
from tests.conftest import run_cli, third_party_quiet
from tests.helpers import s3
from tests.trust.conftest import _dcp_load, _dcp_run, _hf_sharded_run
from tests.trust.test_thinning_s3 import bucket

pytestmark = [pytest.mark.requires_torch, pytest.mark.filterwarnings(
    "ignore::DeprecationWarning")]

__all__ = ["bucket"]  # the fixture, shared with test_thinning_s3


def _keys(moto: str, name: str, prefix: str) -> list[str]:
    out = s3.client(moto).list_objects_v2(Bucket=name, Prefix=prefix + "/").get("Contents", [])
    return sorted(o["Key"][len(prefix) + 1:] for o in out)


def _download(moto: str, name: str, prefix: str, dest: Path) -> Path:
    c = s3.client(moto)
    dest.mkdir(parents=True)
    for k in _keys(moto, name, prefix):
        (dest / k).parent.mkdir(parents=True, exist_ok=True)
        (dest / k).write_bytes(c.get_object(Bucket=name, Key=f"{prefix}/{k}")["Body"].read())
    return dest


def _thinned_optimizer(moto: str, name: str, prefix: str) -> bool:
    """Whether the HF prefix's ``optimizer.pt`` holds its hyperparameters and no state."""
    import io

    body = s3.client(moto).get_object(Bucket=name, Key=f"{prefix}/optimizer.pt")["Body"]
    opt = torch.load(io.BytesIO(body.read()), weights_only=True)
    return opt["state"] == {} and bool(opt["param_groups"])


def _object_bytes(moto: str, name: str, prefix: str) -> int:
    out = s3.client(moto).list_objects_v2(Bucket=name, Prefix=prefix + "/").get("Contents", [])
    return sum(int(o["Size"]) for o in out)


@pytest.mark.parametrize("to", [None, "bf16"])
def test_thin_a_4_rank_dcp_prefix_on_object_storage(bucket: tuple[str, str], sample_run: Path,
                                                    tmp_path: Path, to: str | None) -> None:
    """The sample run's DCP checkpoint, saved by 4 processes (FSDP2-sharded model and AdamW
    state), thinned on S3: it loads with ``dcp.load`` into a fresh model with the original's
    weights (BF16: the original's cast), validates, and the ledger says what was dropped."""
    import torch.distributed.checkpoint as dcp

    from ckpt_cli.ops.sample import TinyGPT

    moto, name = bucket
    src = sample_run / "step_000400"
    assert len(list(src.glob("__*_*.distcp"))) >= 4  # one file per rank at least
    for step in (400, 500):  # the same checkpoint twice: step 500 is the newest, kept whole
        s3.upload(moto, src, name, f"run/step_000{step}")
    url = f"s3://{name}/run"
    fresh = TinyGPT().state_dict()
    whole = {"model": {k: torch.zeros_like(v) for k, v in fresh.items()}}
    with third_party_quiet():
        dcp.load(whole, checkpoint_id=str(src), no_dist=True)
    old_files = [k for k in _keys(moto, name, "run/step_000400") if k.endswith(".distcp")]
    r = run_cli("watch", url, "--once", "--settle", "0s")
    assert r.exit_code == 0, r.stdout + r.stderr
    extra = ["--thin-to", to] if to else []
    r = run_cli("prune", url, "--thin-after", "1", *extra, "--grace", "0", "--yes", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)["thinning"]
    assert list(doc["thinned"]) == ["step_000400"], doc
    t = doc["thinned"]["step_000400"]
    assert t["dropped"] == ["optim"] and t["dtype"] == to
    assert t["bytes_after"] < t["bytes_before"] * (0.45 if to is None else 0.3)
    assert t["bytes_after"] == _object_bytes(moto, name, "run/step_000400")
    print(f"S3 4-rank DCP ({to or 'same dtype'}): {t['bytes_before']:,} -> "
          f"{t['bytes_after']:,} bytes")
    keys = _keys(moto, name, "run/step_000400")
    assert not set(old_files) & set(keys)  # the originals are gone
    data = [k for k in keys if k.endswith(".distcp")]
    assert data and all(k.startswith("__thin") for k in data), keys
    assert ".metadata" in keys and "ckpt-manifest.json" in keys
    got_dir = _download(moto, name, "run/step_000400", tmp_path / "got")
    dtype = torch.bfloat16 if to else torch.float32
    got = {"model": {k: torch.zeros_like(v, dtype=dtype) for k, v in fresh.items()},
           "step": -1}
    with third_party_quiet():
        dcp.load(got, checkpoint_id=str(got_dir), no_dist=True)
    assert got["step"] == 400
    for k, v in whole["model"].items():
        assert torch.equal(got["model"][k], v.to(dtype)), k
    from ckpt_cli.formats import read_index

    assert not any(n.startswith("optim.state.") for n in read_index(got_dir).tensors)
    # The newest stays whole, byte for byte.
    assert _keys(moto, name, "run/step_000500") == sorted(
        [p.name for p in src.iterdir()] + ["ckpt-manifest.json"])
    book = ledger.read_ledger(url)
    assert book is not None
    line = book.latest()["step_000400"]
    assert line.event == "thinned" and "pending" not in line.detail
    assert line.detail["dropped"] == ["optim"] and line.detail["dtype"] == to
    assert line.detail["bytes_before"] == t["bytes_before"] and line.bytes == t["bytes_after"]
    assert line.manifest_digest == ledger.manifest_digest(f"{url}/step_000400")
    r = run_cli("validate", f"{url}/step_000400")
    assert r.exit_code == 0, r.stdout + r.stderr
    r = run_cli("watch", url, "--once", "--settle", "0s")
    assert r.exit_code == 0 and "bad" not in r.stderr, r.stderr
    r = run_cli("resume-path", url)
    assert r.exit_code == 0 and r.stdout.strip().endswith("run/step_000500")


class _Killed(Exception):
    """Stands for the prune process dying at that point."""


def _upload_and_kill_a_prune(bucket: tuple[str, str], local: Path, prefix: str,
                             checkpoint: str, where: str, policy: Any) -> tuple[str, list[str]]:
    """Upload ``local`` as ``s3://BUCKET/PREFIX`` and watch it once (nothing bad), then run
    ``prune(url, policy)`` killed at ``where`` (``uploaded``: before the object that names the
    data is replaced; ``committed``: before the originals are deleted). Returns the URL and
    the keys under ``checkpoint`` before the prune."""
    from ckpt_cli.ops.prune import prune
    from ckpt_cli.trust.thinning import objects as thinning

    moto, name = bucket
    s3.upload(moto, local, name, prefix)
    url = f"s3://{name}/{prefix}"
    original = _keys(moto, name, f"{prefix}/{checkpoint}")
    assert run_cli("watch", url, "--once", "--settle", "0s").exit_code == 0

    def die(*_a: object) -> None:
        raise _Killed

    with pytest.MonkeyPatch.context() as mp, pytest.raises(_Killed):
        mp.setattr(thinning, "_put_commit" if where == "uploaded" else "_delete_old", die)
        prune(url, policy)
    return url, original


def _nothing_reported_bad(url: str, checkpoint: str, tmp_path: Path) -> None:
    """``checkpoint`` validates, and a watch pass reports nothing bad (its ``--on-bad``
    command never runs)."""
    r = run_cli("validate", f"{url}/{checkpoint}")
    assert r.exit_code == 0, r.stdout + r.stderr
    marker = tmp_path / "on-bad-ran"
    r = run_cli("watch", url, "--once", "--settle", "0s", "--on-bad", f"touch {marker}")
    assert r.exit_code == 0 and "bad" not in r.stderr, r.stderr
    assert not marker.exists()


@pytest.mark.parametrize("where", ["uploaded", "committed"])
def test_a_dcp_prefix_thinning_killed_midway_loads_and_the_next_prune_finishes(
        bucket: tuple[str, str], tmp_path: Path, where: str) -> None:
    """Killed after the thinned data objects were uploaded but before ``.metadata`` was
    replaced (``uploaded``: the original loads, the new objects are unnamed leftovers), or
    after it was replaced but before the originals were deleted (``committed``: the thinned
    one loads). Either way nothing is reported bad, and the next prune removes what is not
    named and records the thinning as done."""
    from ckpt_cli.ops.prune.retention import PrunePolicy

    moto, name = bucket
    local = tmp_path / "run"
    saved = _dcp_run(local, (100, 200))
    url, original = _upload_and_kill_a_prune(bucket, local, "run", "step_000100", where,
                                             PrunePolicy(thin_after=1, grace=0))
    keys = _keys(moto, name, "run/step_000100")
    tagged = [k for k in keys if k.startswith("__thin")]
    assert tagged and "ckpt-manifest.json" not in keys
    assert set(original) - {"ckpt-manifest.json"} <= set(keys)  # nothing original gone yet
    book = ledger.read_ledger(url)
    assert book is not None and book.latest()["step_000100"].detail.get("pending") is True
    got_dir = _download(moto, name, "run/step_000100", tmp_path / "got")
    got = _dcp_load(got_dir)
    assert got["step"] == 100
    assert all(torch.equal(got["model"][k], v) for k, v in saved[100].items())
    if where == "uploaded":  # still the original: its optimizer state loads too
        from ckpt_cli.formats import read_index

        assert any(n.startswith("optim.state.") for n in read_index(got_dir).tensors)
    _nothing_reported_bad(url, "step_000100", tmp_path)
    r = run_cli("prune", url, "--thin-after", "1", "--grace", "0", "--yes", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    keys = _keys(moto, name, "run/step_000100")
    data = [k for k in keys if k.endswith(".distcp")]
    assert data and all(k.startswith("__thin") for k in data), keys
    if where == "uploaded":  # thinned afresh: the killed one's uploads are gone
        assert not set(tagged) & set(data)
    else:
        assert sorted(data) == sorted(tagged)
    book = ledger.read_ledger(url)
    assert book is not None
    line = book.latest()["step_000100"]
    assert line.event == "thinned" and "pending" not in line.detail
    assert line.detail["dropped"] == ["optim"]
    assert line.manifest_digest == ledger.manifest_digest(f"{url}/step_000100")
    assert line.bytes == _object_bytes(moto, name, "run/step_000100")
    got = _dcp_load(_download(moto, name, "run/step_000100", tmp_path / "got2"))
    assert all(torch.equal(got["model"][k], v) for k, v in saved[100].items())
    r = run_cli("validate", f"{url}/step_000100")
    assert r.exit_code == 0, r.stdout + r.stderr
    r = run_cli("watch", url, "--once", "--settle", "0s")
    assert r.exit_code == 0 and "bad" not in r.stderr, r.stderr


def _hf_load(d: Path, dtype: Any = "auto") -> Any:
    from transformers import AutoModelForCausalLM

    with third_party_quiet():
        return AutoModelForCausalLM.from_pretrained(d, dtype=dtype)


def test_thin_hf_prefixes_to_bf16_on_object_storage(bucket: tuple[str, str],
                                                     hf_trainer_dir: Path,
                                                     tmp_path: Path) -> None:
    """``--thin-to bf16`` on S3: a lone ``model.safetensors`` (a Trainer run) replaced by one
    upload, and sharded weights written under new names with the index replaced last; both
    load with ``from_pretrained`` as the original's weights cast to BF16."""
    import shutil

    moto, name = bucket
    single = tmp_path / "single"
    shutil.copytree(hf_trainer_dir, single, symlinks=True)
    sharded = tmp_path / "sharded"
    model = _hf_sharded_run(sharded)
    for local, prefix in ((single, "single"), (sharded, "sharded")):
        s3.upload(moto, local, name, prefix)
    oldest = min(single.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    want = {"single": _hf_load(oldest).state_dict(), "sharded": model.state_dict()}
    old_shards = {"single": ["model.safetensors"],
                  "sharded": sorted(p.name for p in (sharded / "checkpoint-2").glob(
                      "model-*.safetensors"))}
    for prefix, ck in (("single", oldest.name), ("sharded", "checkpoint-2")):
        url = f"s3://{name}/{prefix}"
        assert run_cli("watch", url, "--once", "--settle", "0s").exit_code == 0
        before = _object_bytes(moto, name, f"{prefix}/{ck}")
        r = run_cli("prune", url, "--thin-after", "1", "--thin-to", "bf16", "--grace", "0",
                    "--yes", "--json")
        assert r.exit_code == 0, r.stdout + r.stderr
        doc = json.loads(r.stdout)["thinning"]
        t = doc["thinned"][ck]
        assert t["dropped"] == ["optimizer.pt"] and t["dtype"] == "bf16"
        assert t["bytes_before"] == before
        assert t["bytes_after"] == _object_bytes(moto, name, f"{prefix}/{ck}")
        assert t["bytes_after"] < t["bytes_before"] / 2
        print(f"S3 HF {prefix} to bf16: {t['bytes_before']:,} -> {t['bytes_after']:,} bytes")
        keys = _keys(moto, name, f"{prefix}/{ck}")
        assert "trainer_state.json" in keys
        assert _thinned_optimizer(moto, name, f"{prefix}/{ck}")
        shards = [k for k in keys if k.startswith("model") and k.endswith(".safetensors")]
        if prefix == "single":
            assert shards == ["model.safetensors"]
        else:
            assert not set(shards) & set(old_shards[prefix]) and len(shards) == len(
                old_shards[prefix]) and all(".thin" in k for k in shards)
        got = _download(moto, name, f"{prefix}/{ck}", tmp_path / f"got-{prefix}")
        cfg = json.loads((got / "config.json").read_text())
        assert all(cfg[k] == "bfloat16" for k in ("torch_dtype", "dtype") if k in cfg)
        thin = _hf_load(got)
        assert thin.dtype == torch.bfloat16
        sd = thin.state_dict()
        for k, v in want[prefix].items():
            assert torch.equal(sd[k], v.to(torch.bfloat16)), (prefix, k)
        book = ledger.read_ledger(url)
        assert book is not None
        line = book.latest()[ck]
        assert line.event == "thinned" and "pending" not in line.detail
        assert line.detail["dtype"] == "bf16"
        assert line.manifest_digest == ledger.manifest_digest(f"{url}/{ck}")
        r = run_cli("validate", f"{url}/{ck}")
        assert r.exit_code == 0, r.stdout + r.stderr
        r = run_cli("watch", url, "--once", "--settle", "0s")
        assert r.exit_code == 0 and "bad" not in r.stderr, r.stderr


@pytest.mark.parametrize("where", ["uploaded", "committed"])
def test_an_hf_bf16_thinning_killed_midway_loads_and_the_next_prune_finishes(
        bucket: tuple[str, str], tmp_path: Path, where: str) -> None:
    """Killed before the index was replaced (the original loads; the cast shards are unnamed
    leftovers) or after (the BF16 one loads; the old shards and the optimizer state are still
    there): nothing is reported bad, and the next prune finishes the work."""
    from ckpt_cli.ops.prune.retention import PrunePolicy

    moto, name = bucket
    local = tmp_path / "out"
    model = _hf_sharded_run(local)
    url, original = _upload_and_kill_a_prune(bucket, local, "out", "checkpoint-2", where,
                                             PrunePolicy(thin_after=1, grace=0, thin_to="bf16"))
    keys = _keys(moto, name, "out/checkpoint-2")
    assert [k for k in keys if ".thin" in k]
    assert set(original) - {"ckpt-manifest.json"} <= set(keys)
    # config.json says bfloat16 from before the index is replaced: loaded in FP32, the weights
    # are the original's until then, their BF16 cast after.
    got = _hf_load(_download(moto, name, "out/checkpoint-2", tmp_path / "got"),
                   torch.float32).state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(got[k], v if where == "uploaded"
                           else v.to(torch.bfloat16).float()), k
    _nothing_reported_bad(url, "checkpoint-2", tmp_path)
    r = run_cli("prune", url, "--thin-after", "1", "--thin-to", "bf16", "--grace", "0",
                "--yes", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    keys = _keys(moto, name, "out/checkpoint-2")
    shards = [k for k in keys if k.startswith("model") and k.endswith(".safetensors")]
    assert _thinned_optimizer(moto, name, "out/checkpoint-2")
    assert shards and all(".thin" in k for k in shards)
    assert len(shards) == len([k for k in original if k.endswith(".safetensors")])
    thin = _hf_load(_download(moto, name, "out/checkpoint-2", tmp_path / "got2"))
    assert thin.dtype == torch.bfloat16
    for k, v in model.state_dict().items():
        assert torch.equal(thin.state_dict()[k], v.to(torch.bfloat16)), k
    book = ledger.read_ledger(url)
    assert book is not None
    line = book.latest()["checkpoint-2"]
    assert line.event == "thinned" and "pending" not in line.detail
    assert line.manifest_digest == ledger.manifest_digest(f"{url}/checkpoint-2")
    r = run_cli("validate", f"{url}/checkpoint-2")
    assert r.exit_code == 0, r.stdout + r.stderr
    r = run_cli("watch", url, "--once", "--settle", "0s")
    assert r.exit_code == 0 and "bad" not in r.stderr, r.stderr


def test_a_checkpoint_ordered_by_modification_time_is_not_thinned_on_object_storage(
        bucket: tuple[str, str], tmp_path: Path) -> None:
    """S3 cannot set LastModified: a checkpoint with no step in its name or metadata, placed
    in the run by its modification time, would pass for the newest once rewritten. Left whole,
    with the reason."""
    moto, name = bucket
    local = tmp_path / "run"
    local.mkdir()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    for n in ("first.pt", "second.pt"):
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, local / n)
        s3.upload(moto, local / n, name, f"run/{n}")
    url = f"s3://{name}/run"
    before = {k: o["ETag"] for k, o in ((o["Key"], o) for o in s3.client(moto).list_objects_v2(
        Bucket=name)["Contents"])}
    r = run_cli("prune", url, "--pattern", r"^\w+\.pt$", "--thin-after", "1", "--grace", "0",
                "--yes", "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)["thinning"]
    assert not doc["thinned"] and doc["skipped"], r.stdout
    assert all("modification time" in why for why in doc["skipped"].values()), doc
    after = {o["Key"]: o["ETag"] for o in s3.client(moto).list_objects_v2(
        Bucket=name)["Contents"]}
    assert {k: v for k, v in after.items() if k in before} == before
