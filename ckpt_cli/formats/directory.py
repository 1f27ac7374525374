"""A checkpoint directory of loose files: HF Trainer ``checkpoint-N/``, Accelerate, hand-rolled.

Such a directory holds model weights (safetensors, sharded or not, or torch files) beside
``optimizer.pt``, ``scheduler.pt``, ``rng_state*.pth``, ``training_args.bin`` and JSON state.
Each file is read by its own reader into one index; tensors of non-weight files are named with
the file's stem as a prefix (``optimizer.state.0.exp_avg``), weights keep their own names.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from ckpt_cli import storage
from ckpt_cli.errors import CkptError, CorruptCheckpointError, UnsafeCheckpointError
from ckpt_cli.formats import dcp, deepspeed, hf_index, safetensors, torchfile
from ckpt_cli.formats.base import DirectoryLayout, file_size, present, read_head, rel_to
from ckpt_cli.formats.names import step_from_name
from ckpt_cli.model import CheckpointIndex, FileInfo, Finding

CHECKPOINT_EXTENSIONS = (".safetensors", ".pt", ".pth", ".bin", ".ckpt", ".pkl", ".distcp")
_JSON_STATE = ("trainer_state.json", "config.json", "meta.json", "metadata.json")
NESTED_CHECKPOINTS = "nested-checkpoints"
"""Finding code: checkpoint directories below this one (an HF Trainer output directory)."""


def checkpoint_files(path: Path) -> list[Path]:
    """Top-level files of ``path`` that look like checkpoint data, sorted by name."""
    try:
        return sorted(p for p in path.iterdir()
                      if p.name.endswith(CHECKPOINT_EXTENSIONS) and present(p)
                      and not p.name.startswith("."))
    except OSError:
        return []


class DirectoryReader(DirectoryLayout):
    """Reads a directory of checkpoint files as one checkpoint."""

    name = "dir"
    missing = "no checkpoint files (.safetensors/.pt/.pth/.bin/.ckpt) at its top level"

    def recognises(self, path: Path) -> bool:
        """Checkpoint files at the top level, or an HF Trainer's ``trainer_state.json``."""
        return bool(checkpoint_files(path)) or (path / "trainer_state.json").is_file()

    def read_index(self, path: Path) -> CheckpointIndex:
        """See :meth:`ckpt_cli.formats.base.Reader.read_index`."""
        index = CheckpointIndex(format=self.name, root=path, base=path)
        read_into(index, path)
        if not index.tensors and not index.objects and any(
                f.severity == "error" for f in index.findings):
            first = next(f for f in index.findings if f.severity == "error")
            raise CorruptCheckpointError(first.message, path=path / (first.file or ""))
        return index


def read_into(index: CheckpointIndex, path: Path) -> None:
    """Fill ``index`` from a directory of checkpoint files.

    Args:
        index: The index (its ``base`` is ``path``).
        path: The directory.
    """
    done: set[str] = set()
    idx = hf_index.find_index(path)
    if idx is not None:
        try:
            hf_index.read_into(index, idx)
        except UnsafeCheckpointError:
            raise
        except CkptError as e:
            index.add(Finding("error", "bad-index", e.message, idx.name))
        done.update(f.path for f in index.files)
        wm = _weight_map_files(idx)
        done.update(wm)
    files = checkpoint_files(path)
    twins = _hf_twins(files, idx)
    if twins:
        index.add(Finding("info", "duplicate-weights",
                          f"{', '.join(p.name for p in twins[:2])}"
                          f"{f' and {len(twins) - 2} more' if len(twins) > 2 else ''}: the same "
                          "weights in the older format beside their safetensors (transformers "
                          "loads the safetensors); not read", twins[0].name))
    for p in files:
        rel = rel_to(p, index.base)
        if rel in done or p.suffix == ".distcp" or p in twins:
            continue
        role = torchfile.role_of(p.name)
        prefix = "" if role == "weights" else p.name.split(".")[0] + "."
        try:
            _read_file(index, p, role, prefix)
        except CkptError as e:
            index.add(Finding("error", "bad-file", e.message, rel))
            index.files.append(FileInfo(rel, p.stat().st_size, role, None))
    for name in _JSON_STATE:
        p = path / name
        if p.is_file():
            _read_json_state(index, p)
    nested: list[str] = []
    for sub in sorted(q for q in path.iterdir() if q.is_dir()):
        if dcp.metadata_file(sub) is not None:
            _merge_sub(index, sub)
        elif not sub.is_symlink() and step_from_name(sub.name, strict=True) is not None:
            nested.append(sub.name)
    if nested:
        # An HF Trainer output directory after training: the final model at the top, the
        # checkpoints saved on the way below it. They are not part of this checkpoint.
        shown = ", ".join(nested[:3]) + (f" and {len(nested) - 3} more" if len(nested) > 3
                                         else "")
        index.add(Finding("warning", NESTED_CHECKPOINTS,
                          f"also holds {len(nested)} checkpoint director"
                          f"{'y' if len(nested) == 1 else 'ies'} ({shown}), not part of this "
                          f"checkpoint: name them to inspect or validate them", None))
    if (path / "trainer_state.json").is_file():
        index.flavor = "hf-trainer"
    elif any(p.name.startswith("random_states_") for p in path.iterdir()):
        index.flavor = "accelerate"
    _missing_parts(index, files, idx)


