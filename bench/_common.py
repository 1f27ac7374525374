"""Shared pieces of the benchmarks: data generation, timing with peak RSS, reporting.

Each benchmark runs ckpt and the peer a user would otherwise write side by side, in fresh
processes (so import time counts, as it does for a user), and prints ratios. Data is generated
once into ``$CKPT_BENCH_DIR`` (default ``bench/data``) and reused.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(os.environ.get("CKPT_BENCH_DIR", ROOT / "bench" / "data"))
PY = sys.executable


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a timed process: this one's, as a user's shell has it.

    ``PYTHONDONTWRITEBYTECODE`` is dropped (and the package compiled once, see
    :func:`_compile_once`): with it every process recompiles ckpt's sources, about 0.3-0.5 s
    here, which no installed copy pays.
    """
    _compile_once()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return {**env, **(extra or {})}


_COMPILED: list[bool] = []


def _compile_once() -> None:
    if not _COMPILED:
        import compileall

        compileall.compile_dir(str(ROOT / "ckpt_cli"), quiet=1)
        _COMPILED.append(True)


@dataclass
class Run:
    """One timed process."""

    label: str
    seconds: float
    peak_rss: int  # bytes
    stdout: str
    all_seconds: tuple[float, ...] = ()  # every round, when timed more than once
    cpu_seconds: float = 0.0  # user + system time: what the code costs on a busy machine
    stages: dict[str, Any] | None = None  # ckpt's per-stage report (CKPT_STAGE_REPORT)

    @property
    def spread(self) -> str:
        """``best / median / worst of N`` for reports."""
        t = sorted(self.all_seconds or (self.seconds,))
        return f"best {t[0]:.2f} / median {t[len(t) // 2]:.2f} / worst {t[-1]:.2f} s of {len(t)}"


def timed(label: str, argv: list[str], *, env: dict[str, str] | None = None,
          repeat: int = 1) -> Run:
    """Run ``argv`` ``repeat`` times; the fastest wall time, with that run's own peak RSS.

    A ckpt process (label starting with ``ckpt``) also records its per-stage busy time
    (``CKPT_STAGE_REPORT``, see ``ckpt_cli.storage.stages``) into :attr:`Run.stages`.
    """
    import tempfile

    best: Run | None = None
    for _ in range(repeat):
        stage_file = None
        run_env = dict(env or {})
        if label.startswith("ckpt"):
            fd, stage_file = tempfile.mkstemp(prefix="ckpt-stages-", suffix=".json")
            os.close(fd)
            run_env["CKPT_STAGE_REPORT"] = stage_file
        t0 = time.perf_counter()
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=child_env(run_env))
        # Read output while waiting, then reap with wait4 to get this child's own rusage.
        out = p.stdout.read() if p.stdout else b""
        err = p.stderr.read() if p.stderr else b""
        _, status, usage = os.wait4(p.pid, 0)
        dt = time.perf_counter() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
        if p.returncode:
            raise SystemExit(f"{label} failed ({p.returncode}): {err.decode()[-2000:]}")
        r = Run(label, dt, usage.ru_maxrss * 1024, out.decode(),
                cpu_seconds=usage.ru_utime + usage.ru_stime)
        if stage_file is not None:
            try:
                r.stages = json.loads(Path(stage_file).read_text() or "null")
            except (OSError, ValueError):
                r.stages = None
            Path(stage_file).unlink(missing_ok=True)
        if best is None or r.seconds < best.seconds:
            best = r
    assert best is not None
    return best


def timed_together(label: str, argvs: list[list[str]], *,
                   env: dict[str, str] | None = None) -> Run:
    """Start several processes at once (the parts of a split job) and wait for all of them.

    Returns:
        The wall time until the last one exits, the largest peak RSS of any of them, their
        CPU time summed, and their stdout one after the other.
    """
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        procs = []
        for i, argv in enumerate(argvs):
            out = open(Path(tmp) / f"{i}.out", "wb")
            err = open(Path(tmp) / f"{i}.err", "wb")
            procs.append((subprocess.Popen(argv, stdout=out, stderr=err,
                                           env=child_env(env)), out, err))
        peak, cpu, failed = 0, 0.0, []
        for i, (p, out, err) in enumerate(procs):
            _, status, usage = os.wait4(p.pid, 0)
            p.returncode = os.waitstatus_to_exitcode(status)
            out.close()
            err.close()
            peak = max(peak, usage.ru_maxrss * 1024)
            cpu += usage.ru_utime + usage.ru_stime
            if p.returncode:
                failed.append(f"{i}: {(Path(tmp) / f'{i}.err').read_text()[-1500:]}")
        dt = time.perf_counter() - t0
        if failed:
            raise SystemExit(f"{label} failed: " + "; ".join(failed))
        stdout = "".join((Path(tmp) / f"{i}.out").read_text() for i in range(len(argvs)))
    return Run(label, dt, peak, stdout, cpu_seconds=cpu)


