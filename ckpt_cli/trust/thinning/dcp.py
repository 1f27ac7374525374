"""Thinning a local torch.distributed.checkpoint (DCP) directory, and reading what a DCP
checkpoint keeps when thinned (also for a DCP prefix on object storage)."""

from __future__ import annotations

import io
import shutil
import warnings
from pathlib import Path
from typing import Any

from ckpt_cli import dtypes, storage
from ckpt_cli.errors import CkptError
from ckpt_cli.formats import read_index
from ckpt_cli.formats.dcp import metadata_file, parse_metadata, storage_map
from ckpt_cli.formats.names import MANIFEST_NAME
from ckpt_cli.runs import tree_scan
from ckpt_cli.storage import open_regular, read_full
from ckpt_cli.tensors.cast import cast_array
from ckpt_cli.tensors.source import TensorSource
from ckpt_cli.trust.thinning import base
from ckpt_cli.trust.thinning.base import (
    OPTIMIZER_KEYS,
    WEIGHT_KEYS,
    OnStart,
    Thinned,
    _newest_ns,
    _work_name,
    quick_check,
)

# loops): their floating tensors are never cast by --thin-to.
NOT_WEIGHTS = ("lr_scheduler", "lr_schedulers", "scheduler", "dataloader", "train_state",
               "rng", "rng_state", "rng_states", "extra_state", "loops", "callbacks", "trainer")


def _tree_path(fqn: str, planner: dict[Any, Any]) -> tuple[Any, ...]:
    """Where an item sat in the saved state dict (DCP's ``planner_data``), keys as saved."""
    p = planner.get(fqn)
    if isinstance(p, tuple) and p and all(isinstance(k, str | int) for k in p) and (
            ".".join(str(k) for k in p) == fqn):
        return p
    return tuple(fqn.split("."))


def _put(tree: dict[Any, Any], path: tuple[Any, ...], value: Any) -> None:
    node = tree
    for k in path[:-1]:
        nxt = node.setdefault(k, {})
        if not isinstance(nxt, dict):
            raise CkptError(f"items {'.'.join(map(str, path))!r} and a parent of it both hold "
                            "values; left whole")
        node = nxt
    node[path[-1]] = value


def _is_state_item(p: tuple[Any, ...]) -> bool:
    """Whether an item of a DCP checkpoint is an optimizer's per-parameter state: under a
    top-level key named like an optimizer, ``state`` one or two levels below (an optimizer, or
    a list or dict of them), or flattened into ``state.*`` keys. Its ``param_groups`` (the
    hyperparameters: lr, betas, weight decay...) are not."""
    if not (isinstance(p[0], str) and p[0] in OPTIMIZER_KEYS):
        return False
    for x in p[1:3]:
        # torch's get_state_dict(flatten_optimizer_state_dict=True), as torchtitan saves it,
        # keys the optimizer's entries "state.<param>.exp_avg" and "param_groups.<param>.lr".
        if isinstance(x, str) and (x == "param_groups" or x.startswith("param_groups.")):
            return False
        if isinstance(x, str) and (x == "state" or x.startswith("state.")):
            return True
    return False


def _dcp_optimizer_tops(paths: list[tuple[Any, ...]]) -> list[str]:
    """Top-level keys of a DCP checkpoint that hold optimizer state (:func:`_is_state_item`);
    none when its optimizers hold only their ``param_groups`` (fresh, or thinned already)."""
    tops = {p[0] for p in paths if _is_state_item(p)}
    return [k for k in OPTIMIZER_KEYS if k in tops]


