"""Hugging Face sharded checkpoints: ``*.safetensors.index.json``, ``*.bin.index.json``.

The index is ``{"metadata": {"total_size": N, ...}, "weight_map": {tensor: shard}}``. Shard paths
must be relative, stay inside the directory and have the index's extension; every shard's
header is read and checked against the map.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckpt_cli import storage
from ckpt_cli.errors import (
    CheckpointNotFoundError,
    CkptError,
    CorruptCheckpointError,
    UnknownFormatError,
)
from ckpt_cli.formats import provenance, safetensors, torchfile
from ckpt_cli.formats.base import contained_path, file_size, present, read_head, rel_to
from ckpt_cli.formats.ties import find_ties
from ckpt_cli.model import CheckpointIndex, FileInfo, Finding

INDEX_SUFFIXES = (".safetensors.index.json", ".bin.index.json", ".pt.index.json")


def find_index(path: Path) -> Path | None:
    """The index file of a directory (the one ending like an HF index), or None.

    A FIFO or socket by that name counts too (reading it then says what it is): skipping it
    would call the directory something else, or valid.
    """
    found = [p for p in path.iterdir() if p.name.endswith(INDEX_SUFFIXES) and present(p)]
    if len(found) == 1:
        return found[0]
    # Prefer safetensors when a directory holds both exports.
    st = [p for p in found if p.name.endswith(".safetensors.index.json")]
    return st[0] if len(st) == 1 else None


class HFIndexReader:
    """Reads an HF sharded checkpoint (the directory, or its index file)."""

    name = "hf-index"
    is_dir_format = True

    def sniff(self, path: Path) -> str | None:
        """See :meth:`ckpt_cli.formats.base.Reader.sniff`."""
        if path.is_file():
            return None if path.name.endswith(INDEX_SUFFIXES) else "not an *.index.json file"
        if not path.is_dir():
            return "not a file or directory"
        idx = find_index(path)
        if idx is None:
            return "no *.safetensors.index.json in the directory"
        # A training checkpoint directory (sharded weights + optimizer.pt + trainer_state.json)
        # is read whole by the directory reader.
        try:
            named = set(load_index_json(idx)[0].values())
        except CkptError:
            return None  # read_index reports the broken index
        others = [p.name for p in path.iterdir() if p.is_file()
                  and p.name.endswith((".pt", ".pth", ".bin", ".safetensors", ".ckpt"))
                  and p.name not in named]
        if others or (path / "trainer_state.json").is_file():
            return "holds more than the index's shards (a checkpoint directory)"
        return None

    def read_index(self, path: Path) -> CheckpointIndex:
        """See :meth:`ckpt_cli.formats.base.Reader.read_index`."""
        index_file = path if path.is_file() else find_index(path)
        if index_file is None:
            raise UnknownFormatError("no single *.index.json in the directory", path=path)
        index = CheckpointIndex(format=self.name, root=path, base=index_file.parent)
        read_into(index, index_file)
        return index


def load_index_json(index_file: Path) -> tuple[dict[str, str], dict[str, Any]]:
    """Parse and check an HF index file.

    Args:
        index_file: The ``*.index.json``.

    Returns:
        ``(weight_map, metadata)``.

    Raises:
        CorruptCheckpointError: Bad JSON or a missing/ill-typed ``weight_map``.
    """
    raw = storage.read_side(index_file, "index")  # regular files only, at most 256 MiB
    if raw is None:
        raise CheckpointNotFoundError("no such file", path=index_file)
    data = storage.parse_json(raw, what="index", path=index_file)
    if not isinstance(data, dict) or not isinstance(data.get("weight_map"), dict):
        raise CorruptCheckpointError("index has no weight_map object", path=index_file)
    wm = data["weight_map"]
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise CorruptCheckpointError("weight_map must map tensor names to file names",
                                     path=index_file)
    meta: dict[str, Any] = data["metadata"] if isinstance(data.get("metadata"), dict) else {}
    return dict(wm), meta


def _read_shard(index: CheckpointIndex, spath: Path, role: str,
                default_group: str) -> set[str]:
    """Add one shard (safetensors or torch zip) to ``index``; the names added."""
    if safetensors.sniff_bytes(read_head(spath, 9), spath.stat().st_size) is None:
        return safetensors.read_into(index, spath, role=role, default_group=default_group)
    if torchfile.sniff_torch(spath) is None:
        return torchfile.read_into(index, spath, role=role, prefix="")
    raise UnknownFormatError("shard is neither safetensors nor a torch file", path=spath)


def count_parameters(base: Path, shards: list[str]) -> int:
    """The parameters of a shard set as ``inspect`` counts them once it has an index:
    :attr:`CheckpointIndex.num_parameters` of the shards read as this reader reads them
    (model weights only, tied copies once, found by storage or by value).

    The writers call it on the shards they have just written, before the index that names
    them (the commit marker), to fill its ``metadata.total_parameters``.

    Args:
        base: The directory holding the shards.
        shards: Their names, relative to ``base``.

    Returns:
        The count.

    Raises:
        CkptError: A shard cannot be read.
    """
    index = CheckpointIndex(format="hf-index", root=base, base=base)
    for shard in shards:
        _read_shard(index, base / shard, "shard", "model")
    find_ties(index)
    return index.num_parameters


def read_into(index: CheckpointIndex, index_file: Path, *, role: str = "shard",
              default_group: str = "model") -> None:
    """Add an HF index and all its shards to ``index``.

    Args:
        index: The index to fill.
        index_file: The ``*.index.json``.
        role: Role recorded for the shards.
        default_group: Group of tensors whose names say nothing else.

    Raises:
        CorruptCheckpointError: Bad index JSON.
        UnsafeCheckpointError: A shard path leaves the directory.
    """
    wm, meta = load_index_json(index_file)
    rel_index = rel_to(index_file, index.base)
    index.files.append(FileInfo(rel_index, file_size(index_file), "index", "json"))
    ext = ".safetensors" if index_file.name.endswith(".safetensors.index.json") else None
    shards: dict[str, list[str]] = {}
    for tensor, shard in wm.items():
        shards.setdefault(shard, []).append(tensor)
    base = index_file.parent
    for shard in shards:
        contained_path(base, shard, what="shard", source=index_file)
        if ext and not shard.endswith(ext):
            raise CorruptCheckpointError(f"shard {shard!r} does not end with {ext}",
                                         path=index_file)
    found: dict[str, str] = {}
    unreadable: set[str] = set()
    for shard, expected in shards.items():
        spath = base / shard
        srel = rel_to(spath, index.base)
        special = storage.not_regular(spath)
        if special is not None:
            index.add(Finding("error", "bad-shard", special, srel))
            unreadable.add(shard)
            continue
        if not spath.is_file():
            index.add(Finding("error", "missing-shard",
                              f"named by the index for {len(expected)} tensor(s) but missing",
                              srel))
            unreadable.add(shard)
            continue
        try:
            names = _read_shard(index, spath, role, default_group)
        except CkptError as e:
            index.add(Finding("error", "bad-shard", e.message, srel))
            index.files.append(FileInfo(srel, spath.stat().st_size, role, None))
            unreadable.add(shard)
            continue
        for listed in names:
            n = index.duplicates.get(listed, listed)  # a second copy is listed as name#2
            if n in found:
                # Two shards hold it: a stale shard left beside a newer export (accelerate#2698).
                index.add(Finding("error", "duplicate-tensor",
                                  f"in both {found[n]} and {shard}", rel_index, n))
                continue
            found[n] = shard
    for tensor, shard in wm.items():
        got = found.get(tensor)
        if got is None:
            if shard not in unreadable:
                index.add(Finding("error", "missing-tensor",
                                  f"the index puts it in {shard} but that shard lacks it",
                                  rel_index, tensor))
        elif got != shard:
            index.add(Finding("error", "wrong-shard",
                              f"the index says {shard} but it is in {got}", rel_index, tensor))
    for extra in sorted(set(found) - set(wm)):
        index.add(Finding("error", "unindexed-tensor",
                          f"in {found[extra]} but not in the index's weight_map", rel_index,
                          extra))
    total = meta.get("total_size")
    if isinstance(total, (int, float)) and not unreadable:
        actual = sum(index.tensors[n].nbytes for n in found)
        if int(total) != actual:
            index.add(Finding("warning", "total-size",
                              f"metadata.total_size is {int(total):,} but the shards' tensors "
                              f"hold {actual:,} bytes", rel_index))
    index.layout["shards"] = len(shards)
    if "total_parameters" in meta:
        index.metadata["total_parameters"] = meta["total_parameters"]
    # What ckpt wrote (convert, consolidate): its ckpt.* keys, which torch shards have no
    # place for (safetensors shards repeat them: kept once), and the step and epoch they carry.
    shown = index.metadata.get("safetensors_metadata", {})
    own = {k: v for k, v in meta.items()
           if k.startswith(provenance.PREFIX) and isinstance(v, str) and shown.get(k) != v}
    if own:
        index.metadata["index_metadata"] = own
    for key, value in provenance.read_back(meta).items():
        index.metadata.setdefault(key, value)
