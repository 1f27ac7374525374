"""Benchmark: the kernels behind ``ckpt stats`` (``ckpt_cli.tensors.moments``), in process.

Seconds per GB of values (best of N rounds, taken in turn so that a busy machine slows each
alike) on a 16M-element array: the compiled one-pass kernel (``tensors/_moments.c``), the
numpy kernel, and ``validate --values``' per-piece check (``valuecheck._Counts.add``: NaN/Inf
counts only), which reads the same bytes; one thread, then two threads on two arrays (the
compiled kernel releases the GIL). Then the compiled kernel on FP64/FP16/BF16, on a sparse, a
NaN-dotted and a subnormal array, and ``diff_sumsq``.

Run: python -m bench.bench_moments [--rounds N]
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from ckpt_cli.ops.validate.valuecheck import _Counts
from ckpt_cli.tensors import moments


def _best(fn: Callable[[], Any], rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _threads(fn: Callable[[np.ndarray], Any], arrays: list[np.ndarray]) -> None:
    workers = [threading.Thread(target=fn, args=(a,)) for a in arrays]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def main(argv: list[str]) -> None:
    """Print the table."""
    rounds = int(argv[argv.index("--rounds") + 1]) if "--rounds" in argv else 7
    moments._compiled.cache_clear()
    if moments.moments_kernel() != "compiled":
        print("the compiled kernel is not built (python setup.py build_ext --inplace)")
        return
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(1 << 24).astype(np.float32) for _ in range(2)]
    gb = arrays[0].nbytes / 1e9
    kernels: dict[str, Callable[[np.ndarray], Any]] = {
        "compiled": moments.piece_moments,
        "numpy": moments.numpy_piece_moments,
        "validate --values (_Counts.add)": lambda a: _Counts().add(a),
    }
    one = dict.fromkeys(kernels, float("inf"))
    two = dict.fromkeys(kernels, float("inf"))
    for r in range(rounds):
        for name, fn in kernels.items():
            if name == "numpy" and r >= 2:
                continue  # ten times slower: two rounds are enough
            one[name] = min(one[name], _best(lambda fn=fn, r=r: fn(arrays[r % 2]), 1))
            two[name] = min(two[name], _best(lambda fn=fn: _threads(fn, arrays), 1))
    print(f"{'FP32, 16M values':34s} {'1 thread':>10s} {'2 threads':>10s}")
    for name in kernels:
        print(f"{name:34s} {one[name] / gb:7.3f} s/GB {two[name] / (2 * gb):7.3f} s/GB")
    print()
    base = arrays[0]
    sparse = base.copy()
    sparse[::2] = 0
    nan = base.copy()
    nan[::1000] = np.nan
    cases = {
        "float64": base.astype(np.float64), "float16": base.astype(np.float16),
        "bfloat16": base.astype(ml_dtypes.bfloat16), "FP32, half zeros": sparse,
        "FP32, a NaN per 1000": nan, "FP32, all subnormal": (base * 1e-39).astype(np.float32),
    }
    for name, a in cases.items():
        t = _best(lambda a=a: moments.piece_moments(a), rounds)
        print(f"compiled, {name:24s} {t / (a.nbytes / 1e9):7.3f} s/GB "
              f"({t / a.size * 1e9:.2f} ns/value)")
    t = _best(lambda: moments.diff_sumsq(arrays[0], arrays[1]), rounds)
    print(f"{'diff_sumsq, FP32':34s} {t / (2 * gb):7.3f} s per GB read")


if __name__ == "__main__":
    main(sys.argv[1:])