def _thin_dcp_dir(path: Path, to: str | None, on_start: OnStart) -> Thinned | None:
    """A torch.distributed.checkpoint directory: read with ckpt's own reader (never unpickling
    anything but tensors and plain values, ``weights_only``), what is kept saved again with
    DCP's own writer (no process group) into a trash-named sibling directory, swapped in."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter  # heavy: torch
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save  # heavy: torch

    newest = _newest_ns(path)
    picked = _dcp_thinned_state(path, to)
    if picked is None:
        return None
    state, dropped, others, bytes_before, _meta = picked
    tmp = _work_name(path)
    tmp.mkdir(mode=path.stat().st_mode & 0o7777)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP warns that no process group is running
            dcp_save(state, storage_writer=FileSystemWriter(str(tmp)), no_dist=True)
        for c in others:  # files beside DCP's (e.g. Megatron's metadata.json): kept as they are
            shutil.copy2(c, tmp / c.name)
        return base._swap_in(path, tmp, on_start, dropped, to, bytes_before, newest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _dcp_thinned_state(path: Path, to: str | None
                       ) -> tuple[dict[Any, Any], list[str], list[Path], int, Path] | None:
    """What thinning keeps of a DCP checkpoint (local or on object storage), read with ckpt's
    own reader: ``(the state dict to save, top-level keys dropped, files beside DCP's, bytes
    before, its metadata file)``, or None when it holds no optimizer state. The optimizers'
    ``param_groups`` are kept, as a fresh optimizer saves them (an empty ``state`` saves no
    item), so ``dcp.load`` into a fresh optimizer's ``state_dict()`` restores its learning
    rate.

    The kept tensors are held in memory (one copy, cast when ``to`` says so): the weights and
    training metadata, about a third of an Adam checkpoint (a sixth with ``bf16``)."""
    import torch  # heavy: torch

    meta = metadata_file(path)
    if meta is None:
        raise CkptError("its .metadata is gone; left as it is", path=path)
    problem = quick_check(path)
    if problem:
        raise CkptError(f"does not validate ({problem}); left whole", path=path)
    bytes_before = tree_scan(path).bytes
    fields, _ = parse_metadata(meta)
    raw_planner = fields.get("planner_data")
    planner: dict[Any, Any] = raw_planner if isinstance(raw_planner, dict) else {}
    items = {str(k): v for k, v in fields["state_dict_metadata"].items()}
    paths = {fqn: _tree_path(fqn, planner) for fqn in items}
    dropped = _dcp_optimizer_tops(list(paths.values()))
    if not dropped:
        return None
    others = [c for c in path.iterdir()
              if c.name not in (meta.name, MANIFEST_NAME) and not c.name.endswith(".distcp")]
    if any(c.is_symlink() or not c.is_file() for c in others):
        raise CkptError("holds more than DCP's files (a link or a directory); left whole",
                        path=path)
    index = read_index(path)
    # The optimizers' kept param_groups are never weights, to cast.
    tops = {p[0] for fqn, p in paths.items() if p[0] not in dropped
            and p[0] not in OPTIMIZER_KEYS}
    weight_tops = {k for k in tops if k in WEIGHT_KEYS} or {k for k in tops
                                                           if k not in NOT_WEIGHTS}
    where = storage_map(fields.get("storage_data"), path, meta)
    state: dict[Any, Any] = {}
    try:
        with TensorSource(index) as src:
            for fqn, t in index.tensors.items():
                p = paths.get(fqn, tuple(fqn.split(".")))
                if _is_state_item(p):
                    continue
                arr, code = src.read(t), t.dtype
                if (to == "bf16" and p[0] in weight_tops and code in ("F32", "F64", "F16")):
                    arr, code = cast_array(arr, "BF16", name=fqn), "BF16"
                _put(state, p, dtypes.to_torch(arr, code))
        for fqn, md in items.items():
            p = paths[fqn]
            if _is_state_item(p) or fqn in index.tensors:
                continue
            if not getattr(md, "qualname", "").endswith("BytesStorageMetadata"):
                raise CkptError(f"item {fqn!r} is neither a tensor nor bytes; left whole")
            rel, off, length, _tr = where[(fqn, None)]
            buf = bytearray(length)
            fd = open_regular(path / rel)
            try:
                if read_full(fd, off, memoryview(buf)) != length:
                    raise CkptError(f"item {fqn!r} is cut short; left whole", path=path)
            finally:
                storage.close(fd)
            try:
                value = torch.load(io.BytesIO(bytes(buf)), map_location="cpu",
                                   weights_only=True)
            except Exception as e:  # any reader failure means: leave it whole
                raise CkptError(f"item {fqn!r} cannot be read without executing code from it "
                                f"({type(e).__name__}); left whole", path=path) from None
            _put(state, p, value)
    except KeyError:  # a dtype torch has no name for (F4, F6)
        raise CkptError("holds a tensor torch cannot represent; left whole", path=path) \
            from None
    return state, dropped, others, bytes_before, meta
