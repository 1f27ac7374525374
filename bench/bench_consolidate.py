"""Benchmark: ``ckpt consolidate`` of DCP checkpoints against torch's ``dcp_to_torch_save``.

1. A ~2.1 GB model saved by torch.distributed.checkpoint from 8 processes (gloo), every
   tensor sharded across the 8 ranks (DTensor Shard(0)). ckpt consolidate (safetensors
   output, model only) vs the peer ``dcp_to_torch_save`` (which materializes every tensor,
   then torch.save). Targets: >= 2x faster, peak RSS <= 25% of the peer's.
2. The same 256 MB of tensors stored as 1,024 files vs as 8 files (DCP's one-file-per-item
   and one-file-per-writer-thread layouts): consolidate time must stay within 2x.
3. The 8-rank checkpoint consolidated into 512 MB shards by one process vs by two parts
   (``--part 1/2`` and ``--part 2/2`` started together, the last to finish writes the index
   and the manifest). Target: >= 1.6x faster on a 2-core machine. Also 1,024 rank files.

ckpt and the peer run in turn (fresh processes, warm page cache, previous output removed);
the best of three rounds is compared and the spread printed.

Run: python -m bench.bench_consolidate [--parts]   (--parts: only section 3)
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
from pathlib import Path

from bench import _common as bc

RANKS = 8
ROWS, COLS, TENSORS = 4096, 8192, 16  # 16 x 128 MiB fp32 = 2.1 GB


def _worker(rank: int, out: str, port: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=RANKS)
    mesh = init_device_mesh("cpu", (RANKS,))
    g = torch.Generator().manual_seed(rank)
    rows = ROWS // RANKS
    sd = {f"layers.{i}.weight": DTensor.from_local(torch.randn(rows, COLS, generator=g), mesh,
                                                   [Shard(0)]) for i in range(TENSORS)}
    dcp.save({"model": sd}, checkpoint_id=out)
    dist.destroy_process_group()


def write_sharded(out: str) -> None:
    """8 processes save the sharded model (run in a child process)."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(out, port), nprocs=RANKS, join=True)


