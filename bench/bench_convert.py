"""Benchmark: ``ckpt convert train.pt --to fp16 -o out/`` against the peer and the floor.

Input: the ~4.7 GB torch training checkpoint (389M fp32 parameters + AdamW state).
- ckpt: streams model tensors, casts, writes safetensors, fsyncs, renames into place.
- peer (what a user writes): torch.load(mmap=True, weights_only=True), .half() every model
  tensor, safetensors.torch.save_file. It does not fsync.
- floor: read the model tensors' bytes once and write the output's bytes once (dd of the same
  volumes, the write fsynced like ckpt's).

ckpt and the peer run in turn, five rounds (three with ``--big``), each timed in a fresh
process from a warm page cache with its previous output removed; the best round of each is
reported, with user+system CPU.

``--big``: the same on a ~11.5 GB training checkpoint (80 blocks of qkv 3072x1024, fc1
4096x1024, fc2 1024x4096, ln 1024, plus a 32000x1024 embedding, fp32, with AdamW state),
generated for the run and deleted after it. Targets: >= 3x the peer, <= 1.5x the floor, peak
RSS <= 25% of the peer's.

``--fp8``: ``convert --to fp8`` (block layout, then channel) beside ``convert --to bf16`` and
``--to fp16`` of the same checkpoint, interleaved (``--rounds N``, default 3), with each one's
stage report. Target: fp8 within 1.5x of bf16's time, peak RSS as for every convert.

``--fp8-memory``: peak RSS of ``convert --max-memory 64MiB`` of one 8192x8192 FP32 Linear
(256 MiB) to bf16 and to fp8 in each layout (quantized tensors stream in pieces, as casts do).

``--kernels``: FP32 -> FP16 per core, one thread each, ckpt's compiled and numpy kernels
against torch's, in cache and from memory. Target: the compiled kernel at least torch's rate.

``--dcp``: ``convert --to dcp`` (the training state: weights, Adam moments, step, into a
torch.distributed.checkpoint directory) beside ``convert --to fp32 --keep-optimizer`` (every
tensor into safetensors) of the same training checkpoint, interleaved (``--rounds N``,
default 3). Target (issue 48): within 1.3x of the latter's time, peak RSS alike.

Run: python -m bench.bench_convert [--quick | --big] [--fp8 | --fp8-memory | --kernels | --dcp]
     [--rounds N]
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
from pathlib import Path

from bench import _common as bc

PEER = """
import sys, torch
from safetensors.torch import save_file
sd = torch.load(sys.argv[1], mmap=True, weights_only=True, map_location="cpu")
out = {k: v.half().contiguous() for k, v in sd["model"].items()}
save_file(out, sys.argv[2], metadata={"format": "pt"})
"""


# ckpt with torch's cast kernels whatever the size (the evidence for cast.TORCH_WORTH_IT).
TORCH_CAST = """
import sys
from ckpt_cli.tensors import cast
cast.TORCH_WORTH_IT = 0
from ckpt_cli.cli.app import main
sys.argv[0] = "ckpt"
main()
"""


def _f16_kernel() -> str:
    """The FP32->FP16 kernel ckpt's runs use (the compiled F16C one, or numpy's)."""
    from ckpt_cli.tensors import cast

    return cast.f16_kernel() + ("  (CKPT_NO_F16C set)" if "CKPT_NO_F16C" in bc.child_env()
                                else "")


def _median(r: bc.Run) -> float:
    return statistics.median(r.all_seconds or (r.seconds,))


KERNELS = """
import json, sys, time
import numpy as np, torch
from ckpt_cli.tensors import cast
torch.set_num_threads(1)
n, reps = int(sys.argv[1]), int(sys.argv[2])
a = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
o = np.empty(n, np.float16)
ta, to = torch.from_numpy(a), torch.from_numpy(o)
kernels = {"torch": lambda: to.copy_(ta), "numpy": lambda: cast.f32_to_f16_numpy(a, o)}
if cast.f16_kernel() == "f16c":
    kernels["f16c"] = lambda: cast.f32_to_f16(a, o)
