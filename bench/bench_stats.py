"""Benchmark: ``ckpt stats`` against what a user would otherwise run, and across a run.

1. On the ~4.7 GB torch training checkpoint (389M parameters + AdamW state, warm page cache,
   fresh processes, interleaved rounds, fastest of N):

   * ``ckpt stats --all --no-cache`` (every floating tensor: numel, mean, std, min, max,
     absmax, L2, zeros, NaN, Inf, histogram) against ``ckpt validate --quick --values`` (it
     reads the same bytes, checking NaN/Inf/all-zero only): target at or below its time;
   * against a torch script that loads with ``mmap=True`` and computes the same per-tensor
     figures in float64 (:data:`TORCH_PEER`): target >= 3x; the figures of both are compared
     (max relative difference of mean, std and L2 over the tensors both name);
   * peak RSS against the memory budget (``--max-memory``, default 256 MB).

2. A run of 50 checkpoints (``--run``; ~20 MB each): the first ``ckpt stats RUN`` reads each
   byte once (``read.bytes`` equals the run's tensor bytes), the second reads nothing, and a
   51st checkpoint costs only itself and its predecessor's windows; against a torch script
   that loads each pair of consecutive checkpoints and computes the norms and update ratios.

Run: python -m bench.bench_stats [--quick] [--run]
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

from bench import _common as bc

TORCH_PEER = r'''
import json, sys, torch
sd = torch.load(sys.argv[1], mmap=True, weights_only=True)
def walk(o, pre):
    if isinstance(o, torch.Tensor):
        yield pre, o
    elif isinstance(o, dict):
        for k, v in o.items():
            yield from walk(v, f"{pre}.{k}" if pre else str(k))
    elif isinstance(o, (list, tuple)):
        for i, v in enumerate(o):
            yield from walk(v, f"{pre}.{i}" if pre else str(i))
out = {}
for name, t in walk(sd, ""):
    if not t.is_floating_point():
        continue
    x = t.double().reshape(-1)
    fin = torch.isfinite(x)
    f = x if bool(fin.all()) else x[fin]
    out[name] = {"numel": x.numel(), "mean": f.mean().item(), "std": f.std().item(),
                 "min": f.min().item(), "max": f.max().item(), "absmax": f.abs().max().item(),
                 "l2": torch.linalg.vector_norm(f).item(), "zeros": int((x == 0).sum()),
                 "nan": int(torch.isnan(x).sum()), "inf": int(torch.isinf(x).sum())}
print(json.dumps(out))
'''

TORCH_RUN_PEER = r'''
import json, sys, torch
from pathlib import Path
from safetensors.torch import load_file
paths = sorted(Path(sys.argv[1]).glob("step_*/model.safetensors"))
prev, out = None, []
for p in paths:
    sd = load_file(p)
    row = {}
    for k, v in sd.items():
        x = v.double()
        row[k] = [torch.linalg.vector_norm(x).item(),
                  None if prev is None else
                  (torch.linalg.vector_norm(x - prev[k].double()) /
                   torch.linalg.vector_norm(prev[k].double())).item()]
    out.append(row)
    prev = sd
print(json.dumps(len(out)))
'''


def _max_rel(ours: dict, peer: dict) -> tuple[int, float]:
    """Tensors both name, and the largest relative difference of mean/std/L2 among them."""
    worst, n = 0.0, 0
    for name, fig in peer.items():
        mine = ours.get(name)
        if mine is None:
            continue
        n += 1
        for k in ("mean", "std", "l2", "min", "max"):
            a, b = mine[k], fig[k]
            if a is None or b is None:
                continue
            worst = max(worst, abs(a - b) / max(abs(b), 1e-300))
    return n, worst


def bench_checkpoint(repeat: int) -> None:
    path = bc.train_checkpoint()
    bc.warm(path)
    size = path.stat().st_size
    with tempfile.TemporaryDirectory() as tmp:
        peer = Path(tmp) / "peer.py"
        peer.write_text(TORCH_PEER)
        runs = bc.timed_interleaved({
            "ckpt stats --all": bc.ckpt_argv("stats", str(path), "--all", "--no-cache",
                                             "--json"),
            "ckpt validate --quick --values": bc.ckpt_argv("validate", str(path), "--quick",
                                                           "--values", "--json"),
            "torch mmap script": [bc.PY, str(peer), str(path)],
        }, repeat=repeat)
    stats, values, torch_run = (runs["ckpt stats --all"], runs["ckpt validate --quick --values"],
                                runs["torch mmap script"])
    doc = json.loads(stats.stdout)
    ours = {t["name"]: t for t in doc["tensors"]}
    n, worst = _max_rel(ours, json.loads(torch_run.stdout))
    bc.report(f"ckpt stats of a {bc.human_bytes(size)} torch training checkpoint", [
        ("ckpt stats --all --no-cache", f"{stats.seconds:.2f} s ({stats.spread}), "
         f"{bc.human_bytes(doc['read']['bytes'] / stats.seconds)}/s, peak RSS "
         f"{bc.human_bytes(stats.peak_rss)}, kernel {doc['read']['kernel']}"),
        ("ckpt validate --quick --values", f"{values.seconds:.2f} s ({values.spread}), peak "
         f"RSS {bc.human_bytes(values.peak_rss)}"),
        ("torch mmap script (float64)", f"{torch_run.seconds:.2f} s ({torch_run.spread}), "
         f"peak RSS {bc.human_bytes(torch_run.peak_rss)}"),
        ("stats / validate --values", f"{stats.seconds / values.seconds:.2f}x the time "
         "(target <= 1.0)"),
        ("torch script / stats", f"{torch_run.seconds / stats.seconds:.1f}x faster "
         "(target >= 3)"),
        ("figures vs torch", f"{n} tensors named alike, max relative difference of "
         f"mean/std/L2/min/max {worst:.2e}"),
        *bc.stage_rows(stats),
    ])


def _write_run(root: str, n: int, mb: int) -> None:
    """``n`` checkpoints of a random-walk model of ``mb`` MB each (run via in_subprocess)."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    rows = mb * (1 << 20) // (8 * 1024 * 4)
    sd = {f"layers.{i}.weight": torch.randn(rows, 1024, generator=g) * 0.02 for i in range(8)}
    for step in range(n):
        for k in sd:
            sd[k] += torch.randn(sd[k].shape, generator=g) * 1e-4
        d = Path(root) / f"step_{(step + 1) * 100:06d}"
        d.mkdir(parents=True)
        save_file(sd, str(d / "model.safetensors"))