def timed_interleaved(runs: dict[str, list[str]], *, repeat: int = 5,
                      setup: Any = None) -> dict[str, Run]:
    """Time several commands in turn, ``repeat`` rounds; each one's fastest run.

    Interleaving matters on a VM whose speed drifts: here, with virtio-balloon free-page
    reporting, memory the guest freed goes back to the host and touching it again cost up to
    ~10 s/GB at times (2 GB: 0.45 s in a quiet minute, 19-23 s in a busy one), which swamps
    any difference in code. Every command sees the same conditions, and the best of several
    rounds is what the code can do rather than what the neighbours did.

    Args:
        runs: Label -> argv.
        repeat: Rounds.
        setup: Called with the label before each run (untimed), e.g. to remove that
            command's previous output.
    """
    best: dict[str, Run] = {}
    seconds: dict[str, list[float]] = {label: [] for label in runs}
    for _ in range(repeat):
        for label, argv in runs.items():
            if setup is not None:
                setup(label)
            r = timed(label, argv)
            seconds[label].append(r.seconds)
            if label not in best or r.seconds < best[label].seconds:
                best[label] = r
    for label, r in best.items():
        r.all_seconds = tuple(seconds[label])
    return best


def warm(path: Path) -> None:
    """Read a file or tree once so timings compare compute, not first-touch disk reads."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def stage_rows(r: Run) -> list[tuple[str, str]]:
    """Report rows for a ckpt run's stages: busy time, threads, share of the wall time.

    A stage whose busy time is close to the wall time on one thread is what bounds the run;
    busy time above the wall time ran on several threads at once.
    """
    if not r.stages:
        return []
    rows = [(f"  {r.label}: wall / CPU", f"{r.seconds:.2f} s / {r.cpu_seconds:.2f} s "
                                          f"(threads setting {r.stages.get('threads_setting')})")]
    for name, s in sorted(r.stages["stages"].items(), key=lambda kv: -kv[1]["busy_s"]):
        rate = f", {human_bytes(s['bytes'] / s['busy_s'])}/s busy" if s["bytes"] and \
            s["busy_s"] else ""
        rows.append((f"    stage {name}", f"busy {s['busy_s']:.2f} s on {s['threads']} thread(s),"
                                           f" {s['busy_s'] / r.seconds:.2f}x wall{rate}"))
    return rows


def report(title: str, rows: list[tuple[str, str]]) -> None:
    """Print a small aligned table."""
    print(f"\n== {title}")
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k.ljust(width)}  {v}")


def ckpt_argv(*args: str) -> list[str]:
    """``ckpt ARGS`` as a fresh process of this interpreter."""
    return [PY, "-m", "ckpt_cli", *args]


def big_model(g: Any, n_layers: int = 12, dim: int = 1536,
              vocab: int = 32000) -> dict[str, Any]:
    """A GPT-like model's fp32 state dict (about 389M parameters, 1.56 GB at the defaults).

    Args:
        g: The ``torch.Generator`` to draw from.
        n_layers: Transformer blocks.
        dim: Hidden size.
        vocab: Vocabulary size.
    """
    import torch

    model: dict[str, torch.Tensor] = {"embed.weight": torch.randn(vocab, dim, generator=g) * 0.02}
    for i in range(n_layers):
        p = f"layers.{i}."
        model[p + "attn.qkv.weight"] = torch.randn(3 * dim, dim, generator=g) * 0.02
        model[p + "attn.out.weight"] = torch.randn(dim, dim, generator=g) * 0.02
        model[p + "mlp.fc1.weight"] = torch.randn(4 * dim, dim, generator=g) * 0.02
        model[p + "mlp.fc2.weight"] = torch.randn(dim, 4 * dim, generator=g) * 0.02
        model[p + "ln1.weight"] = torch.ones(dim)
        model[p + "ln2.weight"] = torch.ones(dim)
    model["norm.weight"] = torch.ones(dim)
    return model


def big_training_state(n_layers: int = 12, dim: int = 1536, vocab: int = 32000,
                       seed: int = 0) -> dict[str, object]:
    """A GPT-like model (about 389M fp32 parameters at the defaults) plus AdamW state."""
    import torch

    g = torch.Generator().manual_seed(seed)
    model = big_model(g, n_layers, dim, vocab)
    state = {}
    for i, (_name, t) in enumerate(model.items()):
        state[i] = {"step": torch.tensor(1000.0), "exp_avg": torch.randn(t.shape, generator=g)
                    * 1e-3, "exp_avg_sq": torch.rand(t.shape, generator=g) * 1e-6}
    optimizer = {"state": state, "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95),
                                                    "eps": 1e-8, "weight_decay": 0.1,
                                                    "params": list(range(len(model)))}]}
    return {"model": model, "optimizer": optimizer, "step": 1000, "epoch": 3, "lr": 3e-4}


def many_checkpoints(n: int = 20_000) -> Path:
    """A run directory of ``n`` small safetensors checkpoints (``step_000001.safetensors``...)
    and a ``latest`` pointer: the shape of a long run that saved often. Written once."""
    out = DATA / f"run_many_{n}"
    if not (out / "latest").exists():
        import numpy as np
        from safetensors.numpy import save_file

        out.mkdir(parents=True, exist_ok=True)
        for i in range(1, n + 1):
            save_file({"w": np.full((16, 16), i, np.float32), "b": np.zeros(16, np.float32)},
                      str(out / f"step_{i:06d}.safetensors"), metadata={"step": str(i)})
        (out / "latest").write_text(f"step_{n:06d}.safetensors\n")  # written last: complete
    return out


def in_subprocess(func: str, *args: object) -> None:
    """Call ``bench.<module>.<func>(*args)`` in a fresh process.

    Data is generated in child processes so this process stays small: on Linux a child's
    peak-RSS figure includes the parent's resident memory at fork time.
    """
    module, name = func.rsplit(".", 1)
    code = (f"import json, sys; from {module} import {name}; "
            f"{name}(*json.loads(sys.argv[1]))")
    subprocess.run([PY, "-c", code, json.dumps([str(a) if isinstance(a, Path) else a
                                                 for a in args])], check=True, cwd=ROOT)


def write_train_checkpoint(path: str, n_layers: int, dim: int) -> None:
    """Write :func:`big_training_state` with torch.save (run via :func:`in_subprocess`)."""
    import torch

    tmp = Path(path).with_suffix(".tmp")
    torch.save(big_training_state(n_layers=n_layers, dim=dim), tmp)
    tmp.rename(path)


def train_checkpoint(name: str = "train.pt", n_layers: int = 12, dim: int = 1536) -> Path:
    """The ~4.7 GB torch training checkpoint (389M params + AdamW), made once and cached."""
    path = DATA / (name if (n_layers, dim) == (12, 1536) else f"small-{name}")
    if not path.exists():
        DATA.mkdir(parents=True, exist_ok=True)
        print(f"[bench] writing {path} ...", file=sys.stderr)
        in_subprocess("bench._common.write_train_checkpoint", path, n_layers, dim)
    return path


def write_big_train_checkpoint(path: str, n_layers: int = 80, dim: int = 1024,
                               vocab: int = 32000) -> None:
    """The ~11.5 GB training checkpoint (about 955M fp32 parameters + AdamW ``exp_avg`` and
    ``exp_avg_sq``), written with torch.save (run via :func:`in_subprocess`).

    Per block: qkv ``3*dim x dim``, fc1 ``4*dim x dim``, fc2 ``dim x 4*dim``, ln ``dim``; plus a
    ``vocab x dim`` embedding. Tensors are filled in place (no temporaries), so generating it
    holds the checkpoint once (~11.5 GB), not twice.
    """
    import torch

    g = torch.Generator().manual_seed(0)

    def randn(*shape: int, std: float) -> torch.Tensor:
        return torch.empty(*shape).normal_(0.0, std, generator=g)

    model: dict[str, torch.Tensor] = {"embed.weight": randn(vocab, dim, std=0.02)}
    for i in range(n_layers):
        p = f"layers.{i}."
        model[p + "attn.qkv.weight"] = randn(3 * dim, dim, std=0.02)
        model[p + "mlp.fc1.weight"] = randn(4 * dim, dim, std=0.02)
        model[p + "mlp.fc2.weight"] = randn(dim, 4 * dim, std=0.02)
        model[p + "ln.weight"] = torch.ones(dim)
    state = {i: {"step": torch.tensor(1000.0), "exp_avg": randn(*t.shape, std=1e-3),
                 "exp_avg_sq": torch.empty(t.shape).uniform_(0.0, 1e-6, generator=g)}
             for i, t in enumerate(model.values())}
    optimizer = {"state": state, "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95),
                                                    "eps": 1e-8, "weight_decay": 0.1,
                                                    "params": list(range(len(model)))}]}
    tmp = Path(path).with_suffix(".tmp")
    torch.save({"model": model, "optimizer": optimizer, "step": 1000}, tmp)
    tmp.rename(path)


def big_train_checkpoint() -> Path:
    """The ~11.5 GB checkpoint of :func:`write_big_train_checkpoint` (the caller deletes it)."""
    path = DATA / "train-big.pt"
    if not path.exists():
        DATA.mkdir(parents=True, exist_ok=True)
        print(f"[bench] writing {path} ...", file=sys.stderr)
        in_subprocess("bench._common.write_big_train_checkpoint", path)
    return path


def fresh_dir(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path