def write_many_files(out: str, per_item: bool) -> None:
    """256 MB in 1,024 tensors, as one file per item or as 8 writer files (child process)."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    g = torch.Generator().manual_seed(0)
    sd = {f"layers.{i}.weight": torch.randn(256, 256, generator=g) for i in range(1024)}
    writer = (FileSystemWriter(out, single_file_per_rank=False) if per_item
              else FileSystemWriter(out, thread_count=8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": sd}, storage_writer=writer, no_dist=True)


PEER = """
import sys, warnings
warnings.simplefilter("ignore")
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
dcp_to_torch_save(sys.argv[1], sys.argv[2])
"""


def _dcp8() -> Path:
    src = bc.DATA / "dcp8"
    if not (src / ".metadata").exists():
        print("[bench] writing the 8-rank DCP checkpoint ...", file=sys.stderr)
        bc.in_subprocess("bench.bench_consolidate.write_sharded", src)
    bc.warm(src)
    return src


def split_in_parts(src: Path, title: str, shard: str, rounds: int = 3,
                   target: str = "target >= 1.6x on 2 cores") -> float:
    """One process vs two parts started together; prints and returns the speed-up."""
    out = bc.DATA / "cons-parts-out"
    args = ("consolidate", str(src), "-o", str(out), "--max-shard-size", shard, "--quiet")
    one: list[float] = []
    two: list[float] = []
    cpu1 = cpu2 = 0.0
    for _ in range(rounds):  # in turn, so both see the same machine
        shutil.rmtree(out, ignore_errors=True)
        r1 = bc.timed("1 process", bc.ckpt_argv(*args))
        one.append(r1.seconds)
        cpu1 = r1.cpu_seconds
        shutil.rmtree(out, ignore_errors=True)
        r2 = bc.timed_together("2 parts", [bc.ckpt_argv(*args, "--part", f"{k}/2") for k in (1, 2)])
        two.append(r2.seconds)
        cpu2 = r2.cpu_seconds
        if not (out / "model.safetensors.index.json").exists() and shard != "0":
            raise SystemExit("2 parts did not finalize the output")
    written = sum(p.stat().st_size for p in src.iterdir() if p.is_file())
    shutil.rmtree(out, ignore_errors=True)
    floor = bc.timed("floor", ["sh", "-c", f"dd if=/dev/zero of={bc.DATA / 'floor.bin'} bs=1M "
                               f"count={max(1, written >> 20)} conv=fsync status=none"])
    (bc.DATA / "floor.bin").unlink(missing_ok=True)
    ratio = min(one) / min(two)
    bc.report(title, [
        ("floor: dd write of as many bytes, fsynced", f"{floor.seconds:.2f} s (the disk: "
                                                      "no number of parts goes below it)"),
        ("1 process", f"best {min(one):.2f} s of {rounds} ({', '.join(f'{t:.2f}' for t in one)})"
                      f", CPU {cpu1:.2f} s"),
        ("2 parts together", f"best {min(two):.2f} s of {rounds} "
                             f"({', '.join(f'{t:.2f}' for t in two)}), CPU {cpu2:.2f} s"),
        ("speed-up", f"{ratio:.2f}x  ({target})"),
    ])
    return ratio


def main() -> None:
    bc.DATA.mkdir(parents=True, exist_ok=True)
    src = _dcp8()
    if "--parts" in sys.argv:
        _parts_section(src)
        return
    ours_out, peer_out = bc.DATA / "cons-out", bc.DATA / "cons-peer.pt"

    def clean(label: str) -> None:
        if label == "ckpt":
            shutil.rmtree(ours_out, ignore_errors=True)
        else:
            peer_out.unlink(missing_ok=True)

    best = bc.timed_interleaved({
        "ckpt": bc.ckpt_argv("consolidate", str(src), "-o", str(ours_out), "--quiet"),
        "peer": [bc.PY, "-c", PEER, str(src), str(peer_out)]}, repeat=3, setup=clean)
    ours, peer = best["ckpt"], best["peer"]
    size = sum(p.stat().st_size for p in src.iterdir())
    bc.report(f"consolidate a {bc.human_bytes(size)} DCP checkpoint written by {RANKS} ranks", [
        ("ckpt consolidate", f"{ours.spread}, peak RSS {bc.human_bytes(ours.peak_rss)}"),
        ("peer dcp_to_torch_save", f"{peer.spread}, peak RSS {bc.human_bytes(peer.peak_rss)}"),
        ("speed-up vs peer", f"{peer.seconds / ours.seconds:.2f}x  (target >= 2x)"),
        ("peak RSS vs peer", f"{100 * ours.peak_rss / peer.peak_rss:.0f}%  (target <= 25%)"),
        ("CPU ckpt / peer", f"{ours.cpu_seconds:.1f} s / {peer.cpu_seconds:.1f} s"),
        ("where ckpt's time goes (its best round)", ""),
        *bc.stage_rows(ours),
    ])
    shutil.rmtree(ours_out, ignore_errors=True)
    peer_out.unlink(missing_ok=True)

    rows = []
    times = {}
    for label, per_item in (("1,024 files", True), ("8 files", False)):
        d = bc.DATA / ("dcp_1024files" if per_item else "dcp_8files")
        if not (d / ".metadata").exists():
            bc.in_subprocess("bench.bench_consolidate.write_many_files", d, per_item)
        bc.warm(d)
        out = bc.DATA / "cons-many-out"
        shutil.rmtree(out, ignore_errors=True)
        r = bc.timed(label, bc.ckpt_argv("consolidate", str(d), "-o", str(out), "--quiet",
                                         "--force"),
                     repeat=3)
        times[label] = r.seconds
        files = len(list(d.iterdir()))
        rows.append((f"{label} ({files} entries)", f"{r.seconds:.2f} s"))
        shutil.rmtree(out, ignore_errors=True)
    rows.append(("ratio 1,024 / 8 files", f"{times['1,024 files'] / times['8 files']:.2f}x  "
                 "(target <= 2x)"))
    bc.report("the same 256 MB of tensors in 1,024 files vs 8 files", rows)
    _parts_section(src)


def _parts_section(src: Path) -> None:
    size = sum(p.stat().st_size for p in src.iterdir())
    split_in_parts(src, f"consolidate the {bc.human_bytes(size)} 8-rank DCP into 512 MB shards: "
                        "1 process vs 2 parts", "512MB")
    many = bc.DATA / "dcp_1024files"
    if not (many / ".metadata").exists():
        bc.in_subprocess("bench.bench_consolidate.write_many_files", many, True)
    bc.warm(many)
    split_in_parts(many, "consolidate the 256 MB in 1,024 rank files into 32 MB shards: "
                         "1 process vs 2 parts", "32MB",
                   target="no target: at 256 MB each part's start-up and metadata reads weigh")


if __name__ == "__main__":
    main()