def bench_run(quick: bool) -> None:
    n, mb = (10, 8) if quick else (50, 20)
    with tempfile.TemporaryDirectory(dir=bc.DATA if bc.DATA.exists() else None) as tmp:
        root, cache = Path(tmp) / "run", Path(tmp) / "cache"
        bc.in_subprocess("bench.bench_stats._write_run", str(root), n, mb)
        total = sum(p.stat().st_size for p in root.rglob("*.safetensors"))
        bc.warm(root)
        argv = bc.ckpt_argv("stats", str(root), "--cache-dir", str(cache), "--json")
        first = bc.timed("ckpt stats RUN (first)", argv)
        second = bc.timed("ckpt stats RUN (second)", argv)
        bc.in_subprocess("bench.bench_stats._write_run", str(Path(tmp) / "more"), n + 1, mb)
        newest = sorted((Path(tmp) / "more").iterdir())[-1]
        shutil.move(str(newest), root / newest.name)
        third = bc.timed("ckpt stats RUN (one more)", argv)
        peer = Path(tmp) / "peer.py"
        peer.write_text(TORCH_RUN_PEER)
        shutil.rmtree(root / newest.name)
        torch_run = bc.timed("torch script", [bc.PY, str(peer), str(root)])
        d1, d2, d3 = (json.loads(r.stdout)["read"] for r in (first, second, third))
        bc.report(f"ckpt stats of a run of {n} checkpoints ({bc.human_bytes(total)})", [
            ("first", f"{first.seconds:.2f} s, read {bc.human_bytes(d1['bytes'])} "
                      f"({d1['bytes'] / total:.3f}x the run's bytes), peak RSS "
                      f"{bc.human_bytes(first.peak_rss)}"),
            ("second", f"{second.seconds:.2f} s, read {d2['bytes']} bytes, "
                       f"{d2['cached_tensors']} figures from the cache"),
            ("one more checkpoint", f"{third.seconds:.2f} s, read "
                                    f"{bc.human_bytes(d3['bytes'])}"),
            ("torch script (norms, update ratios)", f"{torch_run.seconds:.2f} s "
                                                    f"({torch_run.seconds / first.seconds:.1f}x "
                                                    "the first stats)"),
        ])


def main() -> None:
    quick = "--quick" in sys.argv
    if "--run" in sys.argv:
        bench_run(quick)
        return
    bench_checkpoint(2 if quick else 3)
    bench_run(quick)


if __name__ == "__main__":
    main()
