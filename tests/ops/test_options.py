"""Every op takes one options dataclass; a caller may name its fields as keywords instead."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ckpt_cli.ops import options_of
from ckpt_cli.ops.consolidate import ConsolidateOptions
from ckpt_cli.ops.convert import ConvertOptions, convert
from ckpt_cli.ops.plan import plan
from ckpt_cli.ops.plan.options import PlanOptions
from ckpt_cli.ops.validate import validate
from ckpt_cli.ops.validate.options import ValidateOptions


def test_options_of_takes_one_way_or_the_defaults() -> None:
    assert options_of(ConvertOptions, None, {}) == ConvertOptions()
    given = ConvertOptions(to="bf16")
    assert options_of(ConvertOptions, given, {}) is given
    assert options_of(ConvertOptions, None, {"to": "bf16"}) == given
    with pytest.raises(TypeError, match="not both"):
        options_of(ConvertOptions, given, {"to": "fp16"})
    with pytest.raises(TypeError):
        options_of(ConvertOptions, None, {"no_such_field": 1})


def test_options_are_frozen_with_the_flags_defaults() -> None:
    for kind in (ConvertOptions, ConsolidateOptions, ValidateOptions, PlanOptions):
        with pytest.raises(dataclasses.FrozenInstanceError):
            kind().__setattr__("finalize" if kind is not PlanOptions else "keep", True)
    assert ConvertOptions().to == "keep"
    assert ConsolidateOptions().max_shard_size == 5_000_000_000
    assert ConsolidateOptions().manifest is True
    assert ValidateOptions().manifest_hash == "xxh3_128"


@pytest.mark.requires_torch
def test_ops_take_the_dataclass_or_its_fields(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    src = tmp_path / "m.safetensors"
    save_file({"w": torch.ones(4, 4)}, str(src))
    by_options = convert(src, tmp_path / "a.safetensors", ConvertOptions(to="bf16"))
    by_fields = convert(src, tmp_path / "b.safetensors", to="bf16")
    assert by_options.casts == by_fields.casts == {"F32->BF16": 1}
    assert load_file(str(tmp_path / "a.safetensors"))["w"].dtype == torch.bfloat16
    assert validate(src, ValidateOptions(quick=True)).exit_code() == 0
    figures = plan(PlanOptions(params=7_000_000_000, bandwidth=1e9))
    assert figures.bandwidth == 1e9
    assert figures.size == plan(params=7_000_000_000, bandwidth=1e9).size
