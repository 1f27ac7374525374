"""Thinning on object storage, which has no rename: a torch file object replaced with one
upload, an HF prefix's optimizer object replaced by one without its state, DCP and HF
``--thin-to bf16`` prefixes by new objects first and the commit record that names them last
(:func:`tidy` removes what a kill left)."""

from __future__ import annotations

import dataclasses
import io
import json
import re
import tempfile
import uuid
import warnings
from pathlib import Path
from typing import Any, cast

from ckpt_cli import storage
from ckpt_cli.errors import CkptError
from ckpt_cli.formats import read_index
from ckpt_cli.formats.dcp import METADATA, metadata_file, parse_metadata, storage_map
from ckpt_cli.formats.names import MANIFEST_NAME
from ckpt_cli.runs import tree_scan
from ckpt_cli.trust.thinning import base
from ckpt_cli.trust.thinning.base import (
    HF_OPTIMIZER_FILES,
    OnStart,
    Thinned,
    _drop_optimizer,
    _is_dcp,
    _optimizer_file_without_state,
    lone_torch_file,
    quick_check,
)
from ckpt_cli.trust.thinning.dcp import _dcp_thinned_state
from ckpt_cli.trust.thinning.hf import _safetensors_to_bf16


def _thin_remote(path: Path, to: str | None, on_start: OnStart) -> Thinned | None:
    """A checkpoint on object storage. S3 has no rename, but a PUT (or a multipart upload's
    completion) replaces an object whole, and a DELETE removes one: each object changes in one
    step, never showing half-written bytes."""
    if path.is_dir():
        if (path / "trainer_state.json").is_file():
            return _thin_hf_prefix(path, to, on_start)
        if _is_dcp(path):
            return _thin_dcp_prefix(path, to, on_start)
        inner = lone_torch_file(path)
        if inner is None:
            raise CkptError("it changed while being thinned; left as it is", path=path)
        return _thin_object(inner, to, on_start, path)
    return _thin_object(path, to, on_start, path)


def _thin_object(obj: Path, to: str | None, on_start: OnStart, checkpoint: Path
                 ) -> Thinned | None:
    """One torch file object: read whole, thinned in memory, validated from a local temporary
    copy, and stored over the original with one upload (which replaces it atomically)."""
    import torch  # heavy: torch

    before = obj.stat()
    try:
        state = torch.load(io.BytesIO(obj.read_bytes()), map_location="cpu", weights_only=True)
    except CkptError:
        raise
    except Exception as e:  # any reader failure means: leave it whole
        raise CkptError(f"cannot be read without executing code from it ({type(e).__name__}); "
                        "left whole", path=obj) from None
    if not isinstance(state, dict):
        raise CkptError("not a dict of training state; left whole", path=obj)
    picked = _drop_optimizer(state, to)
    if picked is None:
        return None
    thin, dropped = picked
    del state
    out = io.BytesIO()
    torch.save(thin, out)
    data = out.getvalue()
    with tempfile.TemporaryDirectory(prefix="ckpt-thin-") as td:
        local = Path(td) / obj.name
        local.write_bytes(data)
        problem = quick_check(local)
    if problem:
        raise CkptError(f"the thinned copy does not validate ({problem}); left whole",
                        path=checkpoint)
    bytes_before = tree_scan(checkpoint).bytes
    cast(storage.ObjectPath, obj).store.changed()  # as it is now, not as listed
    now = obj.stat()
    if (now.st_size, now.st_mtime) != (before.st_size, before.st_mtime):
        raise CkptError("it changed while being thinned; left as it is", path=checkpoint)
    on_start(dropped, to, bytes_before)
    algorithm = base._set_manifest_aside(checkpoint)
    obj.write_bytes(data)  # one upload: the key holds the original or the thinned object
    digest = base._manifest_again(checkpoint, algorithm)
    return Thinned(checkpoint, dropped, to, bytes_before, tree_scan(checkpoint).bytes, digest)


