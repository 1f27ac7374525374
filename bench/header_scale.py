"""Benchmark: the cost per tensor near the header parse (issue 46, item 3).

A safetensors file of 10^6 tiny tensors and a DCP checkpoint of 200,000 chunks (both written
by the real libraries, in a temporary directory): ``ckpt inspect``, ``validate`` (without
``--values``) and ``stats`` of each run as fresh processes, beside the parse a user's own
script would do: ``json.loads`` of the safetensors header, ``pickle.load`` of the DCP
``.metadata`` (with torch imported, as it needs; its import is not counted). Target: each
within 5x of the parse's time, and under 1 GB peak RSS. Ratios are given in wall time and
in CPU time (user + system): on a shared machine the CPU ratio is the steadier one, and the
one the target is judged on (a fresh process's imports count, as for a user).

Run: python -m bench.header_scale [--quick] [--keep DIR] [--dcp-only [N]]
(``--quick``: 10^5 tensors and 20,000 chunks; ``--keep DIR``: write the data there, and
reuse it when present; ``--dcp-only``: the DCP part alone, of N chunks if given (200,000;
20,000 with ``--quick``).)
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from bench import _common as bc

TARGET_RATIO = 5.0
TARGET_RSS = 1 << 30

JSON_PEER = """
import json, resource, struct, sys, time
with open(sys.argv[1], "rb") as f:
    (n,) = struct.unpack("<Q", f.read(8))
    raw = f.read(n)
t, c = time.perf_counter(), time.process_time()
header = json.loads(raw)
print(time.perf_counter() - t, time.process_time() - c, len(header) - ("__metadata__" in header))
"""

PICKLE_PEER = """
import pickle, sys, time
import torch.distributed.checkpoint  # the classes the pickle names
with open(sys.argv[1], "rb") as f:
    raw = f.read()
t, c = time.perf_counter(), time.process_time()
md = pickle.loads(raw)
print(time.perf_counter() - t, time.process_time() - c,
      sum(len(getattr(m, "chunks", ())) for m in md.state_dict_metadata.values()))
"""


def write_safetensors(path: str, n: int) -> None:
    """``n`` one-element F32 tensors, eight per module, written by safetensors itself."""
    import numpy as np
    from safetensors.numpy import save_file

    one = np.zeros(1, np.float32)
    save_file({f"layers.{i // 8}.p{i % 8}.weight": one for i in range(n)}, path)


def write_dcp(out: str, n: int) -> None:
    """``n`` two-element tensors (one chunk each) saved by torch.distributed.checkpoint."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    sd = {f"layers.{i // 8}.p{i % 8}": torch.full((2,), float(i)) for i in range(n)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(sd, storage_writer=FileSystemWriter(out, single_file_per_rank=True),
                 no_dist=True)


def _peer(code: str, target: Path, label: str) -> tuple[float, float, str]:
    r = bc.timed(label, [bc.PY, "-c", code, str(target)])
    wall, cpu, count = r.stdout.split()
    return float(wall), float(cpu), count


def _rows(what: Path, peer: tuple[float, float, str], peer_label: str,
          cache: Path) -> list[tuple[str, str]]:
    wall0, cpu0, count = peer
    rows = [(peer_label, f"{wall0:.2f} s wall, {cpu0:.2f} s CPU ({int(count):,} entries)")]
    for cmd in (["inspect"], ["validate"], ["stats", "--no-cache"]):
        r = bc.timed(f"ckpt {cmd[0]}", bc.ckpt_argv(*cmd, str(what)),
                     env={"CKPT_CACHE_DIR": str(cache)})
        lines = r.stdout.count("\n")
        ok = r.cpu_seconds <= TARGET_RATIO * cpu0 and r.peak_rss < TARGET_RSS
        rows.append((f"ckpt {' '.join(cmd)}",
                     f"{r.seconds:.2f} s wall ({r.seconds / wall0:.1f}x), {r.cpu_seconds:.2f} s "
                     f"CPU ({r.cpu_seconds / cpu0:.1f}x), peak RSS {bc.human_bytes(r.peak_rss)}, "
                     f"{lines} lines  {'met' if ok else 'MISSED'}"))
    return rows


def _dcp_part(root: Path, n_chunks: int, cache: Path) -> None:
    """Write (or reuse) the DCP of ``n_chunks`` chunks under ``root`` and report its rows."""
    dcp_dir = root / f"dcp-{n_chunks}"
    if not (dcp_dir / ".metadata").exists():
        print(f"[bench] writing {dcp_dir} ...", file=sys.stderr)
        bc.in_subprocess("bench.header_scale.write_dcp", dcp_dir, n_chunks)
    bc.warm(dcp_dir / ".metadata")
    bc.report(f"DCP .metadata of {n_chunks:,} chunks "
              f"({bc.human_bytes((dcp_dir / '.metadata').stat().st_size)}); target <= "
              f"{TARGET_RATIO:g}x pickle.load, < {bc.human_bytes(TARGET_RSS)}",
              _rows(dcp_dir, _peer(PICKLE_PEER, dcp_dir / ".metadata", "pickle.load"),
                    "pickle.load of .metadata", cache))


def _dcp_only(quick: bool, keep: str | None) -> None:
    """``--dcp-only [N]``: the DCP part alone (the safetensors file of 10^6 tensors takes
    minutes to write and is not needed to measure it)."""
    at = sys.argv.index("--dcp-only") + 1
    given = sys.argv[at] if at < len(sys.argv) and sys.argv[at].isdigit() else None
    n_chunks = int(given) if given else (20_000 if quick else 200_000)
    root = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="ckpt-header-scale-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        _dcp_part(root, n_chunks, root / "cache")
    finally:
        if keep is None:
            shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    quick = "--quick" in sys.argv
    if "--dcp-only" in sys.argv:
        keep_dir = sys.argv[sys.argv.index("--keep") + 1] if "--keep" in sys.argv else None
        _dcp_only(quick, keep_dir)
        return
    n_tensors, n_chunks = (100_000, 20_000) if quick else (1_000_000, 200_000)
    keep = sys.argv[sys.argv.index("--keep") + 1] if "--keep" in sys.argv else None
    root = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="ckpt-header-scale-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        st = root / f"tiny-{n_tensors}.safetensors"
        if not st.exists():
            print(f"[bench] writing {st} ...", file=sys.stderr)
            bc.in_subprocess("bench.header_scale.write_safetensors", st, n_tensors)
        dcp_dir = root / f"dcp-{n_chunks}"
        if not (dcp_dir / ".metadata").exists():
            print(f"[bench] writing {dcp_dir} ...", file=sys.stderr)
            bc.in_subprocess("bench.header_scale.write_dcp", dcp_dir, n_chunks)
        bc.warm(st)
        bc.warm(dcp_dir / ".metadata")
        cache = root / "cache"
        bc.report(f"safetensors header of {n_tensors:,} tensors "
                  f"({bc.human_bytes(st.stat().st_size)}); target <= {TARGET_RATIO:g}x "
                  f"json.loads, < {bc.human_bytes(TARGET_RSS)}",
                  _rows(st, _peer(JSON_PEER, st, "json.loads"), "json.loads of the header",
                        cache))
        bc.report(f"DCP .metadata of {n_chunks:,} chunks "
                  f"({bc.human_bytes((dcp_dir / '.metadata').stat().st_size)}); target <= "
                  f"{TARGET_RATIO:g}x pickle.load",
                  _rows(dcp_dir, _peer(PICKLE_PEER, dcp_dir / ".metadata", "pickle.load"),
                        "pickle.load of .metadata", cache))
    finally:
        if keep is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
