"""The checks of one checkpoint's contents: the reader's findings sorted into named checks,
then what metadata alone cannot tell: the zip structure and CRC-32 of every torch zip (streamed,
in parallel), DCP placement, tiling and decoding, stray pickles, rank files, ``latest``
pointers, resumability and quantization scales."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ckpt_cli import storage
from ckpt_cli.errors import CkptError
from ckpt_cli.formats import dcp
from ckpt_cli.fp8.config import check_quantized
from ckpt_cli.model import CheckpointIndex, Finding
from ckpt_cli.ops.validate.builder import RATE_MIN, Builder
from ckpt_cli.ops.validate.dcpcheck import check_dcp
from ckpt_cli.ops.validate.layoutcheck import (
    ds_world,
    pointer_findings,
    rank_findings,
    resumable_findings,
    stray_shards,
)
from ckpt_cli.ops.validate.strays import stray_pickle_findings
from ckpt_cli.ops.validate.zipcheck import CrcTask, check_zip, crc_tasks, verify_crcs
from ckpt_cli.storage.reads import OpenFiles
from ckpt_cli.units import format_size

if TYPE_CHECKING:
    from ckpt_cli.ops.validate.options import Options
    from ckpt_cli.ops.validate.split import Share

# Reader finding codes -> the check they belong to (unknown codes go to "readable").
_CODE_CHECK: dict[str, str] = {
    **dict.fromkeys(("duplicate-key", "bad-metadata", "bad-entry", "unknown-dtype", "bad-shape",
                     "bad-offsets", "misaligned", "size-mismatch", "gap", "overlap", "truncated",
                     "trailing-bytes"), "safetensors-header"),
    **dict.fromkeys(("missing-storage", "short-storage", "view-out-of-bounds",
                     "unreferenced-storage", "tensor-kind"), "storages"),
    **dict.fromkeys(("compressed-entry", "big-endian"), "zip-structure"),
    **dict.fromkeys(("unsafe-global", "unknown-global", "non-allowlisted-global",
                     "torchscript-archive", "unscanned-pickle", "pickle-after-stop"),
                    "pickle-safety"),
    **dict.fromkeys(("missing-shard", "bad-shard", "missing-tensor", "wrong-shard",
                     "unindexed-tensor", "total-size", "bad-index", "duplicate-tensor"),
                    "shard-index"),
    **dict.fromkeys(("missing-file", "chunk-out-of-bounds", "missing-chunk"), "dcp-storage"),
    "bad-item": "dcp-chunks",
    "chunk-tiling": "dcp-tiling",
    **dict.fromkeys(("world-size", "missing-rank", "missing-rank-file"), "rank-files"),
    "missing-weights": "complete",
}
_FORMAT_CODE_CHECK = {("megatron", "missing-file"): "rank-files"}


def deep_checks(b: Builder, index: CheckpointIndex, path: Path, files: OpenFiles,
                opts: Options) -> int:
    """Sort the reader's findings into checks and run the checks beyond metadata.

    Returns:
        Bytes streamed.
    """
    exact_ranks = index.format == "deepspeed" and ds_world(index) is not None
    for f in _collapse_truncation(index.findings):
        if exact_ranks and f.code == "missing-rank":
            continue  # _deepspeed_ranks names each missing file instead
        if f.code == "bad-item" and not opts.quick:
            continue  # check_dcp decodes every item (the reader only the small ones)
        cid = _FORMAT_CODE_CHECK.get((index.format, f.code)) or _CODE_CHECK.get(f.code,
                                                                                "readable")
        if f.code == "unscanned-pickle" and f.severity != "error":
            # Fail closed: what ckpt cannot scan may run anything under a full unpickler
            # (inspect and the rest warn; validate refuses).
            f = dataclasses.replace(f, severity="error")
        b.add(cid, [f])
    fmts = {f.format for f in index.files}
    b.add("readable", [], f"{index.format}"
          + (f" ({index.flavor})" if index.flavor and index.flavor != index.format else "")
          + f": {len(index.tensors):,} tensors in {len(index.files):,} file(s)")
    if "safetensors" in fmts:
        n = sum(1 for f in index.files if f.format == "safetensors")
        b.add("safetensors-header", [], f"{n} safetensors header(s)")
    if "hf-index" == index.format or any(f.role == "index" for f in index.files):
        b.add("shard-index", stray_shards(index),
              f"{index.layout.get('shards', 0)} shard(s) named by the index")
    if fmts & {"torch", "torch-legacy"}:
        refs = {(t.storage.file, t.storage.key) for t in index.tensors.values() if t.storage}
        b.add("storages", [], f"{len(refs):,} storage(s) referenced")
    tasks: list[CrcTask] = []
    crc_files: list[str] = []  # the files of the CRC records, in the order they are checked
    share = opts.share
    if share is not None:
        share.check_aborted()
    zips = _torch_zips(b, index, files, tasks, share, crc_files)
    dcp_items = _dcp_checks(b, index, path, files, tasks, opts, crc_files)
    records = sum(t.records for t in tasks) + (
        share.external_records(crc_files) if share is not None else 0)
    if zips or dcp_items:
        what = ", ".join(x for x in (f"{zips} torch file(s)" if zips else "",
                                     f"{dcp_items:,} DCP item(s)" if dcp_items else "") if x)
        b.add("zip-structure", [], f"{what}, {records:,} record(s)" if records else what)
    if "torch-legacy" in fmts and not zips and not dcp_items:
        b.skip("crc32", "legacy torch files carry no checksums (a manifest can guard them)")
    streamed = 0
    if zips or dcp_items:
        if opts.quick:
            b.skip("crc32", "skipped (--quick)")
        else:
            total = sum(t.size for t in tasks)
            t0 = time.perf_counter()
            found = verify_crcs(tasks, threads=opts.jobs, on_progress=opts.on_progress)
            dt = time.perf_counter() - t0
            if share is not None:
                found, total, dt = share.merge_crc(crc_files, tasks, found, dt)
            streamed = total
            rate = f", {total / dt / 1e9:.2f} GB/s" if dt > 0 and total > RATE_MIN else ""
            b.add("crc32", found, f"{records:,} record(s), {format_size(total)}{rate}")
    strays = stray_pickle_findings(index, path)
    if strays:
        b.add("pickle-safety", strays)
    if strays or fmts & {"torch", "torch-legacy", "pickle", "dcp"}:
        found = b.findings.get("pickle-safety", [])
        worst = {f.severity for f in found}
        script = any(f.code == "torchscript-archive" for f in found)
        b.add("pickle-safety", [], "only allowlisted globals" if not found else
              "a TorchScript archive: torch.load runs its code" if script else
              "globals that run code if loaded unsafely" if "error" in worst else
              "unknown globals (not imported, not executed)" if "warning" in worst else
              f"{len(found)} data-holder global(s) outside torch's allowlist, read as data")
    for cid, got in (("rank-files", rank_findings(index, path)),
                     ("latest-pointer", pointer_findings(index, path))):
        if got is not None:
            b.add(cid, *got)
    b.add("resumable", *resumable_findings(index, opts.require, path))
    quant = check_quantized(index)
    if quant is not None:
        b.add("quantization", *quant)
    return streamed


def _collapse_truncation(findings: list[Finding]) -> list[Finding]:
    """One finding per truncated file instead of one per DCP chunk past its end."""
    out: list[Finding] = []
    first: dict[str | None, Finding] = {}
    count: dict[str | None, int] = {}
    for f in findings:
        if f.code != "chunk-out-of-bounds":
            out.append(f)
            continue
        count[f.file] = count.get(f.file, 0) + 1
        if f.file not in first:
            first[f.file] = f
            out.append(f)
    return [dataclasses.replace(f, message=f"{f.message}; {count[f.file] - 1:,} more chunk(s) "
                                "of this file too") if f.code == "chunk-out-of-bounds"
            and count[f.file] > 1 else f for f in out]


def _torch_zips(b: Builder, index: CheckpointIndex, files: OpenFiles,
                tasks: list[CrcTask], share: Share | None, crc_files: list[str]) -> int:
    """Zip structure of every torch zip file of the checkpoint; collects CRC tasks (of this
    part's files, with ``--part``: the other parts' come from their receipts)."""
    owners: dict[tuple[str, str], list[str]] = {}
    for t in index.tensors.values():
        if t.storage is not None:
            owners.setdefault((t.storage.file, t.storage.key), []).append(t.name)
    n = 0
    disabled: list[str] = []
    for f in index.files:
        if f.format != "torch":
            continue
        n += 1
        if share is not None and not share.owns(f.path):
            w = share.elsewhere(f.path)
            if w is not None:
                b.add("zip-structure", w.zips)
                if w.crc_disabled:
                    disabled.append(f.path)
                crc_files.append(f.path)
            continue
        path = index.path_of(f.path)
        fd = files.open(path, path)
        size = storage.size_of(fd)
        zr = check_zip(fd, 0, size, rel=f.path)
        b.add("zip-structure", zr.findings)
        if zr.crc_disabled:
            disabled.append(f.path)

        def describe(record: str, rel: str = f.path) -> str:
            key = record.rsplit("/data/", 1)[-1] if "/data/" in record else None
            names = owners.get((rel, key), []) if key else []
            if not names:
                return ""
            more = f" and {len(names) - 1} more" if len(names) > 1 else ""
            return f"storage of {names[0]}{more}"

        tasks.extend(crc_tasks(zr, rel=f.path, fd=fd, start=0, describe=describe))
        if share is not None:
            w = share.work(f.path)
            w.zips, w.crc_disabled = list(zr.findings), zr.crc_disabled
            crc_files.append(f.path)
    if disabled:
        b.add("crc32", [Finding("info", "crc-disabled",
                                "written with CRC-32 turned off (every CRC is 0): its bytes "
                                "cannot be verified; a manifest can guard them", p)
                        for p in disabled])
    return n


def _dcp_checks(b: Builder, index: CheckpointIndex, path: Path, files: OpenFiles,
                tasks: list[CrcTask], opts: Options, crc_files: list[str]) -> int:
    """DCP placement, tiling and decoding for the checkpoint or its DCP subdirectories."""
    targets: list[tuple[CheckpointIndex, Path, str]] = []
    if index.format == "dcp":
        targets.append((index, path, ""))
    elif path.is_dir():
        for sub in sorted(q for q in path.iterdir() if q.is_dir()):
            if dcp.metadata_file(sub) is None:
                continue
            try:
                targets.append((dcp.DCPReader().read_index(sub), sub, sub.name + "/"))
            except CkptError:
                continue  # the directory reader reported it (bad-subdir)
    items = 0
    for sub_index, directory, prefix in targets:
        share = opts.share
        rep = check_dcp(sub_index, directory, files, prefix=prefix, decode=not opts.quick,
                        only=share.owns if share is not None else None)
        if share is not None:
            share.merge_dcp(rep)
            crc_files.extend(rep.item_files)
        b.add("dcp-storage", rep.storage, f"{rep.placed:,} item(s) in {rep.files} file(s)")
        b.add("dcp-tiling", [], f"{rep.tensors:,} tensor(s)")
        b.add("pickle-safety", rep.pickles)
        if opts.quick:
            b.skip("dcp-chunks", "skipped (--quick)")
        else:
            note = (f"; {rep.undecoded} compressed item(s) not decoded" if rep.undecoded
                    else "")
            b.add("dcp-chunks", rep.chunks, f"{rep.items:,} item(s) decoded{note}")
            b.add("zip-structure", rep.zips)
        tasks.extend(rep.crc)
        items += rep.items
    return items