def _thin_hf_prefix(path: Path, to: str | None, on_start: OnStart) -> Thinned | None:
    """An HF Trainer ``checkpoint-N`` prefix: its optimizer object replaced by one without its
    per-parameter state (one PUT; its ``param_groups`` kept, see
    :func:`ckpt_cli.trust.thinning.hf._thin_hf_dir`); with ``to="bf16"`` its weights cast too
    (see :func:`_hf_prefix_to_bf16`)."""
    tidy(path, ours_only=True)  # a killed --thin-to's uploads, never named by the index
    files = [n for n in HF_OPTIMIZER_FILES if (path / n).is_file()]
    if not files:
        return None
    problem = quick_check(path)
    if problem:
        raise CkptError(f"does not validate ({problem}); left whole", path=path)
    thin = {n: d for n in files if (d := _thin_optimizer_object(path / n)) is not None}
    if not thin:
        return None  # thinned already
    victims = sorted(thin, key=HF_OPTIMIZER_FILES.index)
    bytes_before = tree_scan(path).bytes
    if to == "bf16":
        return _hf_prefix_to_bf16(path, thin, victims, on_start, bytes_before)
    on_start(victims, None, bytes_before)
    algorithm = base._set_manifest_aside(path)
    for n in victims:
        (path / n).write_bytes(thin[n])  # one PUT: the original or the thinned object
    cast(storage.ObjectPath, path).store.changed()
    digest = base._manifest_again(path, algorithm)
    return Thinned(path, victims, None, bytes_before, tree_scan(path).bytes, digest)


def _thin_optimizer_object(obj: Path) -> bytes | None:
    """An optimizer object (``optimizer.pt``) saved again without its per-parameter state (its
    ``param_groups`` kept), or None when its state is empty already."""
    import torch  # heavy: torch

    try:
        state = torch.load(io.BytesIO(obj.read_bytes()), map_location="cpu", weights_only=True)
    except Exception as e:  # any reader failure means: leave it whole
        raise CkptError(f"cannot be read without executing code from it ({type(e).__name__}); "
                        "left whole", path=obj) from None
    thin = _optimizer_file_without_state(obj, state)
    if thin is None:
        return None
    out = io.BytesIO()
    torch.save(thin, out)
    return out.getvalue()


# -- DCP and HF prefixes on object storage: new objects, then the one that names them ------------

THIN_TAG = re.compile(r"thin[0-9a-f]{8}")
"""The mark in the names of the objects a thinning on object storage writes beside the
originals (``__thin1a2b3c4d_0_0.distcp``, ``model-00001-of-00002.thin1a2b3c4d.safetensors``):
a fresh random tag each time, so they never collide with an existing object, and an object
carrying one that its checkpoint's ``.metadata`` or index does not name is the leftover of a
thinning killed before it committed (see :func:`tidy`)."""


def _new_tag() -> str:
    return f"thin{uuid.uuid4().hex[:8]}"


def _dcp_writer(directory: Path, prefix: str) -> Any:
    """DCP's own ``FileSystemWriter`` for ``directory`` whose data files are named
    ``<prefix><rank>_<n>.distcp`` instead of ``__<rank>_<n>.distcp``.

    DCP records each item's file in ``.metadata`` (``storage_data``: ``_StorageInfo``'s
    ``relative_path``, the name its writer gave the file) and its reader opens exactly that
    name, so files written under other names need nothing rewritten: the writer's global plan
    carries the name prefix (``prepare_global_plan`` sets ``__<i>_`` per rank), replaced here.
    """
    from torch.distributed.checkpoint.filesystem import FileSystemWriter  # heavy: torch

    class _Named(FileSystemWriter):
        def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
            plans = super().prepare_global_plan(plans)
            return [dataclasses.replace(p, storage_data=type(p.storage_data)(f"{prefix}{i}_"))
                    for i, p in enumerate(plans)]

    return _Named(str(directory))


