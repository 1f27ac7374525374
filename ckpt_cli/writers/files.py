"""The bytes of each output file: a shard (safetensors or torch zip) written into a handle a
sink opened, and the HF-style shard index.

A shard is streamed one tensor (or piece) at a time from the :class:`~.pipeline.Prefetch`;
safetensors gets raw writes looped by :func:`~.safetensors.write_all`, a torch zip the
:class:`~.torchzip.TorchZipWriter`. Where the bytes go, and when they count as written, is the
sink's business (:mod:`ckpt_cli.writers.sink`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import orjson

from ckpt_cli.formats.hf_index import count_parameters
from ckpt_cli.storage import stages
from ckpt_cli.writers.pipeline import Flusher, Prefetch, Syncer, tensor_bytes
from ckpt_cli.writers.plan import OutTensor, ShardPlan
from ckpt_cli.writers.safetensors import header_bytes, write_all
from ckpt_cli.writers.torchzip import TorchZipWriter


def write_shard(f: Any, fmt: str, tensors: Sequence[OutTensor], members: tuple[int, ...],
                meta: dict[str, str], aliases: dict[str, str] | None, source: Prefetch,
                on_progress: Callable[[int], None] | None, syncer: Syncer,
                sid: str | None = None) -> None:
    """Write one shard's bytes into ``f``, and start syncing its rest in the background (the
    handle is still open when this returns; its owner closes or completes it; ``syncer.wait``
    makes it durable).

    Args:
        f: The open handle (:meth:`ckpt_cli.writers.sink.Sink.open`).
        fmt: ``safetensors`` or ``pt``.
        tensors: The tensors ``source`` produces, in its order.
        members: Indices into ``tensors`` of this shard's tensors, in order.
        meta: safetensors ``__metadata__``.
        aliases: ``{alias: name}`` of tied tensors (a torch zip writes the ones it holds).
        source: Produces the tensors' values.
        on_progress: Called with the number of bytes just written.
        syncer: Syncs the write's files in the background.
        sid: A torch zip's serialization id.
    """
    entries = [(tensors[i].name, tensors[i].dtype, tensors[i].shape) for i in members]
    flusher = Flusher(f, syncer)
    if fmt == "safetensors":
        head, _ = header_bytes(entries, meta)
        write_all(f, memoryview(head))
        for i in members:
            for data in tensor_bytes(source, i, tensors[i]):
                with stages.stage("write", len(data)):
                    write_all(f, data)
                flusher.wrote(len(data))
                if on_progress:
                    on_progress(len(data))
                del data
    else:
        here = {e[0] for e in entries}
        local = {a: n for a, n in (aliases or {}).items() if n in here}
        zw = TorchZipWriter(f, entries, local, serialization_id=sid)
        try:
            for i in members:
                with zw.tensor_record(tensors[i].nbytes) as record:
                    for data in tensor_bytes(source, i, tensors[i]):
                        with stages.stage("write", len(data)):
                            record.write(data)
                        flusher.wrote(len(data))
                        if on_progress:
                            on_progress(len(data))
                        del data
            zw.close()
        except BaseException:
            zw.abandon()
            raise
    # Before the file closes. (On an error the file closes with a sync under way: it runs on
    # a duplicate descriptor, and the error raised says more than its result would.)
    flusher.finish()


def index_bytes(root: Path, fmt: str, tensors: Sequence[OutTensor], plan: ShardPlan,
                aliases: dict[str, str] | None, meta: dict[str, str]) -> bytes:
    """The shard index (``model.safetensors.index.json``) of the shards written under ``root``.

    Args:
        root: Where the shards can be read back (the parameters are counted as inspect counts
            the output: model weights only, tied copies once).
        fmt: ``safetensors`` or ``pt``.
        tensors: Every tensor of the output, in plan order.
        plan: The shard plan.
        aliases: ``{alias: name}`` of tied tensors (pt: real keys of their target's shard).
        meta: The metadata; its ``ckpt.*`` keys are recorded.

    Returns:
        The index as indented JSON, newline-terminated.
    """
    weight_map: dict[str, str] = {}
    for fname, members in zip(plan.files, plan.members, strict=True):
        for i in members:
            weight_map[tensors[i].name] = fname
    if fmt == "pt":  # a tied alias is a real key of the shard holding its target
        for alias, target in (aliases or {}).items():
            weight_map[alias] = weight_map[target]
    index: dict[str, Any] = {
        "metadata": {"total_size": sum(t.nbytes for t in tensors),
                     "total_parameters": count_parameters(root, list(plan.files)),
                     **{k: v for k, v in meta.items() if k.startswith("ckpt.")}},
        "weight_map": dict(sorted(weight_map.items())),
    }
    return orjson.dumps(index, option=orjson.OPT_INDENT_2) + b"\n"
