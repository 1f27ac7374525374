"""DeepSpeed checkpoints: a tag directory such as ``global_step100/``.

ZeRO 0-2 write ``mp_rank_XX_model_states.pt`` (data-parallel rank 0) and one
``[bf16_]zero_pp_rank_D_mp_rank_XX_optim_states.pt`` per rank; ZeRO-3 writes one
``zero_pp_rank_D_mp_rank_XX_model_states.pt`` per rank too. Every file is a torch zip read with
the safe unpickler (their ``ds_config`` and enum objects become inert records).
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

from ckpt_cli.errors import CkptError, UnknownFormatError
from ckpt_cli.formats import torchfile
from ckpt_cli.formats.base import DirectoryLayout, read_small
from ckpt_cli.model import CheckpointIndex, FileInfo, Finding

MODEL_STATES = re.compile(
    r"^(?:zero_pp_rank_(?P<dp>\d+)_)?mp_rank_(?P<mp>\d+)_model_states\.pt\Z")
OPTIM_STATES = re.compile(
    r"^(?P<bf16>bf16_)?zero_pp_rank_(?P<dp>\d+)_mp_rank_(?P<mp>\d+)_optim_states\.pt\Z")
EXPERT_STATES = re.compile(r"^(?:layer_\d+_expert_\d+_mp_rank_\d+_model_states|"
                           r"expp_rank_\d+_mp_rank_\d+_optim_states)\.pt\Z")


def has_model_states(path: Path) -> bool:
    """Whether a directory holds ``*_model_states.pt`` files (a DeepSpeed tag)."""
    try:
        return any(MODEL_STATES.match(p.name) for p in path.iterdir())
    except OSError:
        return False


def zero3_rank_file(path: Path, metadata: dict[str, Any] | None = None) -> Path | None:
    """The tag directory of one rank's ZeRO-3 ``zero_pp_rank_D_mp_rank_XX_model_states.pt``
    (None for any other file). Its module weights are empty placeholders: the values lie
    partitioned in the optimizer files, and only the whole tag (or its save directory) can be
    gathered. Known by its name, or (renamed) by DeepSpeed's keys in ``metadata`` beside a
    ``zero_pp_rank_`` sibling."""
    m = MODEL_STATES.match(path.name)
    if m is not None and m.group("dp") is not None:
        return path.parent
    if metadata is not None and "ds_version" in metadata and path.parent.is_dir():
        try:
            if any(OPTIM_STATES.match(p.name) for p in path.parent.iterdir()) and any(
                    (n := MODEL_STATES.match(p.name)) and n.group("dp") is not None
                    for p in path.parent.iterdir()):
                return path.parent
        except OSError:
            return None
    return None


def latest_tag(path: Path) -> str | None:
    """What a save directory's ``latest`` file names, if it is a plain directory name as
    DeepSpeed writes it (never '.', '..' or a path); None without such a file."""
    try:
        tag = read_small(path / "latest", 4096).decode(errors="replace").strip()
    except (OSError, CkptError):
        return None
    return tag if tag and tag not in (".", "..") and "/" not in tag and "\\" not in tag else None


def tag_dir(path: Path) -> Path | None:
    """The directory holding a checkpoint's rank files: ``path`` itself, or the one tag that
    ``latest`` names in a save directory holding nothing else (Lightning's DeepSpeedStrategy
    saves ``epoch=0-step=N.ckpt/`` as ``checkpoint/``, ``latest`` and ``zero_to_fp32.py``).
    None when ``path`` is neither. A save directory of step-numbered tags (``global_step300``)
    is a run directory, even with one tag, not one checkpoint."""
    if has_model_states(path):
        return path
    tag = latest_tag(path)
    if tag is None or any(c.isdigit() for c in tag):
        return None
    try:
        tags = [p.name for p in path.iterdir() if p.is_dir() and not p.is_symlink()
                and has_model_states(p)]
    except OSError:
        return None
    return path / tag if tags == [tag] else None


def rank_files(path: Path) -> tuple[list[Path], list[Path], list[Path]]:
    """The model-state, optimizer-state and MoE expert files of a tag directory, sorted by rank."""
    model, optim, expert = [], [], []
    for p in path.iterdir():
        if MODEL_STATES.match(p.name):
            model.append(p)
        elif OPTIM_STATES.match(p.name):
            optim.append(p)
        elif EXPERT_STATES.match(p.name):
            expert.append(p)

    def key(p: Path) -> tuple[int, int]:
        m = MODEL_STATES.match(p.name) or OPTIM_STATES.match(p.name)
        if m is None:
            return (0, 0)
        return (int(m.group("mp")), int(m.group("dp") or 0))

    return sorted(model, key=key), sorted(optim, key=key), sorted(expert)


def is_zero3(index: CheckpointIndex) -> bool:
    """Whether ``index`` is a DeepSpeed ZeRO-3 checkpoint.

    ZeRO-3 partitions the parameters themselves: its per-rank model-states files hold empty
    placeholders (shape ``[0]``) for every partitioned parameter, and the weights exist only
    as flat FP32 partitions in the optimizer files (``ckpt consolidate`` rebuilds them). Known
    from the recorded stage, or from the per-rank model-states files only ZeRO-3 writes.
    """
    if index.format != "deepspeed":
        return False
    if index.layout.get("zero_stage") == 3:
        return True
    return any((m := MODEL_STATES.match(Path(f.path).name)) is not None
               and m.group("dp") is not None for f in index.files)


class DeepSpeedReader(DirectoryLayout):
    """Reads a DeepSpeed tag directory (``global_stepN/``)."""

    name = "deepspeed"
    missing = "no *_model_states.pt files"

    def recognises(self, path: Path) -> bool:
        """A tag directory, or the save directory whose ``latest`` names its only tag."""
        return tag_dir(path) is not None

    def read_index(self, path: Path) -> CheckpointIndex:
        """See :meth:`ckpt_cli.formats.base.Reader.read_index`."""
        model, optim, expert = rank_files(tag_dir(path) or path)
        if not model:
            raise UnknownFormatError("no *_model_states.pt files", path=path)
        index = CheckpointIndex(format=self.name, root=path, base=path, flavor="deepspeed")
        for i, p in enumerate(model + expert):
            _read(index, p, "weights", "" if i == 0 else p.stem + ".")
        for p in optim:
            _read(index, p, "optimizer", p.stem + ".")
        _mark_buffers(index, model)
        _layout(index, model, optim)
        if is_zero3(index):
            _master_weights(index)
        return index


def _listed(objects: dict[str, Any], key: str) -> list[Any]:
    """A list the pickle held under ``key`` (flattened as one leaf, or element by element)."""
    whole = objects.get(key)
    if isinstance(whole, list):
        return whole
    out, i = [], 0
    while f"{key}.{i}" in objects:
        out.append(objects[f"{key}.{i}"])
        i += 1
    return out


def _mark_buffers(index: CheckpointIndex, model: list[Path]) -> None:
    """DeepSpeed records which module entries are buffers (``buffer_names``); under ZeRO-3
    every rank's model states hold them (listed under the file's stem after the first)."""
    listed = [n for n in _listed(index.objects, "buffer_names") if isinstance(n, str)]
    prefixes = ["", *(p.stem + "." for p in model[1:])]
    names = {f"{pre}module.{n}" for pre in prefixes for n in listed}
    for name in names & set(index.tensors):
        index.tensors[name] = dataclasses.replace(index.tensors[name], group="buffer")


def _read(index: CheckpointIndex, p: Path, role: str, prefix: str) -> None:
    try:
        torchfile.read_into(index, p, role=role, prefix=prefix)
    except CkptError as e:
        index.add(Finding("error", "bad-file", e.message, p.name))
        index.files.append(FileInfo(p.name, p.stat().st_size, role, None))


def _layout(index: CheckpointIndex, model: list[Path], optim: list[Path]) -> None:
    objs = index.objects
    stage = _stage(objs, optim)
    dp = objs.get("dp_world_size")
    mp = objs.get("mp_world_size")
    mps = {m.group("mp") for p in optim if (m := OPTIM_STATES.match(p.name))}
    dps = {m.group("dp") for p in optim if (m := OPTIM_STATES.match(p.name))}
    index.layout.update({
        "zero_stage": stage,
        "world_size": dp if isinstance(dp, int) else (len(dps) or None),
        "mp_world_size": mp if isinstance(mp, int) else (len(mps) or 1),
        "model_files": len(model), "optim_files": len(optim),
        "bf16_optimizer": any(p.name.startswith("bf16_") for p in optim),
    })
    shapes = [v for k, v in objs.items() if k.startswith("param_shapes.")
              and isinstance(v, list) and all(isinstance(d, int) for d in v)]
    if shapes:
        index.layout["param_count"] = sum(math.prod(s) for s in shapes)
    if isinstance(dp, int) and optim:
        per_mp = len(optim) // max(1, len(mps))
        if per_mp != dp or len(dps) != dp:
            index.add(Finding("error", "world-size",
                              f"dp_world_size is {dp} but there are {len(dps)} optimizer "
                              "rank file(s) per model-parallel rank", None))
        missing = sorted(set(range(dp)) - {int(d) for d in dps})
        if missing:
            index.add(Finding("error", "missing-rank",
                              f"optimizer state of data-parallel rank(s) {missing} is missing"))


_FLAT_GROUP = re.compile(r"(?:^|\.)fp32_flat_groups\.\d+$")


def _master_weights(index: CheckpointIndex) -> None:
    """Count ZeRO-3's FP32 master weights as the model's weights.

    The model states hold ``[0]`` placeholders; the weights are the flat FP32 partitions
    (``fp32_flat_groups``) in every rank's optimizer file, padded to a multiple of the world
    size. Grouped as ``model`` they show the model is there and what it weighs; the count and
    size once consolidated come from ``param_shapes`` (``layout["master_weights"]``).
    """
    flat = [n for n in index.tensors if _FLAT_GROUP.search(n)]
    if not flat:
        return
    for n in flat:
        index.tensors[n] = dataclasses.replace(index.tensors[n], group="model")
    elements = sum(index.tensors[n].numel for n in flat)
    declared = index.layout.get("param_count")
    params = declared if isinstance(declared, int) else elements
    index.layout["master_weights"] = {
        "dtype": "F32", "partitions": len(flat), "elements": elements,
        "bytes": sum(index.tensors[n].nbytes for n in flat), "parameters": params,
        "padding": max(0, elements - params), "consolidated_bytes": 4 * params}


def _stage(objs: dict[str, Any], optim: list[Path]) -> int | None:
    for k, v in objs.items():
        if k.endswith("optimizer_state_dict.zero_stage"):
            if isinstance(v, int):
                return v
            m = re.search(r"\((\d)\)$", str(v))
            if m:
                return int(m.group(1))
    v = objs.get("ds_config.zero_optimization.stage")
    if isinstance(v, int):
        return v
    if any(".fp32_flat_groups" in k for k in objs):
        return 3
    return 0 if not optim else None