def _referenced(path: Path) -> set[str] | None:
    """The files a remote checkpoint's commit record names: a DCP ``.metadata``'s data files,
    or an HF index's shards (None: neither can be read)."""

    meta = metadata_file(path)
    try:
        if meta is not None:
            fields, _ = parse_metadata(meta)
            return {v[0] for v in storage_map(fields.get("storage_data"), path, meta).values()}
        idx = [c for c in path.iterdir() if c.name.startswith("model")
               and c.name.endswith(".safetensors.index.json")]
        if len(idx) == 1:
            wm = storage.load_side_json(idx[0], "index").get("weight_map")
            return {str(v) for v in wm.values()} if isinstance(wm, dict) else None
        if (path / "model.safetensors").is_file():
            return {"model.safetensors"}
    except (CkptError, OSError, ValueError):
        return None
    return None


def _unreferenced(path: Path, ours_only: bool) -> list[str]:
    """Data objects of a remote DCP or HF checkpoint that its commit record does not name:
    with ``ours_only`` only those whose name carries a thinning's tag (:data:`THIN_TAG`)."""
    named = _referenced(path)
    if named is None:
        return []
    dcp = metadata_file(path) is not None
    out = []
    for c in path.iterdir():
        data = (c.name.endswith(".distcp") if dcp
                else c.name.startswith("model") and c.name.endswith(".safetensors"))
        if (data and c.name not in named and c.is_file()
                and (not ours_only or THIN_TAG.search(c.name))):
            out.append(c.name)
    return sorted(out)


def tidy(path: Path, *, ours_only: bool = False) -> list[str]:
    """Remove what a thinning on object storage killed midway left in checkpoint ``path``: the
    data objects its ``.metadata`` (DCP) or index (HF) does not name. Before the commit record
    was replaced those are the new ones (tagged, see :data:`THIN_TAG`); after, the originals.
    ``prune`` calls it for a checkpoint whose newest ledger line is a pending thinning (see
    :func:`pending`); with ``ours_only`` only tagged objects go, which nothing but a thinning
    writes. A no-op on local checkpoints (their thinning leaves a trash-named directory, which
    prune removes). Returns the names removed."""
    if storage.can_rename_atomically(path) or not path.is_dir():
        return []
    gone = _unreferenced(path, ours_only)
    if gone:
        algorithm = base._set_manifest_aside(path)  # a watch pass may have listed them in it
        store = cast(storage.ObjectPath, path).store
        store.delete([cast(storage.ObjectPath, path / n).key for n in gone])
        base._manifest_again(path, algorithm)
    return gone


def _upload_file(local: Path, dest: Path) -> None:
    """Stream a local file to the object ``dest`` (one object appearing whole at the end: a
    PUT, or a multipart upload's completion), 8 MiB read at a time."""
    size = local.stat().st_size
    with open(local, "rb") as f, storage.Upload(cast(storage.ObjectPath, dest),
                                                expected=size) as up:
        while chunk := f.read(8 << 20):
            up.write(chunk)


def _put_commit(dest: Path, data: bytes) -> None:
    """Store a checkpoint's commit record (DCP ``.metadata``, an HF index or a lone
    ``model.safetensors``) with one upload: the step at which the thinned checkpoint replaces
    the original."""
    dest.write_bytes(data)


def _delete_old(path: Path, names: list[str]) -> None:
    """Delete the original objects the replaced commit record no longer names."""
    if names:
        cast(storage.ObjectPath, path).store.delete(
            [cast(storage.ObjectPath, path / n).key for n in sorted(set(names))])


def _unchanged(path: Path, before: dict[str, tuple[int, float]]) -> bool:
    cast(storage.ObjectPath, path).store.changed()  # as it is now, not as listed
    return _sizes(path) == before


