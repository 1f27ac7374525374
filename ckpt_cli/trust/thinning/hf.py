"""Thinning a local HF Trainer ``checkpoint-N`` directory (its optimizer file rewritten without
its per-parameter state; with ``--thin-to bf16`` its safetensors weights cast)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from ckpt_cli import storage
from ckpt_cli.errors import CkptError
from ckpt_cli.formats import read_index
from ckpt_cli.formats.names import MANIFEST_NAME
from ckpt_cli.runs import tree_scan
from ckpt_cli.storage.atomic import fsync_path, rename_onto, tmp_sibling
from ckpt_cli.tensors.cast import cast_array
from ckpt_cli.tensors.source import TensorSource
from ckpt_cli.trust.thinning import base
from ckpt_cli.trust.thinning.base import (
    HF_OPTIMIZER_FILES,
    OnStart,
    Thinned,
    _keep_age,
    _newest_ns,
    _optimizer_file_without_state,
    _work_name,
    quick_check,
)
from ckpt_cli.writers.safetensors import header_bytes, write_all


def _thin_hf_dir(path: Path, to: str | None, on_start: OnStart) -> Thinned | None:
    """An HF Trainer ``checkpoint-N``.

    Its optimizer file is rewritten with an empty ``state`` and its ``param_groups`` kept: the
    Trainer restores ``scheduler.pt`` only when the optimizer file is there too, and the
    optimizer's ``param_groups`` carry the learning rate the schedule reached, so a resumed run
    follows its schedule (Adam re-creates its moments at the next step).

    Without ``to``: the thinned optimizer file is written under a temporary name inside the
    checkpoint and renamed over the original (one ``rename`` each: a kill leaves it whole or
    thinned, complete either way, and the temporary, which the next prune removes). With
    ``to="bf16"``: a copy of the directory is built beside it (unchanged files copied, the
    ``model*.safetensors`` weights cast to BF16 with :mod:`ckpt_cli.tensors.cast`,
    ``config.json``'s dtype and the index's ``total_size`` updated, the optimizer file
    thinned) and swapped in with one atomic exchange.
    """
    files = [n for n in HF_OPTIMIZER_FILES
             if (path / n).is_file() and not (path / n).is_symlink()]
    if not files:
        return None
    idents = [_ident(path / n) for n in files]
    problem = quick_check(path)
    if problem:
        raise CkptError(f"does not validate ({problem}); left whole", path=path)
    thin = {n: d for n in files if (d := _optimizer_file_without_state(path / n)) is not None}
    if not thin:
        return None  # thinned already
    victims = sorted(thin, key=HF_OPTIMIZER_FILES.index)
    bytes_before = tree_scan(path).bytes
    if to == "bf16":
        return _hf_to_bf16(path, thin, victims, on_start, bytes_before)
    newest = _newest_ns(path)
    tmps = {n: tmp_sibling(path / n) for n in victims}
    try:
        for n in victims:
            _save_like(thin[n], tmps[n], path / n)
        if [_ident(path / n) for n in files] != idents or tree_scan(path).bytes != (
                bytes_before + sum(t.stat().st_size for t in tmps.values())):
            raise CkptError("it changed while being thinned; left as it is", path=path)
        on_start(victims, None, bytes_before)
        algorithm = base._set_manifest_aside(path)
        for n in victims:
            rename_onto(tmps[n], path / n)  # one rename: the original or the thinned file
    finally:
        for t in tmps.values():
            with contextlib.suppress(FileNotFoundError):
                t.unlink()
    fsync_path(path)
    digest = base._manifest_again(path, algorithm)
    _keep_age(path, newest)
    return Thinned(path, victims, None, bytes_before, tree_scan(path).bytes, digest)


def _ident(p: Path) -> tuple[int, int, int]:
    st = p.stat()
    return st.st_ino, st.st_size, st.st_mtime_ns


def _save_like(obj: dict[str, Any], dest: Path, like: Path) -> None:
    """``torch.save`` ``obj`` to ``dest`` with the mode and times of ``like`` (retention by age
    must not take a thinned checkpoint for a new one), fsynced and checked to read back."""
    import torch  # heavy: torch

    st = like.stat()
    torch.save(obj, dest)
    os.chmod(dest, st.st_mode & 0o7777)
    os.utime(dest, ns=(st.st_atime_ns, st.st_mtime_ns))
    fsync_path(dest)
    problem = quick_check(dest)
    if problem:
        raise CkptError(f"the thinned {like.name} does not validate ({problem}); left whole",
                        path=like.parent)


def _hf_to_bf16(path: Path, thin: dict[str, dict[str, Any]], victims: list[str],
                on_start: OnStart, bytes_before: int) -> Thinned:
    newest = _newest_ns(path)
    children = list(path.iterdir())
    if any(c.is_symlink() or not c.is_file() for c in children):
        raise CkptError("holds links or subdirectories; `thin_to=bf16` leaves it whole",
                        path=path)
    weights = [c for c in children if c.name.startswith("model")
               and c.name.endswith(".safetensors")]
    if not weights:
        raise CkptError("no model*.safetensors weights to cast; left whole", path=path)
    if any(c.name.endswith((".bin", ".pt", ".pth")) and "model" in c.name for c in children):
        raise CkptError("holds torch-pickle weights beside safetensors; `thin_to=bf16` casts "
                        "only safetensors and leaves it whole", path=path)
    tmp = _work_name(path)
    tmp.mkdir(mode=path.stat().st_mode & 0o7777)
    try:
        sizes: dict[str, int] = {}
        for c in children:
            if c.name == MANIFEST_NAME:
                continue
            if c.name in thin:
                _save_like(thin[c.name], tmp / c.name, c)
            elif c in weights:
                sizes[c.name] = _safetensors_to_bf16(c, tmp / c.name)
                shutil.copystat(c, tmp / c.name)
            elif c.name == "config.json":
                cfg = storage.load_side_json(c, "config")
                keys = [k for k in ("torch_dtype", "dtype") if k in cfg] or ["torch_dtype"]
                for k in keys:
                    cfg[k] = "bfloat16"
                (tmp / c.name).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
                shutil.copystat(c, tmp / c.name)
            elif c.name.endswith(".safetensors.index.json"):
                continue  # below, once every shard's size is known
            else:
                # Copied, never hard-linked: removing the copy after a kill (the next prune's
                # sweep) would change the original's inode-change time, and prune then takes
                # the original for a checkpoint being written and leaves it whole.
                shutil.copy2(c, tmp / c.name)
        for c in children:
            if c.name.endswith(".safetensors.index.json") and c.name.startswith("model"):
                doc = storage.load_side_json(c, "index")
                if isinstance(doc.get("metadata"), dict) and "total_size" in doc["metadata"]:
                    doc["metadata"]["total_size"] = sum(sizes.values())
                (tmp / c.name).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
                shutil.copystat(c, tmp / c.name)
            elif c.name.endswith(".safetensors.index.json"):
                shutil.copy2(c, tmp / c.name)
        return base._swap_in(path, tmp, on_start, victims, "bf16", bytes_before, newest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _safetensors_to_bf16(src: Path, dest: Path) -> int:
    """Write ``src`` to ``dest`` with its FP32/FP16/FP64 tensors cast to BF16 (one tensor in
    memory at a time); returns the bytes of tensor data written."""
    index = read_index(src)
    order = sorted(index.tensors.values(), key=lambda t: t.offset or 0)
    codes = {t.name: ("BF16" if t.dtype in ("F32", "F64", "F16") else t.dtype) for t in order}
    meta = index.metadata.get("safetensors_metadata")
    header, sizes = header_bytes([(t.name, codes[t.name], t.shape) for t in order],
                                 meta if isinstance(meta, dict) else None)
    with open(dest, "xb") as f, TensorSource(index) as source:
        write_all(f, memoryview(header))
        for t in order:
            arr = source.read(t)
            if codes[t.name] != t.dtype:
                arr = cast_array(arr, "BF16", name=t.name)
            write_all(f, memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data))
    return sum(sizes)
