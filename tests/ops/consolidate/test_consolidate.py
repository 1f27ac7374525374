"""``ckpt consolidate`` against the real libraries' own consolidation tools."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckpt_cli.errors import CorruptCheckpointError, UsageError
from ckpt_cli.formats import read_index
from ckpt_cli.ops.consolidate import consolidate
from tests.conftest import requires_deepspeed, run_cli, third_party_quiet
from tests.helpers.damage import flip_in_entry
from tests.helpers.loads import safetensors_dir as load_dir
from tests.helpers.makers import hf_sharded, tiny_state_dict

pytestmark = pytest.mark.requires_torch


def flatten(tree: object, prefix: str = "") -> dict[str, object]:
    """Nested dicts -> dotted names, the way DCP flattens a state dict."""
    out: dict[str, object] = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}{k}."))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            out.update(flatten(v, f"{prefix}{i}."))
    else:
        out[prefix[:-1]] = tree
    return out


@pytest.fixture(scope="module")
def dcp_reference(sample_run: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """What torch's own dcp_to_torch_save makes of the sample's 4-rank DCP checkpoint."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path_factory.mktemp("dcpref") / "ref.pt"
    with third_party_quiet():
        dcp_to_torch_save(sample_run / "step_000400", out)
    return flatten(torch.load(out, weights_only=False))


def test_dcp_with_optimizer_equals_dcp_to_torch_save(sample_run: Path, tmp_path: Path,
                                                     dcp_reference: dict[str, object]) -> None:
    out = tmp_path / "full"
    r = consolidate(sample_run / "step_000400", out, with_optimizer=True, verify=True,
                    max_shard_size=400_000)
    got = load_dir(out)
    ref_tensors = {k: v for k, v in dcp_reference.items() if isinstance(v, torch.Tensor)}
    assert set(got) == set(ref_tensors)
    for k, v in ref_tensors.items():
        assert torch.equal(got[k], v), k
    assert r.lost_elements == 0 and r.verified == len(got)
    assert r.files_before == 5 and len(r.write.files) == len(list(out.iterdir()))
    with open(out / "model.safetensors.index.json") as f:
        index = json.load(f)
    assert index["metadata"]["ckpt.step"] == "400"
    objects = json.loads(load_meta(out)["ckpt.objects"])
    assert objects["step"] == dcp_reference["step"]
    assert objects["optim.param_groups.0.lr"] == dcp_reference["optim.param_groups.0.lr"]


def load_meta(out: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(sorted(out.glob("*.safetensors"))[0]), "pt") as f:
        return dict(f.metadata())


