"""``convert --to dcp --part K/N``: one DCP directory written by N processes that do not talk to
each other, as an N-rank ``dcp.save`` writes it.

Every part lays out the same training state and deals its tensors to parts by size
(:func:`ckpt_cli.parts.assign`; the non-tensor values go to part 1). Part K saves its share as
a DCP directory of its own, ``part-0000K`` in the staging directory the parts share
(:func:`ckpt_cli.parts.staging_dir`, built and renamed into place like any output), and leaves a
receipt naming its files and their sizes. Whoever finds every receipt there (the last part to
finish, or ``--finalize``) merges, under the staging lock: each part's ``__0_<n>.distcp`` files
become ``__<K-1>_<n>.distcp`` (the names rank K-1 of a distributed save gives them) in one
directory, and ``.metadata`` is written for the whole: the state dict's metadata planned by
DCP's own planner over the whole layout (shapes only, nothing read), and where each item lies
taken from the parts' ``.metadata`` files, read by ckpt's allowlisting unpickler (no code from a
file runs). Every item the plan has must be found in exactly the part that was to write it;
then the directory is fsynced and renamed into place, ``.metadata`` included, and the staging
directory removed. Until then nothing at the destination looks like a checkpoint.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ckpt_cli import dtypes
from ckpt_cli.errors import DestinationExistsError, UsageError
from ckpt_cli.formats.dcp import parse_metadata, storage_map
from ckpt_cli.model import WrittenFile
from ckpt_cli.ops.to_dcp.state import LazyTensor
from ckpt_cli.ops.to_dcp.writer import count_tensors, write_dcp
from ckpt_cli.parts import (
    Part,
    PartOutcome,
    PartsIncompleteError,
    PartStore,
    assign,
    describe_parts,
    fingerprint,
    staged_count,
    staging_dir,
)
from ckpt_cli.storage.atomic import (
    check_destination,
    fsync_path,
    fsync_tree,
    rename_onto,
    replace_dir,
)
from ckpt_cli.storage.objectpath import ObjectPath
from ckpt_cli.writers import WriteResult

OUT = "out"
_FILE = re.compile(r"\A__0_(\d+)\.distcp\Z")


def _leaves(tree: Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """Every leaf of a layout (dicts are walked; anything else is a leaf), in order."""
    if isinstance(tree, dict) and not isinstance(tree, LazyTensor):
        out: list[tuple[tuple[str, ...], Any]] = []
        for k, v in tree.items():
            out += _leaves(v, (*path, str(k)))
        return out
    return [(path, tree)]


def _nbytes(lz: LazyTensor) -> int:
    return dtypes.nbytes_of(lz.dtype, int(np.prod(lz.shape, dtype=np.int64)))


def _owners(leaves: list[tuple[tuple[str, ...], Any]], count: int) -> list[int]:
    """Which part writes each leaf: tensors dealt by size, every other value in part 1."""
    tensors = [i for i, (_, v) in enumerate(leaves) if isinstance(v, LazyTensor)]
    dealt = assign([_nbytes(leaves[i][1]) for i in tensors], count)
    owner = [1] * len(leaves)
    for i, p in zip(tensors, dealt, strict=True):
        owner[i] = p
    return owner


def _subtree(leaves: list[tuple[tuple[str, ...], Any]], owner: list[int],
             k: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for (path, v), p in zip(leaves, owner, strict=True):
        if p != k:
            continue
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = v
    return out


def _plan_id(leaves: list[tuple[tuple[str, ...], Any]], count: int, dest: Path,
             source_id: Any) -> str:
    shape = [(".".join(p), v.dtype, list(v.shape)) if isinstance(v, LazyTensor)
             else (".".join(p), repr(v)) for p, v in leaves]
    return fingerprint({"dcp": shape, "parts": count, "dest": dest.name, "source": source_id})


def check_part_output(out: Path) -> None:
    """Refuse a split job's output on object storage, before anything is read.

    Raises:
        UsageError: ``out`` is on object storage (the parts' receipts and lock need a shared
            file system).
    """
    if isinstance(out, ObjectPath):
        raise UsageError("part needs a local (shared) output directory for its receipts; a "
                         "DCP output on object storage is written by one process for now",
                         param="part")


def write_dcp_part(tree: dict[str, Any], out: Path, *, part: Part | None, finalize: bool,
                   source_id: Any, overwrite: bool = False,
                   on_progress: Callable[[int], None] | None = None,
                   on_start: Callable[[int], None] | None = None) -> WriteResult:
    """Write this process's part of a DCP directory, and finalize it when every part is done.

    Args:
        tree: The layout (:func:`ckpt_cli.ops.to_dcp.writer.layout_state`), the same in
            every part.
        out: The directory to create (local: the parts meet in a staging directory beside it).
        part: This process's part, or None to only finalize.
        finalize: Finalize now; parts missing are an error naming them.
        source_id: What identifies the source (part of the plan: parts of a changed source
            never mix).
        overwrite: Replace an existing ``out`` (at finalize).
        on_progress: Called with tensor bytes as each of this part's tensors is written.
        on_start: Called once with this part's tensor bytes.

    Returns:
        What this process wrote (``part``: what it did of the job).

    Raises:
        UsageError: ``out`` is on object storage (the parts' receipts need a shared file
            system).
        DestinationExistsError: ``out`` exists and ``overwrite`` is False.
        PartsIncompleteError: Parts of another plan are staged; finalizing with parts
            missing, or a part's files not what the plan gives it.
    """

    check_part_output(out)
    if (out.exists() or out.is_symlink()) and not overwrite:
        raise DestinationExistsError("already exists", path=out,
                                     hint="pass force to replace it (every part the same)",
                                     param="force")
    check_destination(out, kind="dir", overwrite=overwrite, parents=True)
    leaves = _leaves(tree)
    root = staging_dir(out)
    count = part.count if part else staged_count(root, out)
    owner = _owners(leaves, count)
    store = PartStore(root, _plan_id(leaves, count, out, source_id), count, what=str(out))
    outcome = PartOutcome(part, count, [])
    result = WriteResult(out, part=outcome)
    if part is not None:
        store.join()
        mine = _subtree(leaves, owner, part.index)
        files: list[list[Any]] = []
        if mine:
            staged = write_dcp(mine, root / _part_dir(part.index), overwrite=True,
                               on_progress=on_progress, on_start=on_start)
            files = [[f.path, f.bytes] for f in staged.files]
            result.files = list(staged.files)
            result.tensors, result.tensor_bytes = staged.tensors, staged.tensor_bytes
            outcome.files = [f.path for f in staged.files]
        elif on_start is not None:
            on_start(0)
        store.write_receipt(part.index, {"files": files})
    try:
        with store.lock():
            _settle(store, tree, leaves, owner, out, overwrite, finalize or part is None,
                    outcome, result)
    except FileNotFoundError:
        # The staging directory went while we waited for its lock: another part finalized.
        if not (out.exists() and not root.exists()):
            raise
        outcome.finalized = True
    if outcome.finalized_here:
        tensors = count_tensors(tree)
        result.tensors = len(tensors)
        result.tensor_bytes = sum(dtypes.nbytes_of(d, int(np.prod(s, dtype=np.int64)))
                                  for d, s in tensors.values())
    return result


def _part_dir(k: int) -> str:
    return f"part-{k:05d}"



def _settle(store: PartStore, tree: dict[str, Any], leaves: list[tuple[tuple[str, ...], Any]],
            owner: list[int], out: Path, overwrite: bool, must: bool, outcome: PartOutcome,
            result: WriteResult) -> None:
    """Under the lock: finalize if every receipt is there, else say what is missing."""
    recorded = store.recorded_plan()
    if recorded is not None and recorded.get("plan") != store.plan_id:
        store.join()  # raises, naming both plans
    if recorded is None:
        if not out.exists():
            raise PartsIncompleteError(
                "the staging directory was removed while the parts ran; nothing was finalized",
                path=store.root, hint="run every part again")
        shutil.rmtree(store.root, ignore_errors=True)  # finalized by another part
        outcome.finalized = True
        return
    receipts = store.receipts()
    missing = store.missing(receipts)
    if missing:
        outcome.waiting_for = missing
        if must:
            raise store.incomplete(missing)
        return
    out_dir = store.root / OUT
    shutil.rmtree(out_dir, ignore_errors=True)  # a finalize that died half-way
    out_dir.mkdir()
    storage_data = _merge(store, receipts, out_dir)
    metadata = _metadata(tree, storage_data, out, store)
    with open(out_dir / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    fsync_tree(out_dir)
    written = sorted(((p.name, p.stat().st_size) for p in out_dir.iterdir()),
                     key=lambda x: (x[0] == ".metadata", x[0]))
    replace_dir(out_dir, out, overwrite)
    shutil.rmtree(store.root, ignore_errors=True)
    fsync_path(out.parent)
    result.files = [WrittenFile(n, b) for n, b in written]
    result.index_file = ".metadata"
    outcome.finalized = outcome.finalized_here = True


def _merge(store: PartStore, receipts: dict[int, dict[str, Any]], out_dir: Path
           ) -> dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]]:
    """Move every part's files into ``out_dir`` under their rank's names; where each item
    lies, from the parts' ``.metadata`` files (read safely)."""

    where: dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]] = {}
    for k in sorted(receipts):
        listed = receipts[k].get("files", [])
        pdir = store.root / _part_dir(k)
        if not listed:
            continue
        sizes = {e[0]: e[1] for e in listed if isinstance(e, list) and len(e) == 2}
        problem = None
        if ".metadata" not in sizes or len(sizes) != len(listed):
            problem = "its receipt lists no .metadata"
        for name, size in sizes.items():
            p = pdir / name
            if not p.is_file() or p.stat().st_size != size:
                problem = f"{name} is missing or not the size its receipt gives"
        if problem is None:
            fields, _ = parse_metadata(pdir / ".metadata")
            items = storage_map(fields.get("storage_data"), pdir, pdir / ".metadata")
            renames: dict[str, str] = {}
            for name in sizes:
                m = _FILE.match(name)
                if m:
                    renames[name] = f"__{k - 1}_{m.group(1)}.distcp"
                elif name != ".metadata":
                    problem = f"{name} is not a file a DCP save writes"
            for key, (rel, off, length, transforms) in items.items():
                if rel not in renames or transforms:
                    problem = f"its .metadata places {key[0]!r} in {rel}, not a file it wrote"
                    break
                if key in where:
                    problem = f"{key[0]!r} is written by another part too"
                    break
                where[key] = (renames[rel], off, length)
        if problem is not None:
            raise PartsIncompleteError(
                f"cannot finalize {store.what}: part {k} did not write what the plan gives "
                f"({problem})", path=store.root,
                hint="rerun that part with the same options, then finalize", param="finalize")
        for old, new in renames.items():
            rename_onto(pdir / old, out_dir / new, overwrite=False)
    return where


