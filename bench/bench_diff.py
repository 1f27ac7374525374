"""Benchmark: ``ckpt diff`` against the peer script a user would write.

Data: two fp32 state dicts of the same GPT-like model (389M parameters, about 1.56 GB each):
A saved with ``safetensors.torch.save_file``, B with ``torch.save``, every value of B nudged by
a relative 1e-3 (as after a short fine-tune), so every tensor differs.

Peer: ``torch.load`` both (torch delegates ``.safetensors`` to the safetensors library), then a
loop with ``torch.allclose`` and ``(a - b).abs().max()``. Both run as fresh processes (import
time included, as for a user); each is the fastest of N runs, with that run's own peak RSS.

Targets: ckpt at least 1.5x faster than the peer and at most a third of its peak memory.

Run: python -m bench.bench_diff [--quick] [--repeat N]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench import _common as bc

PEER = """
import sys, torch
a = torch.load(sys.argv[1], weights_only=True, map_location="cpu")
b = torch.load(sys.argv[2], weights_only=True, map_location="cpu")
changed, worst = 0, 0.0
for name in sorted(a.keys() | b.keys()):
    if name not in a or name not in b or a[name].shape != b[name].shape:
        changed += 1
        continue
    x, y = a[name], b[name]
    if not torch.allclose(x, y):
        changed += 1
    worst = max(worst, (x - y).abs().max().item())
print(changed, worst)
"""


def write_pair(out_dir: str, n_layers: int, dim: int) -> None:
    """Write ``a.safetensors`` and ``b.pt`` (run via :func:`in_subprocess`)."""
    import torch
    from safetensors.torch import save_file

    from bench._common import big_model

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    a = big_model(g, n_layers=n_layers, dim=dim)
    save_file(a, str(out / "a.tmp"))
    (out / "a.tmp").rename(out / "a.safetensors")
    b = {}
    for name in list(a):
        t = a.pop(name)  # keep memory to about one copy
        b[name] = t * (1 + 1e-3 * torch.randn(t.shape, generator=g))
        del t
    torch.save(b, out / "b.tmp")
    (out / "b.tmp").rename(out / "b.pt")


def pair(quick: bool) -> tuple[Path, Path]:
    """The two checkpoints, generated once and cached under bench/data."""
    n_layers, dim = (2, 512) if quick else (12, 1536)
    out = bc.DATA / f"diff_{n_layers}x{dim}"
    if not (out / "b.pt").exists():
        print(f"[bench] writing {out} ...", file=sys.stderr)
        bc.in_subprocess("bench.bench_diff.write_pair", out, n_layers, dim)
    return out / "a.safetensors", out / "b.pt"


def main() -> None:
    quick = "--quick" in sys.argv
    repeat = int(sys.argv[sys.argv.index("--repeat") + 1]) if "--repeat" in sys.argv else 3
    a, b = pair(quick)
    bc.warm(a)
    bc.warm(b)
    ours = bc.timed("ckpt diff", bc.ckpt_argv("diff", str(a), str(b), "--json", "--exit-zero"),
                    repeat=repeat)
    peer = bc.timed("peer", [bc.PY, "-c", PEER, str(a), str(b)], repeat=repeat)
    doc = json.loads(ours.stdout)
    ours_changed = doc["summary"]["changed"]
    ours_max = max(t["max_abs"] for t in doc["tensors"])
    peer_changed, peer_max = peer.stdout.split()
    speed = peer.seconds / ours.seconds
    memory = ours.peak_rss / peer.peak_rss
    size = a.stat().st_size + b.stat().st_size
    bc.report(f"diff of two fp32 state dicts ({bc.human_bytes(a.stat().st_size)} safetensors vs "
              f"{bc.human_bytes(b.stat().st_size)} torch .pt, {bc.human_bytes(size)} read)", [
        ("ckpt diff --json", f"{ours.seconds:.2f} s, peak RSS {bc.human_bytes(ours.peak_rss)}"),
        ("peer torch.load x2 + allclose", f"{peer.seconds:.2f} s, peak RSS "
                                          f"{bc.human_bytes(peer.peak_rss)}"),
        ("speed-up (peer / ckpt)", f"{speed:.2f}x  (target >= 1.5x) "
                                   f"{'OK' if speed >= 1.5 else 'MISSED'}"),
        ("memory (ckpt / peer)", f"{memory:.3f} = 1/{1 / memory:.1f}  (target <= 1/3) "
                                 f"{'OK' if memory <= 1 / 3 else 'MISSED'}"),
        ("changed tensors (ckpt / peer)", f"{ours_changed} / {peer_changed}"),
        ("largest |a-b| (ckpt / peer)", f"{ours_max:.6g} / {float(peer_max):.6g}"),
        ("where ckpt's time goes", ""),
        *bc.stage_rows(ours),
    ])


if __name__ == "__main__":
    main()
