"""``ckpt validate`` on distributed layouts: torch.distributed.checkpoint, DeepSpeed, Megatron."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt_cli.formats import read_index
from ckpt_cli.ops.validate import validate
from ckpt_cli.ops.validate.layoutcheck import directory_pointers
from tests.conftest import requires_deepspeed
from tests.helpers import damage
from tests.helpers.makers import (
    megatron_legacy,
)
from tests.ops.validate.conftest import assert_clean, check_of, found, report

pytestmark = pytest.mark.requires_torch


# -- DCP ---------------------------------------------------------------------------------------


def test_valid_dcp(sample_run: Path) -> None:
    r = report(sample_run / "step_000400")
    assert_clean(r)
    for cid in ("dcp-storage", "dcp-tiling", "dcp-chunks", "zip-structure", "crc32"):
        assert r.check(cid).status == "pass", cid  # type: ignore[union-attr]


def test_dcp_metadata_is_parsed_once(sample_copy: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """validate checks where items lie with the storage map the reader parsed (kept only
    while it runs); a .metadata changed since is parsed again."""
    from ckpt_cli.formats import dcp

    d = sample_copy / "step_000400"
    parsed: list[Path] = []
    real = dcp.parse_metadata

    def spy(path: Path) -> Any:
        parsed.append(path)
        return real(path)

    monkeypatch.setattr(dcp, "parse_metadata", spy)
    r = report(d)
    assert_clean(r)
    assert r.check("dcp-storage").status == "pass"  # type: ignore[union-attr]
    assert parsed == [d / ".metadata"]
    assert dcp._KEPT.get() is None  # nothing kept after it
    with dcp.keep_storage_maps():
        read_index(d)
        st = (d / ".metadata").stat()
        os.utime(d / ".metadata", ns=(st.st_atime_ns, st.st_mtime_ns + 1000))
        again = dcp.storage_of(d, d / ".metadata")
    assert len(parsed) == 3 and again == dcp.storage_of(d, d / ".metadata")


def test_dcp_truncated_file(sample_copy: Path) -> None:
    d = sample_copy / "step_000400"
    damage.truncate(d / "__2_0.distcp", -100)
    r = report(d)
    assert found(r, "chunk-out-of-bounds") or found(r, "item-out-of-bounds")
    assert not r.valid


def test_dcp_missing_file(sample_copy: Path) -> None:
    d = sample_copy / "step_000400"
    (d / "__1_0.distcp").unlink()
    r = report(d)
    assert found(r, "missing-file") and check_of(r, "missing-file") == "dcp-storage"


def test_dcp_no_metadata(sample_copy: Path) -> None:
    d = sample_copy / "step_000400"
    (d / ".metadata").unlink()
    r = report(d)
    assert found(r, "unreadable") and "did not finish" in found(r, "unreadable")[0].message


def test_dcp_bit_flip_in_chunk(sample_copy: Path) -> None:
    d = sample_copy / "step_000400"
    f = d / "__3_0.distcp"
    damage.flip(f, f.stat().st_size // 2, 0x40)
    r = report(d)
    errors = [f for f in r.findings if f.severity == "error"]
    assert errors and {f.file for f in errors} == {"__3_0.distcp"}


def test_dcp_bit_flip_in_chunk_data_is_a_crc_error(sample_copy: Path) -> None:
    from ckpt_cli.formats import read_index

    d = sample_copy / "step_000400"
    t = read_index(d).tensors["model.wte.weight"]
    c = t.chunks[1]
    damage.flip(d / c.file, c.offset + c.length // 2, 0x01)  # in the middle of 32 KB of data
    r = report(d)
    bad = found(r, "crc-mismatch")
    assert len(bad) == 1 and bad[0].file == c.file
    assert bad[0].location is not None and "model.wte.weight@[128, 0]" in bad[0].location


def test_dcp_tiling_gap(sample_copy: Path) -> None:
    d = sample_copy / "step_000400"

    def drop_last_chunk(md: Any) -> None:
        tm = md.state_dict_metadata["model.wte.weight"]
        gone = tm.chunks.pop()
        key = next(k for k in md.storage_data if k.fqn == "model.wte.weight"
                   and tuple(k.offset) == tuple(gone.offsets))
        del md.storage_data[key]

    damage.edit_dcp_metadata(d, drop_last_chunk)
    r = report(d)
    bad = found(r, "chunk-tiling")
    assert len(bad) == 1 and bad[0].location == "model.wte.weight"
    assert "8,192 of 32,768 elements are in no chunk" in bad[0].message
    assert found(r, "item-gap", "warning")  # its bytes are now in no item


def test_dcp_tiling_overlap(sample_copy: Path) -> None:
    import torch.distributed.checkpoint.metadata as m

    d = sample_copy / "step_000400"

    def shift_chunk(md: Any) -> None:
        tm = md.state_dict_metadata["model.wte.weight"]
        old = tm.chunks[1]
        new_off = torch.Size([old.offsets[0] - 1, 0])
        tm.chunks[1] = m.ChunkStorageMetadata(new_off, old.sizes)
        key = next(k for k in md.storage_data if k.fqn == "model.wte.weight"
                   and tuple(k.offset) == tuple(old.offsets))
        md.storage_data[m.MetadataIndex("model.wte.weight", new_off)] = md.storage_data.pop(key)

    damage.edit_dcp_metadata(d, shift_chunk)
    r = report(d)
    msgs = " ".join(f.message for f in found(r, "chunk-tiling"))
    assert "more than one chunk" in msgs and "in no chunk" in msgs


def test_dcp_chunk_holds_the_wrong_tensor(sample_copy: Path) -> None:
    d = sample_copy / "step_000400"

    def swap(md: Any) -> None:
        a = next(k for k in md.storage_data if k.fqn == "model.wte.weight")
        b = next(k for k in md.storage_data if k.fqn == "model.wpe.weight")
        md.storage_data[a], md.storage_data[b] = md.storage_data[b], md.storage_data[a]

    damage.edit_dcp_metadata(d, swap)
    r = report(d)
    bad = found(r, "chunk-undecodable")
    assert {f.location for f in bad} == {"model.wte.weight@[0, 0]", "model.wpe.weight@[0, 0]"}
    assert check_of(r, "chunk-undecodable") == "dcp-chunks"


def test_dcp_path_escape(sample_copy: Path) -> None:
    d = sample_copy / "step_000400"

    def escape(md: Any) -> None:
        k = next(iter(md.storage_data))
        md.storage_data[k].relative_path = "../step_000100/checkpoint.pt"

    damage.edit_dcp_metadata(d, escape)
    r = report(d)
    assert found(r, "unreadable") and "leaves the checkpoint" in found(r, "unreadable")[0].message


def test_dcp_unreferenced_file_and_appended_bytes(sample_copy: Path) -> None:
    d = sample_copy / "step_000400"
    shutil.copy(d / "__0_0.distcp", d / "__7_0.distcp")
    damage.append(d / "__1_0.distcp", b"\x00" * 64)
    r = report(d)
    assert r.valid
    assert [f.file for f in found(r, "unreferenced-file", "warning")] == ["__7_0.distcp"]
    assert [f.file for f in found(r, "item-gap", "warning")] == ["__1_0.distcp"]


# -- DeepSpeed and Megatron --------------------------------------------------------------------


@pytest.fixture
def ds_copy(ds_dir: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "ds"
    shutil.copytree(ds_dir, dest)
    return dest


@requires_deepspeed
@pytest.mark.parametrize("config", ["z1-fp32", "z2-fp32", "z3-fp32", "z2-bf16", "z3-bf16"])
def test_valid_deepspeed(ds_dir: Path, config: str) -> None:
    result = validate(ds_dir / config)
    assert result.kind == "run" and result.valid
    r = result.checkpoints[0]
    assert r.format == "deepspeed" and r.errors == 0
    assert r.check("rank-files").status == "pass"  # type: ignore[union-attr]
    assert "with optimizer state" in r.check("resumable").summary  # type: ignore[union-attr]
    assert result.run_checks[0].summary == "latest -> global_step3"


@requires_deepspeed
def test_deepspeed_missing_rank_file(ds_copy: Path) -> None:
    tag = ds_copy / "z3-fp32" / "global_step3"
    (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    (tag / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    r = report(tag)
    assert sorted(f.file for f in found(r, "missing-rank-file")) == [  # type: ignore[type-var]
        "zero_pp_rank_1_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert check_of(r, "missing-rank-file") == "rank-files"


@requires_deepspeed
def test_deepspeed_world_size_mismatch(ds_copy: Path) -> None:
    tag = ds_copy / "z2-fp32" / "global_step3"
    # The model states say dp_world_size 2 (BININT1 2 after its memo); make it 3.
    p = tag / "mp_rank_00_model_states.pt"
    off, size = damage.zip_payload(p, "data.pkl")
    data = bytearray(p.read_bytes())
    i = data.find(b"dp_world_size", off, off + size) + len(b"dp_world_size")
    j = data.find(b"K\x02", i, i + 8)
    data[j + 1] = 3
    p.write_bytes(bytes(data))
    r = report(tag)
    assert any("partitioned 2 ways but dp_world_size is 3" in f.message
               for f in found(r, "world-size"))
    assert [f.file for f in found(r, "missing-rank-file")] == [
        "zero_pp_rank_2_mp_rank_00_optim_states.pt"]


@requires_deepspeed
def test_deepspeed_mixed_optimizer_files(ds_copy: Path) -> None:
    tag = ds_copy / "z2-fp32" / "global_step3"
    src = ds_copy / "z2-bf16" / "global_step3" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    shutil.copy(src, tag)
    r = report(tag)
    assert found(r, "mixed-optimizer-files")


@requires_deepspeed
def test_deepspeed_latest_points_nowhere(ds_copy: Path) -> None:
    run = ds_copy / "z1-fp32"
    (run / "latest").write_text("global_step9")
    result = validate(run)
    assert not result.valid
    bad = [f for f in result.run_checks[0].findings if f.code == "dangling-pointer"]
    assert bad and bad[0].severity == "error" and "global_step9" in bad[0].message
    # Validating the tag directory alone looks at the pointer beside it too.
    r = report(run / "global_step3")
    assert found(r, "dangling-pointer") and check_of(r, "dangling-pointer") == "latest-pointer"


@requires_deepspeed
def test_deepspeed_truncated_rank_file(ds_copy: Path) -> None:
    tag = ds_copy / "z3-bf16" / "global_step3"
    damage.truncate(tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", 1000)
    r = report(tag)
    assert not r.valid and found(r, "bad-file")


def test_valid_megatron(tmp_path: Path) -> None:
    d = megatron_legacy(tmp_path / "meg", tp=2, pp=2)
    r = report(d)
    assert_clean(r)
    assert r.check("latest-pointer").summary == (  # type: ignore[union-attr]
        "../latest_checkpointed_iteration.txt -> iter_0000500")


def test_megatron_missing_rank(tmp_path: Path) -> None:
    d = megatron_legacy(tmp_path / "meg", tp=2, pp=2)
    shutil.rmtree(d / "mp_rank_01_001")
    r = report(d)
    assert found(r, "missing-rank") and check_of(r, "missing-rank") == "rank-files"


def test_megatron_rank_without_its_file(tmp_path: Path) -> None:
    d = megatron_legacy(tmp_path / "meg", tp=2)
    (d / "mp_rank_01" / "model_optim_rng.pt").unlink()
    r = report(d)
    assert found(r, "missing-file") and check_of(r, "missing-file") == "rank-files"


def test_megatron_distrib_optim_on_some_ranks(tmp_path: Path) -> None:
    d = megatron_legacy(tmp_path / "meg", tp=2)
    torch.save({"param_state": {"0": torch.zeros(4)}}, d / "mp_rank_00" / "distrib_optim.pt")
    r = report(d)
    assert [f.file for f in found(r, "missing-rank-file")] == ["mp_rank_01/distrib_optim.pt"]


def test_megatron_tracker_file(tmp_path: Path) -> None:
    d = megatron_legacy(tmp_path / "meg", tp=1)
    tracker = d.parent / "latest_checkpointed_iteration.txt"
    tracker.write_text("600")
    r = report(d)
    assert "iter_0000600" in found(r, "dangling-pointer")[0].message
    tracker.write_text("soon")
    assert found(report(d), "bad-pointer")


def test_pointer_spellings_agree_with_the_run_listing(sample_copy: Path) -> None:
    """validate and the run listing (prune, inspect) read a pointer with one parser."""
    from ckpt_cli.runs import read_pointers

    latest = sample_copy / "latest"
    for text, ok in (("step_000300", True), ("./step_000300/", True),
                     ("step_000300/model.pt", True), (f"{sample_copy}/step_000300", True),
                     ("../elsewhere/step_000300", False), ("step_999", False)):
        latest.write_text(text)
        pointers, _ = read_pointers(sample_copy)
        findings, named = directory_pointers(sample_copy)
        assert (pointers.get("latest") == "step_000300") is ok, text
        assert (named == ["latest -> step_000300"]) is ok, (text, findings)
        assert [f.code for f in findings] == ([] if ok else ["dangling-pointer"]), text
    latest.write_bytes(b"\0" * 16)  # zero-filled by a crash
    findings, named = directory_pointers(sample_copy)
    assert [f.code for f in findings] == ["bad-pointer"] and named == []


def test_megatron_wrong_iteration(tmp_path: Path) -> None:
    d = megatron_legacy(tmp_path / "meg", tp=1)
    moved = d.rename(d.parent / "iter_0000400")
    (moved.parent / "latest_checkpointed_iteration.txt").write_text("400")
    r = report(moved)
    assert "holds iteration 500 but sits in iter_0000400" in found(r, "wrong-iteration")[0].message