_SHARD = re.compile(r"^(?P<stem>.+)-(?P<i>\d{5,})-of-(?P<n>\d{5,})(?P<ext>\.[a-z]+)\Z")


def _missing_parts(index: CheckpointIndex, files: list[Path], idx: Path | None) -> None:
    """Errors for a directory that lacks the part a loader needs first: a training checkpoint
    (HF Trainer, Accelerate) without model weights, HF shards with a gap, DeepSpeed optimizer
    partitions without their model states. Such a checkpoint reads fine file by file, but
    resuming from it fails, and prune must not keep it as the newest valid one."""
    names = {p.name for p in files}
    if idx is None:
        groups: dict[tuple[str, str, int], set[int]] = {}
        for name in names:
            m = _SHARD.match(name)
            if m:
                key = (m["stem"], m["ext"], int(m["n"]))
                groups.setdefault(key, set()).add(int(m["i"]))
        for (stem, ext, n), have in sorted(groups.items()):
            gone = [i for i in range(1, n + 1) if i not in have]
            if gone:
                first = f"{stem}-{gone[0]:05d}-of-{n:05d}{ext}"
                index.add(Finding("error", "missing-shard",
                                  f"{len(gone)} of {n} shards missing (and no index to say "
                                  "what they held)", first))
    optim = sorted(x for x in names if deepspeed.OPTIM_STATES.match(x))
    if optim and not any(deepspeed.MODEL_STATES.match(x) for x in names):
        index.add(Finding("error", "missing-rank-file",
                          "DeepSpeed optimizer partitions without any *_model_states.pt: "
                          "the checkpoint cannot be loaded", optim[0]))
    if index.flavor in ("hf-trainer", "accelerate") and not any(
            t.group in ("model", "buffer") for t in index.tensors.values()) and not any(
            f.code == "bad-file" for f in index.findings) and not _weights_below(index.base):
        index.add(Finding("error", "missing-weights",
                          "a training checkpoint without model weights (model.safetensors, "
                          "pytorch_model.bin or their shards): resuming from it fails"))


def _weights_below(path: Path) -> bool:
    """Whether a subdirectory holds checkpoint files: HF Trainer + DeepSpeed ZeRO-3 keeps the
    weights only in ``global_stepN/``, Accelerate save hooks write ``unet/...safetensors``."""
    try:
        subs = [p for p in path.iterdir() if p.is_dir() and not p.is_symlink()]
    except OSError:
        return False
    return any(checkpoint_files(sub) for sub in subs)


def _hf_twins(files: list[Path], idx: Path | None) -> list[Path]:
    """``pytorch_model*.bin`` (and ``adapter_model.bin``) beside the safetensors export of the
    same weights: HF repos and older save_pretrained outputs hold both."""
    names = {p.name for p in files}
    st_model = (any(n.startswith("model") and n.endswith(".safetensors") for n in names)
                or (idx is not None and idx.name == "model.safetensors.index.json"))
    out = []
    for p in files:
        if st_model and p.name.startswith("pytorch_model") and p.suffix == ".bin":
            out.append(p)
        elif p.name == "adapter_model.bin" and "adapter_model.safetensors" in names:
            out.append(p)
    return out


def _weight_map_files(idx: Path) -> set[str]:
    try:
        wm, _ = hf_index.load_index_json(idx)
    except CkptError:
        return set()
    return set(wm.values())


