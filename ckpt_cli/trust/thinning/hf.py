"""Thinning a local HF Trainer ``checkpoint-N`` directory (its optimizer file removed; with
``--thin-to bf16`` its safetensors weights cast)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ckpt_cli import storage
from ckpt_cli.errors import CkptError
from ckpt_cli.storage.atomic import fsync_path
from ckpt_cli.trust.thinning import base
from ckpt_cli.trust.thinning.base import (
    HF_OPTIMIZER_FILES,
    OnStart,
    Thinned,
    _newest_ns,
    _work_name,
    quick_check,
)


def _thin_hf_dir(path: Path, to: str | None, on_start: OnStart) -> Thinned | None:
    """An HF Trainer ``checkpoint-N``.

    Without ``to``: its optimizer file is removed (one ``unlink`` each, so a crash leaves it
    with or without that file, complete either way: the Trainer resumes with a fresh optimizer
    when the file is absent). With ``to="bf16"``: a copy of the directory is built beside it
    (unchanged files hard-linked, the ``model*.safetensors`` weights cast to BF16 with
    :mod:`ckpt_cli.tensors.cast`, ``config.json``'s dtype and the index's ``total_size`` updated, no
    optimizer file) and swapped in with one atomic exchange.
    """
    from ckpt_cli.runs import tree_scan

    victims = [n for n in HF_OPTIMIZER_FILES
               if (path / n).is_file() and not (path / n).is_symlink()]
    if not victims:
        return None
    bytes_before = tree_scan(path).bytes
    problem = quick_check(path)
    if problem:
        raise CkptError(f"does not validate ({problem}); left whole", path=path)
    if to == "bf16":
        return _hf_to_bf16(path, victims, on_start, bytes_before)
    on_start(victims, None, bytes_before)
    algorithm = base._set_manifest_aside(path)
    for n in victims:
        os.unlink(path / n)
    fsync_path(path)
    digest = base._manifest_again(path, algorithm)
    return Thinned(path, victims, None, bytes_before, tree_scan(path).bytes, digest)


def _hf_to_bf16(path: Path, victims: list[str], on_start: OnStart,
                bytes_before: int) -> Thinned:
    import json

    from ckpt_cli.manifest import MANIFEST_NAME

    newest = _newest_ns(path)
    children = list(path.iterdir())
    if any(c.is_symlink() or not c.is_file() for c in children):
        raise CkptError("holds links or subdirectories; --thin-to bf16 leaves it whole",
                        path=path)
    weights = [c for c in children if c.name.startswith("model")
               and c.name.endswith(".safetensors")]
    if not weights:
        raise CkptError("no model*.safetensors weights to cast; left whole", path=path)
    if any(c.name.endswith((".bin", ".pt", ".pth")) and "model" in c.name for c in children):
        raise CkptError("holds torch-pickle weights beside safetensors; --thin-to bf16 casts "
                        "only safetensors and leaves it whole", path=path)
    tmp = _work_name(path)
    tmp.mkdir(mode=path.stat().st_mode & 0o7777)
    try:
        sizes: dict[str, int] = {}
        for c in children:
            if c.name in victims or c.name == MANIFEST_NAME:
                continue
            if c in weights:
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
                try:
                    os.link(c, tmp / c.name)  # unchanged: shared, not copied
                except OSError:
                    shutil.copy2(c, tmp / c.name)
        for c in children:
            if c.name.endswith(".safetensors.index.json") and c.name.startswith("model"):
                doc = storage.load_side_json(c, "index")
                if isinstance(doc.get("metadata"), dict) and "total_size" in doc["metadata"]:
                    doc["metadata"]["total_size"] = sum(sizes.values())
                (tmp / c.name).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
                shutil.copystat(c, tmp / c.name)
            elif c.name.endswith(".safetensors.index.json"):
                os.link(c, tmp / c.name)
        return base._swap_in(path, tmp, on_start, victims, "bf16", bytes_before, newest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _safetensors_to_bf16(src: Path, dest: Path) -> int:
    """Write ``src`` to ``dest`` with its FP32/FP16/FP64 tensors cast to BF16 (one tensor in
    memory at a time); returns the bytes of tensor data written."""
    import numpy as np

    from ckpt_cli.formats import read_index
    from ckpt_cli.tensors.cast import cast_array
    from ckpt_cli.tensors.source import TensorSource
    from ckpt_cli.writers.safetensors import header_bytes, write_all

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