def _metadata(tree: dict[str, Any], where: dict[tuple[str, tuple[int, ...] | None],
                                                tuple[str, int, int]],
              out: Path, store: PartStore) -> Any:
    """DCP's ``Metadata`` of the whole layout: planned by DCP's planner over shape-only
    tensors, each item placed where a part wrote it."""

    import torch  # heavy: torch
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner  # heavy: torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo  # heavy: torch
    from torch.distributed.checkpoint.metadata import StorageMeta  # heavy: torch
    from torch.distributed.checkpoint.planner import WriteItemType  # heavy: torch

    def placeholders(node: Any) -> Any:
        if isinstance(node, LazyTensor):
            return torch.empty(node.shape, dtype=dtypes.torch_dtype(node.dtype), device="meta")
        if isinstance(node, dict):
            return {k: placeholders(v) for k, v in node.items()}
        return node

    planner = DefaultSavePlanner()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planner.set_up_planner(placeholders(tree), storage_meta=None, is_coordinator=True)
        plans, metadata = planner.create_global_plan([planner.create_local_plan()])
    storage: dict[Any, Any] = {}
    missing: list[str] = []
    for item in plans[0].items:
        at = item.index.offset
        offsets = (None if item.type == WriteItemType.BYTE_IO or at is None
                   else tuple(int(x) for x in at))
        found = where.pop((item.index.fqn, offsets), None)
        if found is None:
            missing.append(item.index.fqn)
            continue
        storage[item.index] = _StorageInfo(found[0], found[1], found[2])
    if missing or where:
        extra = sorted(k[0] for k in where)
        raise PartsIncompleteError(
            f"cannot finalize {store.what}: the parts' files do not hold the plan's items "
            f"({len(missing)} missing, e.g. {', '.join(missing[:2]) or '-'}; {len(extra)} not "
            f"planned, e.g. {', '.join(extra[:2]) or '-'}): parts of "
            f"{describe_parts(list(range(1, store.count + 1)))} planned differently",
            path=store.root, hint="rerun every part with the same options", param="finalize")
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION  # heavy: torch

    metadata.version = CURRENT_DCP_VERSION
    metadata.storage_data = storage
    metadata.storage_meta = StorageMeta(checkpoint_id=os.fspath(out), save_id=str(uuid.uuid4()))
    return metadata