def test_dcp_model_only(sample_run: Path, tmp_path: Path,
                        dcp_reference: dict[str, object]) -> None:
    out = tmp_path / "model.safetensors"
    r = run_cli("consolidate", sample_run / "step_000400", "-o", out, "--to", "bf16",
                "--max-shard-size", "0", "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    # One weights file and its integrity manifest beside it.
    assert doc["files_before"] == 5 and doc["files_after"] == 2 and doc["lost_elements"] == 0
    assert [f["path"] for f in doc["files"]] == ["model.safetensors",
                                                 "model.safetensors.ckpt-manifest.json"]
    assert doc["dropped"] == {"optimizer": 84}
    got = load_file(out)
    for k, v in got.items():
        ref = dcp_reference[f"model.{k}"]
        assert isinstance(ref, torch.Tensor) and torch.equal(v, ref.to(torch.bfloat16)), k


@requires_deepspeed
@pytest.mark.parametrize("cfg", ["z1-fp32", "z2-fp32", "z3-fp32", "z2-bf16", "z3-bf16"])
def test_deepspeed_equals_zero_to_fp32(ds_dir: Path, tmp_path: Path, cfg: str) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    src = ds_dir / cfg  # the save dir: consolidate follows its 'latest', as zero_to_fp32 does
    with third_party_quiet(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        ref = get_fp32_state_dict_from_zero_checkpoint(str(src))
    out = tmp_path / "fp32.safetensors"
    r = consolidate(src, out, max_shard_size=None, verify=True)
    got = load_file(out)
    assert set(got) == set(ref)
    for k, v in ref.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v.contiguous()), k
    assert r.details["zero_stage"] == int(cfg[1]) and r.details["world_size"] == 2
    assert got["counter"].dtype == torch.float32  # buffers restored to FP32 like zero_to_fp32


@requires_deepspeed
@pytest.mark.parametrize("cfg", ["z2-fp32", "z3-fp32"])
def test_deepspeed_with_optimizer_moments(ds_dir: Path, tmp_path: Path, cfg: str) -> None:
    tag = ds_dir / cfg / "global_step3"
    out = tmp_path / "full.safetensors"
    consolidate(tag, out, max_shard_size=None, with_optimizer=True)
    got = load_file(out)
    # Oracle: the moments of each rank, concatenated and cut by param_shapes, with torch.
    with third_party_quiet():
        model = torch.load(sorted(tag.glob("*model_states.pt"))[0], weights_only=False)
        optims = [torch.load(p, weights_only=False)["optimizer_state_dict"]
                  for p in sorted(tag.glob("*optim_states.pt"))]
    world = len(optims)
    shapes = {k: v for g in model["param_shapes"] for k, v in g.items()}
    for moment in ("exp_avg", "exp_avg_sq"):
        if cfg.startswith("z3"):
            flats = [torch.cat([o["optimizer_state_dict"]["state"][g][moment]
                                for g in sorted(o["optimizer_state_dict"]["state"])])
                     for o in optims]
            offset = 0
            for name, shape in shapes.items():
                n = math.prod(shape)
                part = math.ceil(n / world)
                want = torch.cat([f[offset:offset + part] for f in flats])[:n].view(shape)
                assert torch.equal(got[f"optimizer.state.{name}.{moment}"], want), name
                offset += part
        else:
            flat = torch.cat([o["base_optimizer_state"]["state"][0][moment] for o in optims])
            offset = 0
            for name, shape in shapes.items():
                n = math.prod(shape)
                assert torch.equal(got[f"optimizer.state.{name}.{moment}"],
                                   flat[offset:offset + n].view(shape)), name
                offset += n


@requires_deepspeed
def test_deepspeed_missing_rank_file(ds_dir: Path, tmp_path: Path) -> None:
    import shutil

    src = tmp_path / "ds"
    shutil.copytree(ds_dir / "z2-fp32", src)
    next((src / "global_step3").glob("zero_pp_rank_1_*optim_states.pt")).unlink()
    r = run_cli("consolidate", src, "-o", tmp_path / "out")
    assert r.exit_code == 2
    assert "partition_count is 2 but found 1 optimizer rank file(s); missing rank(s) [1]" \
        in r.stderr
    assert not (tmp_path / "out").exists()


def test_rank_files_merged_by_key(tmp_path: Path) -> None:
    sd = tiny_state_dict()
    names = list(sd)
    src = tmp_path / "ranks"
    src.mkdir()
    for r in range(3):
        part = {k: sd[k] for k in names[r::3]}
        torch.save({"model": part, "rank": r}, src / f"rank_{r}.pt")
    out = tmp_path / "merged.safetensors"
    res = consolidate(src, out, max_shard_size=None, verify=True)
    got = load_file(out)
    assert set(got) == set(sd) and all(torch.equal(got[k], sd[k]) for k in sd)
    assert res.kind == "rank-files" and res.details["rank_files"] == 3
    torch.save({"model": {names[0]: sd[names[0]]}}, src / "rank_3.pt")
    with pytest.raises(CorruptCheckpointError, match=r"is in both rank_0\.pt and rank_3\.pt"):
        consolidate(src, tmp_path / "again.safetensors")


def test_missing_and_truncated_dcp_files(sample_copy: Path, tmp_path: Path) -> None:
    d = sample_copy / "step_000400"
    (d / "__3_0.distcp").unlink()
    r = run_cli("consolidate", d, "-o", tmp_path / "o1")
    assert r.exit_code == 2 and "__3_0.distcp" in r.stderr and "missing" in r.stderr
    assert not (tmp_path / "o1").exists()
    data = (d / "__2_0.distcp").read_bytes()
    (d / "__3_0.distcp").write_bytes(data)  # restore a file of the right name...
    (d / "__2_0.distcp").write_bytes(data[: len(data) // 3])  # ...and truncate another
    r = run_cli("consolidate", d, "-o", tmp_path / "o2")
    assert r.exit_code == 2 and "__2_0.distcp" in r.stderr
    assert not (tmp_path / "o2").exists() and not list(tmp_path.glob(".o2*"))


def test_nothing_to_consolidate(sample_run: Path, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="nothing to consolidate"):
        consolidate(sample_run / "step_000100", tmp_path / "o")
    r = run_cli("consolidate", sample_run / "step_000400", "-o", sample_run / "step_000400")
    assert r.exit_code == 2 and "inside the input" in r.stderr


def test_output_is_readable_by_ckpt(sample_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "o"
    consolidate(sample_run / "step_000400", out, max_shard_size=200_000)
    index = read_index(out)
    assert index.format == "hf-index" and index.findings == []


def test_consolidate_round_trip_proven_by_ckpt_diff(sample_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "cons"
    assert run_cli("consolidate", sample_run / "step_000400", "-o", out,
                   "--with-optimizer").exit_code == 0
    d = run_cli("diff", sample_run / "step_000400", out, "--all", "--json")
    doc = json.loads(d.stdout)
    assert d.exit_code == 0 and doc["equal"] is True, d.stdout[-2000:]
    assert doc["summary"]["identical"] == len(doc["tensors"]) == 114


def test_manifest_lets_validate_catch_bit_rot(sample_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "cons"
    assert run_cli("consolidate", sample_run / "step_000400", "-o", out,
                   "--max-shard-size", "300KB").exit_code == 0
    assert (out / "ckpt-manifest.json").is_file()
    ok = run_cli("validate", out, "--json")
    assert ok.exit_code == 0, ok.stdout
    checks = {c["id"]: c["status"] for c in json.loads(ok.stdout)["checkpoints"][0]["checks"]}
    assert checks["manifest"] == "pass"
    shard = sorted(out.glob("model-*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[-5] ^= 1  # one flipped bit in tensor data: safetensors has no checksum of its own
    shard.write_bytes(bytes(data))
    bad = run_cli("validate", out)
    assert bad.exit_code == 1 and shard.name in bad.stdout + bad.stderr
    single = tmp_path / "one.safetensors"
    assert run_cli("consolidate", sample_run / "step_000400", "-o", single,
                   "--max-shard-size", "0").exit_code == 0
    assert (tmp_path / "one.safetensors.ckpt-manifest.json").is_file()
    assert run_cli("validate", single).exit_code == 0


def test_fp16_range_is_checked(tmp_path: Path) -> None:
    src = tmp_path / "ranks"
    src.mkdir()
    big = tiny_state_dict()
    big["embed.weight"][0, 0] = 1e6
    names = list(big)
    for r in range(2):
        torch.save({k: big[k] for k in names[r::2]}, src / f"rank_{r}.pt")
    r = run_cli("consolidate", src, "-o", tmp_path / "o", "--to", "fp16")
    assert r.exit_code == 2 and "exceed FP16's range" in r.stderr and "embed.weight" in r.stderr
    assert not (tmp_path / "o").exists()
    r = run_cli("consolidate", src, "-o", tmp_path / "o", "--to", "fp16", "--clamp")
    assert r.exit_code == 0, r.stderr
    assert load_dir(tmp_path / "o")["embed.weight"][0, 0].item() == 65504.0


def test_hostile_rank_file_is_named(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    sd = tiny_state_dict()
    names = list(sd)
    src = tmp_path / "ranks"
    src.mkdir()
    for r in range(2):
        extra = {"payload": _Hostile(marker)} if r == 1 else {}
        torch.save({"model": {k: sd[k] for k in names[r::2]}, **extra}, src / f"rank_{r}.pt")
    res = consolidate(src, tmp_path / "merged.safetensors")
    assert not marker.exists()
    assert [w.code for w in res.warnings] == ["hostile-source"]
    assert str(src / "rank_1.pt") in res.warnings[0].message
    assert "system" in res.warnings[0].message
    r = run_cli("consolidate", src, "-o", tmp_path / "again.safetensors", "--json")
    assert r.exit_code == 0, r.stderr
    assert [w["code"] for w in json.loads(r.stdout)["warnings"]] == ["hostile-source"]
    assert "treat the source as hostile" in r.stderr


class _Hostile:
    """Pickles as ``os.system(<cmd>)``; ckpt must never run it."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


@requires_deepspeed
def test_deepspeed_latest_naming_itself(ds_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "ds"
    shutil.copytree(ds_dir / "z2-fp32", src)
    for bad in (".", "..", "global_step3/../.."):
        (src / "latest").write_text(bad)
        r = run_cli("consolidate", src, "-o", tmp_path / "o")
        assert r.exit_code == 2 and "Traceback" not in r.stderr and "latest" in r.stderr


@requires_deepspeed
def test_zero1_frozen_parameters_are_kept(ds_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "o.safetensors"
    r = consolidate(ds_dir / "z1-fp32+frozen", out, max_shard_size=None)
    got = load_file(out)
    assert {"1.weight", "1.bias"} <= set(got)  # the frozen LayerNorm, from module
    assert any("frozen parameter" in n for n in r.notes)
    r2 = consolidate(ds_dir / "z2-fp32+frozen", tmp_path / "o2.safetensors", max_shard_size=None)
    got2 = load_file(tmp_path / "o2.safetensors")
    assert {"1.weight", "1.bias"} <= set(got2) and not r2.notes[:-1]
    assert torch.equal(got["1.weight"], got2["1.weight"])  # ones: LayerNorm's initial weight


@pytest.mark.parametrize("damage", ["missing", "empty"])
def test_hf_shard_missing_or_empty_is_refused_everywhere(sample_copy: Path, tmp_path: Path,
                                                         damage: str) -> None:
    export = sample_copy / "export"
    shard = sorted(export.glob("model-*.safetensors"))[-1]
    if damage == "missing":
        shard.unlink()
    else:
        shard.write_bytes(b"")
    for argv in (("convert", export, "-o", tmp_path / "c.safetensors"),
                 ("convert", export, "--to", "fp16", "-o", tmp_path / "c"),
                 ("consolidate", export, "-o", tmp_path / "k")):
        r = run_cli(*argv)
        assert r.exit_code == 2, (argv, r.output)
        assert shard.name in r.stderr and "Traceback" not in r.stderr
    assert not [p for p in tmp_path.iterdir() if p.name != "run"]
    healthy = sample_copy / "step_000300"
    for argv in (("diff", export, healthy), ("diff", "--structure-only", export, healthy),
                 ("diff", healthy, export)):
        r = run_cli(*argv)
        assert r.exit_code == 2 and shard.name in r.stderr, (argv, r.output)


def test_consolidate_reshards_an_hf_export_by_its_index(sample_run: Path, tmp_path: Path) -> None:
    export = sample_run / "export"
    r = run_cli("consolidate", export, "--max-shard-size", "0", "-o", tmp_path / "one",
                "--verify", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["kind"] == "hf-index"
    assert [f for f in os.listdir(tmp_path / "one") if f.endswith(".safetensors")] == [
        "model.safetensors"]
    want = {k: v for p in export.glob("*.safetensors") for k, v in load_file(p).items()}
    got = load_file(tmp_path / "one" / "model.safetensors")
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


@requires_deepspeed
def test_consolidate_refuses_damaged_zero_partitions(ds_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "z1"
    shutil.copytree(ds_dir / "z1-fp32", run)
    tag = run / (run / "latest").read_text().strip()
    optim = sorted(tag.glob("*optim_states.pt"))[0]
    with zipfile.ZipFile(optim) as zf:  # damage every record: the FP32 partition is one
        records = [i for i in zf.infolist() if "/data/" in i.filename and i.file_size]
    for rec in records:
        flip_in_entry(optim, rec.filename, rec.file_size // 2)
    r = run_cli("consolidate", run, "-o", tmp_path / "out.safetensors")
    assert r.exit_code == 2 and "CRC-32" in r.stderr and optim.name in r.stderr, r.output
    assert not (tmp_path / "out.safetensors").exists()


@requires_deepspeed
def test_consolidate_names_a_latest_that_points_nowhere(ds_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "z1"
    shutil.copytree(ds_dir / "z1-fp32", run)
    (run / "latest").write_text("global_step99")
    r = run_cli("consolidate", run, "-o", tmp_path / "out")
    assert r.exit_code == 2 and "global_step99" in r.stderr and "latest" in r.stderr, r.output


def test_consolidate_of_a_run_directory_says_so(sample_copy: Path, tmp_path: Path) -> None:
    # With a `latest` pointer the checkpoint it names is merged, and the choice is said.
    r = run_cli("consolidate", sample_copy, "-o", tmp_path / "out")
    assert r.exit_code == 0 and "latest names step_000400" in r.stderr, r.output
    (sample_copy / "latest").unlink()
    r = run_cli("consolidate", sample_copy, "-o", tmp_path / "out2")
    assert r.exit_code == 2 and "a run directory (" in r.stderr, r.output


@requires_deepspeed
def test_consolidate_prefers_zero_shards_to_a_16bit_hf_export(ds_dir: Path,
                                                              tmp_path: Path) -> None:
    # HF Trainer + DeepSpeed saves the ZeRO shards (FP32 master weights) and a 16-bit HF
    # export with an index side by side: the shards are what consolidate must merge.
    from ckpt_cli.ops.consolidate import detect_kind

    run = tmp_path / "checkpoint-2"
    shutil.copytree(ds_dir / "z1-fp32", run)
    hf_sharded(run, {k: v.half() for k, v in tiny_state_dict().items()}, max_shard_size=600)
    assert (run / "model.safetensors.index.json").is_file()
    assert detect_kind(run) == "deepspeed"
    # Without the FP32 partitions (stage 0, or deleted to save space) the export is what
    # there is; likewise when `latest` names a tag that was deleted.
    tag = run / (run / "latest").read_text().strip()
    for p in tag.glob("*optim_states.pt"):
        p.unlink()
    assert detect_kind(run) == "hf-index"
    shutil.rmtree(tag)
    assert detect_kind(run) == "hf-index"
    r = run_cli("consolidate", run, "-o", tmp_path / "o.safetensors")
    assert r.exit_code == 0 and "hf-index" in r.output, r.output
    plain = tmp_path / "export"
    plain.mkdir()
    hf_sharded(plain, tiny_state_dict(), max_shard_size=1200)
    assert detect_kind(plain) == "hf-index"


@requires_deepspeed
def test_deepspeed_split_in_parts_is_byte_identical(ds_dir: Path, tmp_path: Path) -> None:
    """ZeRO-3 consolidated by 3 parts in turn (the last finalizes) = one process's output."""
    from ckpt_cli.parts import Part

    src = ds_dir / "z3-fp32"
    one, split = tmp_path / "one", tmp_path / "split"
    consolidate(src, one, max_shard_size=256, verify=True)
    shards = sorted(p.name for p in one.iterdir() if p.suffix == ".safetensors")
    assert len(shards) >= 3
    results = [consolidate(src, split, max_shard_size=256, verify=True, part=Part(k, 3))
               for k in (2, 3, 1)]
    assert [r.write.part.finalized_here for r in results] == [False, False, True]  # type: ignore[union-attr]
    assert results[-1].verified == results[-1].tensors
    assert sorted(p.name for p in split.iterdir()) == sorted(p.name for p in one.iterdir())
    for name in [*shards, "model.safetensors.index.json"]:
        assert (split / name).read_bytes() == (one / name).read_bytes(), name


def test_human_summary_says_what_was_kept_and_left_out(sample_run: Path, tmp_path: Path) -> None:
    r = run_cli("consolidate", sample_run / "step_000400", "-o", tmp_path / "o")
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "5 files (2.4 MB) -> 2 files (677.8 kB)"  # no "0 elements lost" here
    assert "from a dcp checkpoint (world_size 4, files_per_rank 1, step 400) in " in lines[1]
    assert lines[2] == "Kept: 30 tensors, all 168,704 of their elements"
    assert lines[3] == "Left out: 84 optimizer tensors (--with-optimizer keeps them)"
    # A source without facts to tell (an HF index) prints no empty parentheses.
    r = run_cli("consolidate", sample_run / "export", "-o", tmp_path / "one.safetensors",
                "--max-shard-size", "0")
    assert r.exit_code == 0, r.stderr
    assert "from a hf-index checkpoint in " in r.stdout and "()" not in r.stdout
    assert "Left out" not in r.stdout


def test_a_tensor_parallel_megatron_checkpoint_gets_no_hint_that_loops(tmp_path: Path) -> None:
    # consolidate used to hint "ckpt convert <it>", which then refused TP>1 (issue #24 review).
    from tests.helpers.makers import megatron_legacy

    d = megatron_legacy(tmp_path, tp=2)
    r = run_cli("consolidate", d, "-o", tmp_path / "out")
    assert r.exit_code == 2 and "neither consolidate nor convert" in r.output, r.output
    assert "ckpt convert" not in r.output