rates = {}
for name, f in kernels.items():
    r = max(1, reps // 10) if name == "numpy" else reps
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(r):
            f()
        best = min(best, time.perf_counter() - t)
    rates[name] = n * r / best / 1e9
print(json.dumps(rates))
"""


def kernels() -> None:
    """``--kernels``: FP32 -> FP16 per core, one thread each: ckpt's kernels against torch's,
    on a block that stays in cache, one of the size casts use (``cast._BLOCK``) and one
    streamed from memory (issue 27: at least as fast per core as torch)."""
    rows = []
    for label, n, reps in (("256K elements (in cache) x 1000", 1 << 18, 1000),
                           ("2M elements (a cast block) x 100", 1 << 21, 100),
                           ("100M elements (from memory) x 2", 100_000_000, 2)):
        best: dict[str, float] = {}
        for _ in range(3):  # interleaved rounds: the fastest of each
            rates = json.loads(bc.timed("kernels", [bc.PY, "-c", KERNELS, str(n),
                                                    str(reps)]).stdout)
            best = {k: max(v, best.get(k, 0.0)) for k, v in rates.items()}
        text = ", ".join(f"{k} {v:.2f}" for k, v in best.items())
        ratio = (f"; f16c / torch {best['f16c'] / best['torch']:.2f}x (target >= 1x)"
                 if "f16c" in best else "; no F16C kernel on this machine")
        rows.append((label, f"G elements/s: {text}{ratio}"))
    bc.report("FP32 -> FP16 per core (one thread each)", rows)


def main() -> None:
    if "--kernels" in sys.argv:
        kernels()
        return
    quick, big = "--quick" in sys.argv, "--big" in sys.argv
    src = bc.big_train_checkpoint() if big else bc.train_checkpoint(
        **({"n_layers": 2, "dim": 512} if quick else {}))
    try:
        if "--dcp" in sys.argv:
            run_dcp(src)
        elif "--fp8-memory" in sys.argv:
            run_fp8_memory()
        elif "--fp8" in sys.argv:
            run_fp8(src)
        else:
            run(src, big)
    finally:
        if big:
            src.unlink(missing_ok=True)


def run(src: Path, big: bool) -> None:
    speedup_target = 3.0 if big else 1.5
    bc.warm(src)
    out_dir = bc.DATA / "convert-out"
    peer_out = bc.DATA / "convert-peer.safetensors"

    def clean(label: str) -> None:
        if label.startswith("ckpt"):
            shutil.rmtree(out_dir, ignore_errors=True)
        else:
            peer_out.unlink(missing_ok=True)

    args = ["convert", str(src), "--to", "fp16", "-o", str(out_dir), "--quiet"]
    runs = {"ckpt": bc.ckpt_argv(*args), "peer": [bc.PY, "-c", PEER, str(src), str(peer_out)]}
    if big:
        runs["ckpt-torch"] = [bc.PY, "-c", TORCH_CAST, *args]
    best = bc.timed_interleaved(runs, setup=clean, repeat=3 if big else 5)
    ours, peer = best["ckpt"], best["peer"]
    forced = best.get("ckpt-torch")
    out_bytes = sum(p.stat().st_size for p in out_dir.iterdir())
    import json

    summary = json.loads(bc.timed("inspect", bc.ckpt_argv("inspect", str(src), "--json")).stdout)
    model_bytes = summary["bytes_by_group"]["model"] + summary["bytes_by_group"]["buffer"]
    mb = 1 << 20
    floor_script = (f"dd if={src} of=/dev/null bs=1M count={model_bytes // mb} status=none && "
                    f"dd if=/dev/zero of={bc.DATA / 'floor.bin'} bs=1M count={out_bytes // mb} "
                    "conv=fsync status=none")
    floor = bc.timed("floor", ["sh", "-c", floor_script], repeat=3)
    (bc.DATA / "floor.bin").unlink(missing_ok=True)
    bc.report(f"convert --to fp16 of a {bc.human_bytes(src.stat().st_size)} training checkpoint "
              f"({bc.human_bytes(model_bytes)} of model tensors -> {bc.human_bytes(out_bytes)})", [
        ("ckpt convert", f"{ours.spread}, peak RSS {bc.human_bytes(ours.peak_rss)}, "
                         f"CPU {ours.cpu_seconds:.1f} s"),
        ("ckpt's FP32->FP16 kernel", _f16_kernel()),
        ("peer torch.load+half+save_file", f"{peer.spread}, peak RSS "
                                           f"{bc.human_bytes(peer.peak_rss)}, "
                                           f"CPU {peer.cpu_seconds:.1f} s"),
        *([("ckpt convert, torch casts forced", f"{forced.spread}, peak RSS "
                                                 f"{bc.human_bytes(forced.peak_rss)}, "
                                                 f"CPU {forced.cpu_seconds:.1f} s")]
          if forced else []),
        ("floor (dd read + dd write, fsync)", f"{floor.seconds:.2f} s"),
        ("where ckpt's time goes (its best round)", ""),
        *bc.stage_rows(ours),
        *(bc.stage_rows(forced) if forced else []),
        ("CPU vs peer", f"{ours.cpu_seconds / peer.cpu_seconds:.2f}x  (target <= 1x)"),
        ("speed-up vs peer", f"{peer.seconds / ours.seconds:.2f}x best, "
                             f"{_median(peer) / _median(ours):.2f}x median  "
                             f"(target >= {speedup_target:g}x)"),
        ("peak RSS vs peer", f"{100 * ours.peak_rss / peer.peak_rss:.0f}%  (target <= 25%)"),
        ("time vs floor", f"{ours.seconds / floor.seconds:.2f}x  (target <= 1.5x)"),
    ])
    shutil.rmtree(out_dir, ignore_errors=True)
    peer_out.unlink(missing_ok=True)


def _rounds(default: int) -> int:
    """``--rounds N`` from the command line, else ``default``."""
    if "--rounds" in sys.argv:
        return int(sys.argv[sys.argv.index("--rounds") + 1])
    return default


def run_fp8(src: Path) -> None:
    """``--to fp8`` (block and channel layouts) beside ``--to bf16`` and ``--to fp16``, same
    input, interleaved rounds; each with wall, CPU, peak RSS and its stage report."""
    bc.warm(src)
    labels = ("bf16", "fp16", "fp8-block", "fp8-channel")
    outs = {k: bc.DATA / f"convert-{k}" for k in labels}

    def clean(label: str) -> None:
        shutil.rmtree(outs[label], ignore_errors=True)

    def argv(label: str) -> list[str]:
        to = ["--to", label] if not label.startswith("fp8") else [
            "--to", "fp8", "--fp8-layout", label.split("-")[1]]
        return bc.ckpt_argv("convert", str(src), *to, "-o", str(outs[label]), "--quiet")

    # "ckpt ..." labels: timed() records a ckpt process's stage report (CKPT_STAGE_REPORT)
    timed_runs = bc.timed_interleaved({f"ckpt {k}": argv(k) for k in labels},
                                      setup=lambda label: clean(label[5:]), repeat=_rounds(3))
    best = {k: timed_runs[f"ckpt {k}"] for k in labels}
    size = {k: sum(p.stat().st_size for p in d.iterdir()) for k, d in outs.items()}
    base = best["bf16"]
    bc.report(f"convert --to fp8 vs --to bf16 / fp16 of a {bc.human_bytes(src.stat().st_size)} "
              "training checkpoint (fresh process each, warm page cache, interleaved rounds)", [
        *((f"ckpt convert --to {k}", f"{r.spread}, peak RSS {bc.human_bytes(r.peak_rss)}, "
                                      f"CPU {r.cpu_seconds:.1f} s, output "
                                      f"{bc.human_bytes(size[k])}") for k, r in best.items()),
        ("where the time goes (each one's best round)", ""),
        *(row for k in labels for row in bc.stage_rows(best[k])),
        *((f"{k} time vs bf16", f"{best[k].seconds / base.seconds:.2f}x best, "
                                f"{_median(best[k]) / _median(base):.2f}x median  "
                                "(target <= 1.5x)")
          for k in ("fp8-block", "fp8-channel")),
        *((f"{k} CPU vs bf16", f"{best[k].cpu_seconds / base.cpu_seconds:.2f}x")
          for k in ("fp8-block", "fp8-channel")),
    ])
    for d in outs.values():
        shutil.rmtree(d, ignore_errors=True)


BIG_LINEAR = """
import sys, torch
from safetensors.torch import save_file
g = torch.Generator().manual_seed(0)
n = int(sys.argv[2])
save_file({"model.layers.0.mlp.down_proj.weight": torch.empty(n, n).normal_(0, 0.02,
           generator=g), "model.norm.weight": torch.ones(n)}, sys.argv[1])
"""


def run_fp8_memory() -> None:
    """Peak RSS of ``convert --to fp8 --max-memory 64MiB`` of one 8192x8192 FP32 Linear
    (256 MiB): the quantized tensor streams in pieces, as a cast does."""
    import subprocess

    n = 8192
    src = bc.DATA / "fp8-big-linear" / "model.safetensors"
    if not src.exists():
        src.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([bc.PY, "-c", BIG_LINEAR, str(src), str(n)], check=True)
    bc.warm(src)
    # "dequantize": --to bf16 --dequantize of the fp8-block output just written
    labels = ("bf16", "fp8-block", "fp8-channel", "fp8-tensor", "dequantize")
    outs = {k: bc.DATA / f"mem-{k}" for k in labels}

    def clean(label: str) -> None:
        shutil.rmtree(outs[label], ignore_errors=True)

    def argv(label: str) -> list[str]:
        if label == "dequantize":
            return bc.ckpt_argv("convert", str(outs["fp8-block"]), "--to", "bf16", "--dequantize",
                                "-o", str(outs[label]), "--max-memory", "64MiB", "--quiet")
        to = ["--to", label] if not label.startswith("fp8") else [
            "--to", "fp8", "--fp8-layout", label.split("-")[1]]
        return bc.ckpt_argv("convert", str(src.parent), *to, "-o", str(outs[label]),
                            "--max-memory", "64MiB", "--quiet")

    timed_runs = bc.timed_interleaved({f"ckpt {k}": argv(k) for k in labels},
                                      setup=lambda label: clean(label[5:]), repeat=_rounds(2))
    best = {k: timed_runs[f"ckpt {k}"] for k in labels}
    bc.report(f"convert --max-memory 64MiB of one {n}x{n} FP32 Linear "
              f"({bc.human_bytes(src.stat().st_size)})", [
        ("ckpt convert fp8-block-out --to bf16 --dequantize" if k == "dequantize"
         else f"ckpt convert --to {k}", f"{r.spread}, peak RSS {bc.human_bytes(r.peak_rss)}, "
                                         f"CPU {r.cpu_seconds:.1f} s")
        for k, r in best.items()])
    for d in outs.values():
        shutil.rmtree(d, ignore_errors=True)


def run_dcp(src: Path) -> None:
    """``convert --to dcp`` against ``convert --to fp32 --keep-optimizer`` (issue 48)."""
    bc.warm(src)
    outs = {"dcp": bc.DATA / "convert-dcp", "fp32": bc.DATA / "convert-fp32-all"}
    runs = {"dcp": bc.ckpt_argv("convert", str(src), "--to", "dcp", "-o", str(outs["dcp"]),
                                "--quiet"),
            "fp32": bc.ckpt_argv("convert", str(src), "--to", "fp32", "--keep-optimizer",
                                 "-o", str(outs["fp32"]), "--quiet")}
    best = bc.timed_interleaved(runs, setup=lambda k: shutil.rmtree(outs[k], ignore_errors=True),
                                repeat=_rounds(3))
    sizes = {k: sum(p.stat().st_size for p in o.iterdir()) for k, o in outs.items()}
    dcp, f32 = best["dcp"], best["fp32"]
    bc.report(f"convert --to dcp of a {bc.human_bytes(src.stat().st_size)} training checkpoint", [
        ("ckpt convert --to dcp", f"{dcp.spread}, peak RSS {bc.human_bytes(dcp.peak_rss)}, "
                                  f"CPU {dcp.cpu_seconds:.1f} s, {bc.human_bytes(sizes['dcp'])}"),
        ("ckpt convert --to fp32 --keep-optimizer",
         f"{f32.spread}, peak RSS {bc.human_bytes(f32.peak_rss)}, CPU {f32.cpu_seconds:.1f} s, "
         f"{bc.human_bytes(sizes['fp32'])}"),
        ("time vs --keep-optimizer", f"{dcp.seconds / f32.seconds:.2f}x best, "
                                     f"{_median(dcp) / _median(f32):.2f}x median  "
                                     "(target <= 1.3x)"),
        ("peak RSS vs --keep-optimizer", f"{dcp.peak_rss / f32.peak_rss:.2f}x"),
    ])
    for o in outs.values():
        shutil.rmtree(o, ignore_errors=True)


if __name__ == "__main__":
    main()