def _sizes(path: Path) -> dict[str, tuple[int, float]]:
    out = {}
    for c in path.iterdir():
        if c.name != MANIFEST_NAME and c.is_file():
            st = c.stat()
            out[c.name] = (st.st_size, st.st_mtime)
    return out


def _thin_dcp_prefix(path: Path, to: str | None, on_start: OnStart) -> Thinned | None:
    """A DCP checkpoint on object storage, which has no rename.

    The thinned checkpoint is saved by DCP's own writer into a local temporary directory, its
    data files named with a fresh tag (``__thin1a2b3c4d_0_0.distcp``, see :func:`_dcp_writer`;
    DCP's ``.metadata`` names them itself), validated there, and uploaded beside the original
    files (streamed from disk, one object at a time). Then ``.metadata`` is replaced with one
    PUT, and the original data files are deleted. At every moment the prefix loads: before
    the PUT the old ``.metadata`` names the old files, after it the new one names the new
    files. A kill in between leaves objects the ``.metadata`` does not name; the next prune
    removes them (:func:`tidy`) and finishes the thinning.
    """
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save  # heavy: torch

    tidy(path, ours_only=True)  # a killed thinning's uploads, never named by .metadata
    before = _sizes(path)
    picked = _dcp_thinned_state(path, to)
    if picked is None:
        return None
    state, dropped, _others, bytes_before, meta = picked
    if meta.name != METADATA:
        raise CkptError(f"its metadata is {meta.name}, not {METADATA}; left whole", path=path)
    old = sorted(_referenced(path) or ())
    tag = _new_tag()
    with tempfile.TemporaryDirectory(prefix="ckpt-thin-") as td:
        local = Path(td) / "dcp"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP warns that no process group is running
            dcp_save(state, storage_writer=_dcp_writer(local, f"__{tag}_"), no_dist=True)
        del state
        files = sorted(c.name for c in local.iterdir() if c.name != METADATA)
        if not files or any(not (n.startswith(f"__{tag}_") and n.endswith(".distcp"))
                            for n in files) or any(n in before for n in files):
            raise CkptError("DCP's writer did not name its files as asked; left whole",
                            path=path)
        problem = quick_check(local)
        if problem:
            raise CkptError(f"the thinned copy does not validate ({problem}); left whole",
                            path=path)
        if not _unchanged(path, before):
            raise CkptError("it changed while being thinned; left as it is", path=path)
        on_start(dropped, to, bytes_before)
        algorithm = base._set_manifest_aside(path)
        for n in files:
            _upload_file(local / n, path / n)
        _put_commit(path / METADATA, (local / METADATA).read_bytes())
    _delete_old(path, [n for n in old if n not in files])
    cast(storage.ObjectPath, path).store.changed()
    digest = base._manifest_again(path, algorithm)
    return Thinned(path, dropped, to, bytes_before, tree_scan(path).bytes, digest)


