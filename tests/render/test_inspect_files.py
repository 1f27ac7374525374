"""``inspect``'s file table lists a shard set in name order (issue 46 item 8: it was sorted by
size, so shard 4 of 5 came first), numbers compared as numbers, then one row counting the rest
with their bytes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.requires_torch


def _shards(d: Path, n: int) -> None:
    """An HF shard set written by huggingface_hub, shard sizes out of name order."""
    import torch
    from huggingface_hub import save_torch_state_dict

    d.mkdir()
    sizes = [(7 * i) % n + 1 for i in range(n)]  # a permutation: no order by size
    save_torch_state_dict({f"layer.{i:02d}.weight": torch.zeros(64 * s, 16)
                           for i, s in enumerate(sizes)}, d, max_shard_size="4KB")


def _file_rows(out: str) -> list[str]:
    rows = out.split("File ", 1)[1].splitlines()[1:]
    return [r.split()[0] if not r.startswith("...") else r for r in rows if r.strip()]


def test_shards_are_listed_in_name_order(tmp_path: Path) -> None:
    _shards(tmp_path / "hf", 9)
    r = run_cli("inspect", tmp_path / "hf")
    assert r.exit_code == 0, r.output
    assert _file_rows(r.stdout) == [f"model-{i:05d}-of-00009.safetensors"
                                    for i in range(1, 10)] + ["model.safetensors.index.json"]


def test_past_twenty_files_one_row_counts_the_rest(tmp_path: Path) -> None:
    _shards(tmp_path / "hf", 24)
    r = run_cli("inspect", tmp_path / "hf")
    rows = _file_rows(r.stdout)
    assert rows[:20] == [f"model-{i:05d}-of-00024.safetensors" for i in range(1, 21)]
    assert re.match(r"\.\.\. 5 more\s+\d", rows[20]), rows[20]
