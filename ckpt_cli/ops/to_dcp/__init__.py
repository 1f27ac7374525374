"""``ckpt convert SRC --to dcp``: a run's training state (weights, optimizer moments, LR
schedule, step, RNG) moved into a torch.distributed.checkpoint directory (issue 48).

Each source framework is read into one :class:`~ckpt_cli.ops.to_dcp.state.TrainingState`
(``state.py``); one writer turns that into DCP. Nothing here runs code from a checkpoint.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path

from ckpt_cli import storage
from ckpt_cli.errors import UnsupportedError, UsageError
from ckpt_cli.formats import check_exists, read_index
from ckpt_cli.model import CheckpointIndex
from ckpt_cli.ops.convert.result import ConvertOptions, ConvertResult
from ckpt_cli.ops.to_dcp.dcp_source import read_dcp
from ckpt_cli.ops.to_dcp.deepspeed import read_deepspeed
from ckpt_cli.ops.to_dcp.hf_trainer import read_hf_trainer
from ckpt_cli.ops.to_dcp.lightning import read_lightning
from ckpt_cli.ops.to_dcp.parts import check_part_output, write_dcp_part
from ckpt_cli.ops.to_dcp.state import TrainingState
from ckpt_cli.ops.to_dcp.torch_dict import read_torch
from ckpt_cli.ops.to_dcp.writer import count_tensors, layout_state, write_dcp
from ckpt_cli.parts import source_identity
from ckpt_cli.progress import Progress, Tally
from ckpt_cli.resolve import resolve
from ckpt_cli.storage.atomic import check_not_input
from ckpt_cli.tensors.select import hostile_warnings
from ckpt_cli.writers.dcp import check_dcp_output


def _read_torch(path: Path) -> TrainingState:
    return read_torch(path)


def _read_dcp(path: Path) -> TrainingState:
    return read_dcp(path)


def _read_deepspeed(path: Path) -> TrainingState:
    return read_deepspeed(path)


def _read_hf_trainer(path: Path) -> TrainingState:
    return read_hf_trainer(path)


def _read_lightning(path: Path) -> TrainingState:
    return read_lightning(path)


SOURCES: dict[str, Callable[[Path], TrainingState]] = {
    "torch": _read_torch,
    "dcp": _read_dcp,
    "deepspeed": _read_deepspeed,
    "hf-trainer": _read_hf_trainer,
    "lightning": _read_lightning,
}
"""Source format (``--input-format``'s name, or the flavor ckpt detects: ``lightning``,
``hf-trainer``) -> the reader giving its :class:`TrainingState`."""


def source_format(src: Path, input_format: str | None
                  ) -> tuple[str, Path, CheckpointIndex]:
    """The :data:`SOURCES` key for ``src``: the flavor detected (``lightning``,
    ``hf-trainer``...) where a reader knows it, else the format; and the path to read (a
    step directory holding one torch file: that file), with its index (headers only).

    Raises:
        UnsupportedError: No reader moves this format's training state.
    """
    index = read_index(src, input_format)
    if index.format == "dir" and index.flavor is None and len(index.files) == 1 and \
            index.files[0].format == "torch":
        src = index.path_of(index.files[0].path)  # step_000300/checkpoint.pt
        index = read_index(src, "torch")
    for key in (input_format, index.flavor, index.format):
        if key is not None and key in SOURCES:
            return key, src, index
    raise UnsupportedError(f"{src}: a DCP conversion cannot read the training state of a "
                           f"{index.flavor or index.format} checkpoint (it reads: "
                           f"{', '.join(sorted(SOURCES))})")


# Options that shape a safetensors/pt output and mean nothing for a DCP directory.
_NOT_FOR_DCP = ("output_format", "max_shard_size", "keep_optimizer", "keep_prefix",
                "keep_fp32", "clamp", "container", "dequantize")


def convert_to_dcp(source: str | Path, output: str | Path, opts: ConvertOptions, *,
                   progress: Progress | None = None) -> ConvertResult:
    """``convert(..., to="dcp")``: a source's training state written as a DCP directory.

    Args:
        source: A checkpoint (or a run directory whose pointer names one).
        output: The directory to create.
        opts: The convert options (``dcp_layout``, ``overwrite``, ``input_format``).
        progress: Called as tensors are written: ``("writing", bytes_done, bytes_total)``.

    Returns:
        The :class:`~ckpt_cli.ops.convert.ConvertResult` (``tensors``: every tensor written,
        by its DCP key; ``metadata``: the layout, optimizer and step; ``notes``).

    Raises:
        UsageError: Options that mean nothing for a DCP output.
        UnsupportedError: A source whose training state cannot be moved (named).
    """
    t0 = time.perf_counter()
    defaults = ConvertOptions()
    for f in fields(ConvertOptions):
        if f.name in _NOT_FOR_DCP and getattr(opts, f.name) != getattr(defaults, f.name):
            raise UsageError(f"{f.name} does not apply to a DCP output", param=f.name)
    src, out = storage.locate(source), storage.locate(output)
    check_exists(src)
    given = resolve(src, input_format=opts.input_format)
    followed, src = given.followed, given.checkpoint()
    check_not_input(out, src)
    split = opts.part is not None or opts.finalize
    if split:
        check_part_output(out)
    # A local directory or a store's prefix; a split job's existing output is its parts' work.
    check_dcp_output(out, overwrite=opts.overwrite or split)
    fmt, src, index = source_format(src, opts.input_format)
    state = SOURCES[fmt](src)
    tree = layout_state(state, opts.dcp_layout)
    tally = Tally.of(progress, "writing")
    if split:  # each part its share of the .distcp files; the last one the .metadata
        written = write_dcp_part(tree, out, part=opts.part, finalize=opts.finalize,
                                 source_id=source_identity(index.base,
                                                           [f.path for f in index.files]),
                                 overwrite=opts.overwrite,
                                 on_progress=tally.advance if tally else None,
                                 on_start=tally.start if tally else None)
    else:
        written = write_dcp(tree, out, overwrite=opts.overwrite,
                            on_progress=tally.advance if tally else None,
                            on_start=tally.start if tally else None)
    tensors = count_tensors(tree)
    meta = {"ckpt.conversion": f"{fmt} -> dcp ({opts.dcp_layout})",
            "ckpt.optimizer": state.optimizer or ("none" if not state.optimizer_state
                                                  else "unrecognised"),
            "ckpt.step": "unknown" if state.step is None else str(state.step)}
    notes = list(state.notes)
    if not state.optimizer_state:
        notes.append("the output holds no optimizer state")
    return ConvertResult(storage.locate(source), fmt, out, written, tensors, [], {}, {}, {}, {},
                         False, meta, notes, time.perf_counter() - t0,
                         warnings=hostile_warnings(index), followed=followed)