def _read_file(index: CheckpointIndex, p: Path, role: str, prefix: str) -> None:
    size = file_size(p)
    if safetensors.sniff_bytes(read_head(p, 9), size) is None:
        safetensors.read_into(index, p, role=role, default_group=_group_for(role), prefix=prefix)
    elif torchfile.sniff_torch(p) is None:
        torchfile.read_into(index, p, role=role, prefix=prefix)
    elif size == 0:
        # In the words of a lone empty file (formats.reader_for): no format's file is empty.
        index.files.append(FileInfo(rel_to(p, index.base), size, role, None))
        index.add(Finding("error", "empty-file", "empty file (0 bytes): not a checkpoint, or "
                          "its write never started", rel_to(p, index.base)))
    else:
        index.files.append(FileInfo(rel_to(p, index.base), size, role, None))
        index.add(Finding("warning", "unknown-file", "not a format ckpt reads; skipped",
                          rel_to(p, index.base)))


def _group_for(role: str) -> str:
    return {"optimizer": "optimizer", "weights": "model", "shard": "model"}.get(role, "other")


def _read_json_state(index: CheckpointIndex, p: Path) -> None:
    rel = rel_to(p, index.base)
    size = file_size(p)
    index.files.append(FileInfo(rel, size, "metadata", "json"))
    cap = storage.CAPS["json-state"]
    if size > cap:
        index.add(Finding("warning", "bad-json", f"{size:,} bytes, over the {cap >> 20} MiB cap "
                          "for a JSON state file: not read", rel))
        return
    try:
        data = storage.load_side_json(p, "json-state", what="JSON state")
    except CkptError as e:
        index.add(Finding("error", "bad-json", e.message, rel))
        return
    if not isinstance(data, dict):
        return
    if p.name == "trainer_state.json":
        _trainer_state(index, data)
    elif p.name == "config.json":
        keep = {k: data[k] for k in ("architectures", "model_type", "torch_dtype", "dtype",
                                     "transformers_version") if k in data}
        if keep:
            index.metadata["config"] = keep
    else:
        for k in ("step", "global_step", "epoch", "lr"):
            v = data.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                index.metadata.setdefault("step" if k == "global_step" else k, v)


def _trainer_state(index: CheckpointIndex, data: dict[str, Any]) -> None:
    step = data.get("global_step")
    if isinstance(step, int):
        index.metadata["step"] = step
    for k in ("epoch", "best_metric", "best_model_checkpoint", "best_global_step", "max_steps",
              "num_train_epochs", "train_batch_size", "total_flos"):
        if data.get(k) is not None:
            index.metadata[k] = data[k]
    history = data.get("log_history")
    if isinstance(history, list):
        for entry in reversed(history):
            if isinstance(entry, dict) and "learning_rate" in entry:
                index.metadata.setdefault("lr", entry["learning_rate"])
                if "loss" in entry:
                    index.metadata.setdefault("loss", entry["loss"])
                break


def _merge_sub(index: CheckpointIndex, sub: Path) -> None:
    """Merge a nested DCP directory (Accelerate FSDP ``pytorch_model_fsdp_0/``...)."""
    prefix = sub.name
    try:
        inner = dcp.DCPReader().read_index(sub)
    except CkptError as e:
        index.add(Finding("error", "bad-subdir", e.message, prefix))
        return
    merge(index, inner, name_prefix=prefix + ".", path_prefix=prefix + "/")


def merge(dst: CheckpointIndex, src: CheckpointIndex, *, name_prefix: str,
          path_prefix: str) -> None:
    """Add ``src``'s tensors, files, objects and findings to ``dst`` under prefixes.

    Args:
        dst: The index to extend.
        src: The index to add.
        name_prefix: Prepended to tensor and object names.
        path_prefix: Prepended to file paths (``src.base`` relative to ``dst.base``).
    """
    for t in src.tensors.values():
        chunks = tuple(dataclasses.replace(c, file=path_prefix + c.file) for c in t.chunks)
        storage = (dataclasses.replace(t.storage, file=path_prefix + t.storage.file)
                   if t.storage else None)
        dst.tensors[name_prefix + t.name] = dataclasses.replace(
            t, name=name_prefix + t.name, file=path_prefix + t.file if t.file else None,
            storage=storage, chunks=chunks)
    dst.files.extend(dataclasses.replace(f, path=path_prefix + f.path) for f in src.files)
    dst.objects.update({name_prefix + k: v for k, v in src.objects.items()})
    dst.containers.update({name_prefix + k: v for k, v in src.containers.items()})
    for k, v in src.metadata.items():
        dst.metadata.setdefault(k, v)
    dst.findings.extend(dataclasses.replace(f, file=path_prefix + f.file if f.file else None)
                        for f in src.findings)
