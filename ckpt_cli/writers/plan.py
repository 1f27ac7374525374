"""Shard packing: which tensors go to which output file, and the files' names (pure).

:func:`plan_shards` packs tensors into output files the way huggingface_hub does (greedy, in
order, an oversize tensor alone in its own shard), and names the files HF-style. Writers only
execute the plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """Which tensors go to which file.

    Attributes:
        files: Output file names, in order.
        members: For each file, the indices (into the planned sequence) of its tensors.
        sizes: For each file, the bytes of tensor data it holds.
    """

    files: tuple[str, ...]
    members: tuple[tuple[int, ...], ...]
    sizes: tuple[int, ...]

    @property
    def sharded(self) -> bool:
        """Whether more than one file is written (an index file is then needed)."""
        return len(self.files) > 1


def shard_name(stem: str, ext: str, i: int, n: int) -> str:
    """HF shard file name: ``model-00001-of-00003.safetensors`` (``model.safetensors`` if n=1)."""
    if n == 1:
        return f"{stem}{ext}"
    return f"{stem}-{i:05d}-of-{n:05d}{ext}"


def plan_shards(sizes: Sequence[int], max_shard_size: int | None, *, stem: str = "model",
                ext: str = ".safetensors") -> ShardPlan:
    """Pack tensors of the given byte sizes into shards of at most ``max_shard_size`` bytes.

    Tensors keep their order; each lands in exactly one shard; a tensor larger than the limit
    gets a shard of its own. With no limit everything goes into one file.

    Args:
        sizes: Byte size of each tensor, in output order.
        max_shard_size: Largest shard in bytes, or None for a single file.
        stem: File name stem (``model``, ``pytorch_model``).
        ext: File extension (``.safetensors``, ``.bin``).

    Returns:
        The :class:`ShardPlan`.

    Raises:
        ValueError: If ``max_shard_size`` is not positive or a size is negative.
    """
    if max_shard_size is not None and max_shard_size <= 0:
        raise ValueError("max_shard_size must be positive")
    groups: list[list[int]] = [[]]
    totals: list[int] = [0]
    for i, size in enumerate(sizes):
        if size < 0:
            raise ValueError("tensor sizes cannot be negative")
        full = max_shard_size is not None and groups[-1] and totals[-1] + size > max_shard_size
        if full:
            groups.append([])
            totals.append(0)
        groups[-1].append(i)
        totals[-1] += size
    n = len(groups)
    return ShardPlan(tuple(shard_name(stem, ext, i + 1, n) for i in range(n)),
                     tuple(tuple(g) for g in groups), tuple(totals))