def _hf_prefix_to_bf16(path: Path, thin: dict[str, bytes], victims: list[str],
                       on_start: OnStart, bytes_before: int) -> Thinned:
    """``--thin-to bf16`` on an HF ``checkpoint-N`` prefix on object storage.

    Sharded (``model.safetensors.index.json``): each shard is cast into a local temporary file
    and uploaded under a new, tagged name (``model-00001-of-00002.thin1a2b3c4d.safetensors``),
    then ``config.json``'s dtype is stored, then the index naming the new shards (one PUT: the
    step at which loaders see the BF16 weights), then the optimizer object is replaced by its
    thinned copy (``thin``) and the old shards are deleted. A lone ``model.safetensors``:
    replaced by one upload (after ``config.json``), then the optimizer object. Before the index
    (or the weights) is replaced the checkpoint loads as it was; after, as thinned; a kill in
    between leaves shards the index does not name, which the next prune removes (:func:`tidy`)
    before finishing the work.
    """
    children = list(path.iterdir())
    if any(not c.is_file() for c in children):
        raise CkptError("holds sub-prefixes; `thin_to=bf16` leaves it whole", path=path)
    if any(c.name.endswith((".bin", ".pt", ".pth")) and "model" in c.name for c in children):
        raise CkptError("holds torch-pickle weights beside safetensors; `thin_to=bf16` casts "
                        "only safetensors and leaves it whole", path=path)
    idxs = [c for c in children if c.name.startswith("model")
            and c.name.endswith(".safetensors.index.json")]
    if len(idxs) > 1:
        raise CkptError("holds more than one weights index; left whole", path=path)
    named = _referenced(path)
    weights = [c for c in children if c.name.startswith("model")
               and c.name.endswith(".safetensors") and named is not None and c.name in named]
    if not weights or (not idxs and [w.name for w in weights] != ["model.safetensors"]):
        raise CkptError("no model*.safetensors weights (named by an index, or a lone "
                        "model.safetensors) to cast; left whole", path=path)
    before = _sizes(path)
    infos = {w.name: read_index(w) for w in weights}
    wide = ("F32", "F64", "F16")
    to_cast = [w for w in weights if any(t.dtype in wide for t in infos[w.name].tensors.values())]
    if not to_cast:  # cast already (a killed thinning committed its index): the optimizer goes
        on_start(victims, "bf16", bytes_before)
        algorithm = base._set_manifest_aside(path)
        for n in victims:
            (path / n).write_bytes(thin[n])
        digest = base._manifest_again(path, algorithm)
        return Thinned(path, victims, "bf16", bytes_before, tree_scan(path).bytes, digest)
    tag = _new_tag()
    renamed = {w.name: (f"{w.name[:-len('.safetensors')]}.{tag}.safetensors" if idxs
                        else w.name) for w in to_cast}
    with tempfile.TemporaryDirectory(prefix="ckpt-thin-") as td:
        local = Path(td)
        total = 0
        for w in weights:
            if w.name in renamed:
                out = local / renamed[w.name]
                total += _safetensors_to_bf16(w, out)
                problem = quick_check(out)
                if problem:
                    raise CkptError(f"the cast copy of {w.name} does not validate ({problem}); "
                                    "left whole", path=path)
            else:
                total += sum(t.nbytes for t in infos[w.name].tensors.values())
        config: bytes | None = None
        if (path / "config.json").is_file():
            cfg = storage.load_side_json(path / "config.json", "config")
            if isinstance(cfg, dict):
                for k in [k for k in ("torch_dtype", "dtype") if k in cfg] or ["torch_dtype"]:
                    cfg[k] = "bfloat16"
                config = (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode()
        index: bytes | None = None
        if idxs:
            doc = storage.load_side_json(idxs[0], "index")
            doc["weight_map"] = {k: renamed.get(v, v) for k, v in doc["weight_map"].items()}
            if isinstance(doc.get("metadata"), dict) and "total_size" in doc["metadata"]:
                doc["metadata"]["total_size"] = total
            index = (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()
        if not _unchanged(path, before):
            raise CkptError("it changed while being thinned; left as it is", path=path)
        on_start(victims, "bf16", bytes_before)
        algorithm = base._set_manifest_aside(path)
        if idxs:
            for n in renamed.values():
                _upload_file(local / n, path / n)
        if config is not None:
            (path / "config.json").write_bytes(config)  # one PUT
        if index is not None:
            _put_commit(idxs[0], index)
        else:
            _upload_file(local / "model.safetensors", path / "model.safetensors")
    for n in victims:  # after the commit: a kill before it leaves the optimizer whole
        (path / n).write_bytes(thin[n])
    _delete_old(path, [n for n in renamed if n not in renamed.values()])
    cast(storage.ObjectPath, path).store.changed()
    digest = base._manifest_again(path, algorithm)
    return Thinned(path, victims, "bf16", bytes_before, tree_scan(path).bytes, digest)
