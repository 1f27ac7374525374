"""convert --to fp8 to object storage and in parts, and validate refusing illegal scales:
the remaining "Done when" items of issue 25 for the output side."""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from tests.conftest import run_cli
from tests.helpers import s3
from tests.helpers.makers import tiny_llama

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.requires_torch,
              # botocore and moto call datetime.utcnow() and friends; not ckpt's code.
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama saved by transformers in FP32 (256-wide attention, 512-wide MLP: every
    Linear weight holds whole 128x128 blocks)."""
    return tiny_llama(tmp_path_factory.mktemp("llama") / "src", 512)


@pytest.fixture(scope="module")
def endpoint() -> Iterator[tuple[str, s3.Proxy]]:
    with s3.moto_endpoint() as pair:
        yield pair


def _same_tree(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert filecmp.cmp(a / name, b / name, shallow=False), name


@pytest.mark.parametrize("layout", ["block", "channel"])
def test_fp8_to_s3_is_byte_identical_to_a_local_convert(
        s3env: s3.Proxy, endpoint: tuple[str, s3.Proxy], llama: Path, tmp_path: Path,
        layout: str) -> None:
    moto = endpoint[0]
    bucket = f"fp8-{uuid.uuid4().hex[:10]}"
    s3.client(moto).create_bucket(Bucket=bucket)
    url = f"s3://{bucket}/model-fp8"
    args = ("--to", "fp8", "--fp8-layout", layout, "--max-shard-size", "1MB")
    r = run_cli("convert", llama, "-o", url, *args)
    assert r.exit_code == 0, r.output
    local = tmp_path / "local"
    assert run_cli("convert", llama, "-o", local, *args).exit_code == 0
    c = s3.client(moto)
    keys = sorted(o["Key"] for o in c.list_objects_v2(Bucket=bucket)["Contents"])
    assert keys == sorted(f"model-fp8/{p.name}" for p in local.iterdir())
    assert len([k for k in keys if k.endswith(".safetensors")]) > 1  # sharded
    for key in keys:
        body = c.get_object(Bucket=bucket, Key=key)["Body"].read()
        assert body == (local / key.rpartition("/")[2]).read_bytes(), key
    # read back from the bucket: the scheme, and the scales valid
    r = run_cli("inspect", url, "--json")
    assert r.exit_code == 0, r.output
    q = json.loads(r.stdout)["quantization"]
    assert q["layout"] == layout and q["quantized"] == 14
    assert q["config"]["source"] == "config.json"
    r = run_cli("validate", url, "--json")
    assert r.exit_code == 0, r.output
    checks = {c["id"]: c for c in json.loads(r.stdout)["checkpoints"][0]["checks"]}
    assert checks["quantization"]["status"] == "pass"


def test_fp8_in_parts_over_processes_equals_one_process(llama: Path, tmp_path: Path) -> None:
    """Three processes, started together, each writing its share (``--part K/3``); the last
    to finish writes the index: the same files, byte for byte, as one process."""
    args = ["--to", "fp8", "--max-shard-size", "400KB", "-q"]
    one = tmp_path / "one"
    assert run_cli("convert", llama, "-o", one, *args).exit_code == 0
    assert len(list(one.glob("*.safetensors"))) >= 3
    split = tmp_path / "split"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_COLOR": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "ckpt_cli", "convert", str(llama), "-o",
                               str(split), *args, "--part", f"{k}/3", "--json"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for k in (1, 2, 3)]
    parts = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()
        parts.append(json.loads(out)["part"])
    assert [x["index"] for x in parts] == [1, 2, 3]
    assert sum(x["finalized_here"] for x in parts) == 1
    assert all(x["files"] for x in parts)  # each process wrote a share of the shards
    _same_tree(one, split)
    cfg = json.loads((split / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "fp8"


@pytest.mark.parametrize("bad", ["zero", "negative", "inf", "nan"])
def test_validate_refuses_illegal_scale_values(llama: Path, tmp_path: Path, bad: str) -> None:
    out = tmp_path / "fp8"
    assert run_cli("convert", llama, "--to", "fp8", "-o", out, "-q").exit_code == 0
    tensors = load_file(out / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight_scale_inv"
    scale = tensors[name].clone()
    scale[0, 1] = {"zero": 0.0, "negative": -scale[0, 1].item(), "inf": float("inf"),
                   "nan": float("nan")}[bad]
    tensors[name] = scale
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    r = run_cli("validate", out, "--json")
    assert r.exit_code == 1, r.output
    doc = json.loads(r.stdout)["checkpoints"][0]
    found = [(f["code"], f["location"]) for f in doc["findings"] if f["check"] == "quantization"]
    assert found == [("fp8-scale-values", name)]
    checks = {c["id"]: c["status"] for c in doc["checks"]}
    assert checks["quantization"] == "fail"
    human = run_cli("validate", out)
    assert human.exit_code == 1 and "Traceback" not in human.output
    assert "non-finite, zero or negative" in " ".join(human.output.split())
