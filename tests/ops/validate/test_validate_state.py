"""``ckpt validate`` beyond structure: the training state (--require), values, the manifest,
leftovers and run directories.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt_cli.errors import CkptError, UsageError
from ckpt_cli.formats import read_index
from ckpt_cli.ops.validate import parse_require, validate
from tests.conftest import requires_deepspeed, run_cli, third_party_quiet
from tests.helpers import damage
from tests.helpers.makers import (
    megatron_legacy,
    tiny_state_dict,
)
from tests.ops.validate.conftest import assert_clean, check_of, found, report

pytestmark = pytest.mark.requires_torch


# -- training state ----------------------------------------------------------------------------


def test_step_without_optimizer_is_flagged(tmp_path: Path) -> None:
    p = tmp_path / "weights.pt"
    torch.save({"model": tiny_state_dict(), "step": 70}, p)
    r = report(p)
    assert r.valid and found(r, "no-optimizer", "warning")
    strict = report(p, require="optimizer,step")
    assert not strict.valid and found(strict, "missing-optimizer")
    assert check_of(strict, "missing-optimizer") == "resumable"


def test_require_step(st_file: Path, pt_file: Path) -> None:
    assert found(report(st_file, require=["step"]), "missing-step")
    assert report(pt_file, require="optimizer,step").valid
    r = report(st_file)
    assert r.check("resumable").summary == "no training step recorded (weights only)"  # type: ignore[union-attr]


def test_parse_require() -> None:
    assert parse_require(" step , optimizer,step") == ("optimizer", "step")
    assert parse_require(None) == ()
    with pytest.raises(UsageError, match="unknown requirement 'rng'"):
        parse_require("rng")


def test_lightning_weights_only_checkpoint(tmp_path: Path) -> None:
    import lightning as L

    class Mod(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 2)

        def training_step(self, batch: Any, _i: int) -> torch.Tensor:
            return self.net(batch[0]).pow(2).mean()  # type: ignore[no-any-return]

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters())

    with third_party_quiet():
        trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False,
                            enable_progress_bar=False, enable_model_summary=False,
                            enable_checkpointing=False)
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)),
                                           batch_size=4)
        trainer.fit(Mod(), data)
        trainer.save_checkpoint(tmp_path / "w.ckpt", weights_only=True)
        trainer.save_checkpoint(tmp_path / "full.ckpt")
    assert found(report(tmp_path / "w.ckpt"), "no-optimizer", "warning")
    assert report(tmp_path / "full.ckpt", require="optimizer,step").valid


def test_hf_trainer_checkpoint(hf_trainer_dir: Path, tmp_path: Path) -> None:
    r = report(hf_trainer_dir / "checkpoint-4", require="optimizer,step")
    assert r.valid and r.step == 4
    d = tmp_path / "checkpoint-4"
    shutil.copytree(hf_trainer_dir / "checkpoint-4", d)
    (d / "trainer_state.json").unlink()  # HF writes it last: the save did not finish
    r = report(d)
    assert found(r, "incomplete") and check_of(r, "incomplete") == "complete"


# -- values ------------------------------------------------------------------------------------


def test_values(tmp_path: Path) -> None:
    w = torch.randn(8, 8)
    w[1, 2] = float("nan")
    opt = torch.randn(8)
    opt[3] = float("inf")
    var = torch.ones(4)
    var[0] = float("inf")
    sd = {"model": {"w": w, "zero": torch.zeros(4), "ok": torch.ones(3), "ids": torch.arange(4),
                    "causal_mask": torch.full((2, 2), float("-inf")), "bn.running_var": var,
                    "half": torch.tensor([1.0, float("nan")], dtype=torch.bfloat16)},
          "optimizer": {"state": {0: {"exp_avg": opt}}, "param_groups": []}, "step": 3}
    p = tmp_path / "v.pt"
    torch.save(sd, p)
    assert report(p).check("values").status == "skip"  # type: ignore[union-attr]
    r = report(p, values=True)
    by = {(f.code, f.location): f.severity for f in r.findings
          if f.code in ("nan", "inf", "all-zero")}
    assert by == {("nan", "model.w"): "error",
                  ("nan", "model.half"): "error",  # bf16, decoded without torch
                  ("inf", "optimizer.state.0.exp_avg"): "error",
                  ("all-zero", "model.zero"): "warning",
                  ("inf", "model.bn.running_var"): "warning",  # +inf in a buffer
                  ("inf", "model.causal_mask"): "info"}  # -inf in a mask buffer: on purpose
    nan = next(f for f in r.findings if f.code == "nan" and f.location == "model.w")
    assert nan.message == "1 of 64 values are NaN" and nan.file == "v.pt"
    assert check_of(r, "nan") == "values" and not r.valid


def test_values_of_a_dcp_checkpoint(sample_run: Path) -> None:
    r = report(sample_run / "step_000400", values=True)
    assert r.valid
    notes = [f for f in r.findings if f.code == "inf"]
    assert [(f.severity, f.location) for f in notes] == [("info", "model.causal_mask")]
    assert "114 floating tensor(s)" in r.check("values").summary  # type: ignore[union-attr]


# -- manifest, leftovers, run directories -------------------------------------------------------


def test_manifest_round_trip_and_bit_rot(shards: Path) -> None:
    r = report(shards, write_manifest=True)
    assert r.valid and r.manifest is not None and r.manifest.action == "written"
    assert (shards / "ckpt-manifest.json").is_file()
    assert r.manifest.files == 3 and r.manifest.bytes > 0  # the index and two shards
    again = report(shards)
    assert again.manifest is not None and again.manifest.action == "verified"
    assert again.check("manifest").status == "pass"  # type: ignore[union-attr]
    shard = next(shards.glob("model-00001-*.safetensors"))
    damage.flip(shard, shard.stat().st_size - 3)  # in tensor data: nothing else can see it
    r = report(shards)
    assert [f.file for f in found(r, "manifest-changed")] == [shard.name]
    assert check_of(r, "manifest-changed") == "manifest"
    assert r.manifest is not None and r.manifest.changed == [shard.name]


def test_manifest_names_missing_resized_and_extra_files(shards: Path) -> None:
    report(shards, write_manifest=True)
    files = sorted(shards.glob("model-*.safetensors"))
    files[0].unlink()
    damage.truncate(files[1], -8)
    (shards / "notes.txt").write_text("added later")
    r = report(shards)
    assert [f.file for f in found(r, "manifest-missing")] == [files[0].name]
    assert [f.file for f in found(r, "manifest-size")] == [files[1].name]
    assert [f.file for f in found(r, "manifest-extra", "warning")] == ["notes.txt"]


def test_manifest_not_written_for_invalid_checkpoint(pt_file: Path) -> None:
    damage.append(pt_file, b"x" * 8)
    r = report(pt_file, write_manifest=True)
    assert found(r, "manifest-not-written")
    assert not (pt_file.parent / "train.pt.ckpt-manifest.json").exists()


def test_manifest_of_a_single_file_with_other_checksums(pt_file: Path) -> None:
    for algo in ("sha256", "blake3"):
        r = report(pt_file, write_manifest=True, manifest_hash=algo)
        assert r.manifest is not None and r.manifest.algorithm == algo
        assert r.manifest.action == "written"
    mf = pt_file.parent / "train.pt.ckpt-manifest.json"
    assert '"algorithm": "blake3"' in mf.read_text()
    damage.flip(pt_file, 100)
    assert found(report(pt_file), "manifest-changed")


def test_unreadable_manifest(pt_file: Path) -> None:
    (pt_file.parent / "train.pt.ckpt-manifest.json").write_text('{"ckpt_manifest": 1}')
    r = report(pt_file)
    assert found(r, "bad-manifest") and r.manifest is not None
    assert r.manifest.action == "unreadable"


def test_manifest_verified_even_when_unreadable(pt_file: Path) -> None:
    report(pt_file, write_manifest=True)
    damage.truncate(pt_file, 1000)
    r = report(pt_file)
    assert found(r, "unreadable") and found(r, "manifest-size")


def test_leftovers(sample_copy: Path) -> None:
    (sample_copy / ".step_000500.ckpt-tmp-0123abcd").mkdir()
    (sample_copy / "step_000400" / ".x.ckpt-tmp-99").write_bytes(b"")
    result = validate(sample_copy)
    left = [f for f in result.run_checks[1].findings if f.code == "leftover"]
    assert [f.file for f in left] == [".step_000500.ckpt-tmp-0123abcd"]
    assert left[0].severity == "warning"
    r = next(c for c in result.checkpoints if c.name == "step_000400")
    assert [f.file for f in found(r, "leftover", "warning")] == [".x.ckpt-tmp-99"]
    assert result.valid and result.exit_code() == 0 and result.exit_code(strict=True) == 1


def test_run_directory_one_report_each(sample_copy: Path) -> None:
    damage.truncate(sample_copy / "step_000200" / "checkpoint.pt", 5000)
    result = validate(sample_copy)
    assert [r.name for r in result.checkpoints] == ["step_000100", "step_000200",
                                                    "step_000300", "step_000400"]
    assert [r.valid for r in result.checkpoints] == [True, False, True, True]
    assert not result.valid and result.exit_code() == 1
    latest = validate(sample_copy, latest=True)
    assert [r.name for r in latest.checkpoints] == ["step_000400"] and latest.valid


def test_latest_needs_a_run_directory(pt_file: Path) -> None:
    with pytest.raises(UsageError, match=": latest needs a run directory") as e:
        validate(pt_file, latest=True)
    assert e.value.param == "latest"


def test_unrecognisable_input_is_an_error_not_a_finding(tmp_path: Path) -> None:
    p = tmp_path / "notes.txt"
    p.write_text("hello")
    with pytest.raises(CkptError, match="unrecognised file"):
        validate(p)
    with pytest.raises(CkptError, match="no such file"):
        validate(tmp_path / "missing.pt")


def test_dcp_items_overlap(sample_copy: Path) -> None:
    d = sample_copy / "step_000400"

    def overlap(md: Any) -> None:  # point the chunk at row 384 into the bytes of row 0's
        rows = {k.offset[0]: md.storage_data[k] for k in md.storage_data
                if k.fqn == "model.wte.weight"}
        rows[384].relative_path, rows[384].offset = rows[0].relative_path, rows[0].offset + 10

    damage.edit_dcp_metadata(d, overlap)
    r = report(d)
    assert found(r, "item-overlap") and check_of(r, "item-overlap") == "dcp-storage"
    # ... and the bytes there are no zip of their own.
    assert any(f.location and f.location.startswith("model.wte.weight@[384, 0]")
               for f in r.findings if f.severity == "error" and f.code.startswith("zip-"))


def test_dcp_object_item_past_the_end(sample_copy: Path) -> None:
    d = sample_copy / "step_000400"

    def stretch(md: Any) -> None:
        k = next(k for k in md.storage_data if k.fqn == "step")
        md.storage_data[k].length = 10**9

    damage.edit_dcp_metadata(d, stretch)
    r = report(d)
    bad = found(r, "item-out-of-bounds")
    assert [f.location for f in bad] == ["step"] and check_of(r, "item-out-of-bounds") == (
        "dcp-storage")


def test_progress_is_reported(pt_file: Path) -> None:
    calls: list[tuple[str, int, int]] = []
    validate(pt_file, values=True, write_manifest=True,
             progress=lambda label, done, total: calls.append((label, done, total)))
    labels = {c[0] for c in calls}
    assert {"train.pt: CRC-32", "train.pt: values", "train.pt: hashing"} <= labels, labels
    for label in labels:
        mine = [c for c in calls if c[0] == label]
        assert mine[0][1] == 0 and mine[-1][1] == mine[-1][2] > 0, mine
        assert [c[1] for c in mine] == sorted(c[1] for c in mine)


def test_validate_writes_nothing_unless_asked(sample_copy: Path) -> None:
    def snapshot() -> dict[str, tuple[int, int]]:
        return {str(p.relative_to(sample_copy)): (p.stat().st_size, p.stat().st_mtime_ns)
                for p in sample_copy.rglob("*")}

    before = snapshot()
    validate(sample_copy, values=True)
    validate(sample_copy / "step_000400", values=True)
    assert snapshot() == before
    validate(sample_copy, write_manifest=True)
    after = snapshot()
    added = sorted(set(after) - set(before))
    assert added == [f"step_000{n}00/ckpt-manifest.json" for n in range(1, 5)]
    files = {k for k in before if (sample_copy / k).is_file()}  # directories gained a file
    assert {k: after[k] for k in files} == {k: before[k] for k in files}


def test_dcp_object_item_that_does_not_unpickle(sample_copy: Path) -> None:
    from ckpt_cli.formats import dcp

    d = sample_copy / "step_000400"
    fields, _ = dcp.parse_metadata(d / ".metadata")
    rel, off, length, _ = dcp.storage_map(fields["storage_data"], d, d / ".metadata")[
        ("step", None)]
    item = (d / rel).read_bytes()[off:off + length]
    start = item.find(b"\x80\x02", item.find(b"data.pkl"))  # data.pkl's PROTO opcode
    assert start > 0
    damage.flip(d / rel, off + start, 0x01)  # PROTO 0x80 -> 0x81: not a pickle any more
    r = report(d)
    assert [f.location for f in found(r, "bad-item")] == ["step"]
    assert check_of(r, "bad-item") == "dcp-chunks"


@pytest.mark.parametrize("victim", ["optimizer.pt", "model.safetensors", "scheduler.pt"])
def test_empty_file_in_a_checkpoint_directory(hf_trainer_dir: Path, tmp_path: Path,
                                              victim: str) -> None:
    """A file the save created but never wrote (a full disk, a killed job) must not pass."""
    d = tmp_path / "checkpoint-4"
    shutil.copytree(hf_trainer_dir / "checkpoint-4", d)
    (d / victim).write_bytes(b"")
    r = report(d)
    assert not r.valid, r.findings


def test_dcp_nested_in_a_checkpoint_directory(sample_run: Path, tmp_path: Path) -> None:
    """Accelerate's FSDP layout: loose files beside DCP directories (pytorch_model_fsdp_0/).

    (Detection takes a directory holding a DCP directory for a run; --input-format dir reads
    it as one checkpoint.)
    """
    d = tmp_path / "checkpoint_3"
    d.mkdir()
    torch.save({"last_epoch": 3, "_step_count": 4}, d / "scheduler.pt")
    shutil.copytree(sample_run / "step_000400", d / "pytorch_model_fsdp_0")
    assert_clean(report(d, input_format="dir"))
    nested = d / "pytorch_model_fsdp_0"
    damage.edit_dcp_metadata(nested, lambda md: md.state_dict_metadata[
        "model.wpe.weight"].chunks.pop(0))
    chunk = next(iter(sorted(nested.glob("__*.distcp"))))
    damage.flip(chunk, chunk.stat().st_size // 3)
    r = report(d, input_format="dir")
    assert found(r, "chunk-tiling")
    assert any(f.file and f.file.startswith("pytorch_model_fsdp_0/")
               for f in r.findings if f.severity == "error")


def test_run_directory_pointer_that_is_not_an_iteration(tmp_path: Path) -> None:
    megatron_legacy(tmp_path / "meg", tp=1)
    (tmp_path / "meg" / "latest_checkpointed_iteration.txt").write_text("iter_500\n")
    result = validate(tmp_path / "meg")
    (pointer,) = [c for c in result.run_checks if c.id == "latest-pointer"]
    assert [(f.code, f.file) for f in pointer.findings] == [
        ("bad-pointer", "latest_checkpointed_iteration.txt")]
    assert not result.valid


def test_lightning_last_symlink(lightning_dir: Path, tmp_path: Path) -> None:
    d = tmp_path / "pl"
    shutil.copytree(lightning_dir, d, symlinks=True)
    result = validate(d)
    assert result.valid and len(result.checkpoints) == 3
    (d / "last.ckpt").unlink()
    (d / "last.ckpt").symlink_to("epoch=0-step=6.ckpt")
    result = validate(d)
    (pointer,) = [c for c in result.run_checks if c.id == "latest-pointer"]
    assert [(f.code, f.file) for f in pointer.findings] == [("dangling-pointer", "last.ckpt")]


@requires_deepspeed
def test_deepspeed_checkpoints_pass_strict_validation(ds_dir: Path) -> None:
    for name in ("z1-fp32", "z3-bf16"):
        r = run_cli("validate", ds_dir / name, "--latest", "--strict")
        assert r.exit_code == 0, (name, r.output)


def test_checkpoints_nested_in_a_final_model_directory_are_pointed_out(
        hf_trainer_dir: Path, tmp_path: Path) -> None:
    """trainer.save_model() puts the final model beside checkpoint-N/: say they are there."""
    out = tmp_path / "out"
    shutil.copytree(hf_trainer_dir, out)
    for name in ("model.safetensors", "config.json", "trainer_state.json"):
        shutil.copy(out / "checkpoint-4" / name, out / name)
    index = read_index(out)
    nested = [f for f in index.findings if f.code == "nested-checkpoints"]
    assert len(nested) == 1 and "checkpoint-2, checkpoint-4" in nested[0].message
    # validate covers them, each in turn, beside the final model (so no hint to name them).
    r = run_cli("validate", out, "--json")
    doc = json.loads(r.stdout)
    assert [c["name"] for c in doc["checkpoints"]] == ["checkpoint-2", "checkpoint-4", "out"]
    assert "nested-checkpoints" not in r.stdout
    # Each checkpoint itself has none.
    assert not [f for f in read_index(out / "checkpoint-4").findings
                if f.code == "nested-checkpoints"]
