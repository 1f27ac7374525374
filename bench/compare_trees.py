"""Benchmark: this checkout against an older one on the everyday commands (issue 47: a
restructuring must leave inspect, convert and stats as fast and as lean as before).

Both trees run the same commands on the same files, as fresh processes, interleaved round by
round (so both see the same machine; the tree that goes first alternates from one round to
the next, so neither always follows the other's writes), and the best round of each is kept:

- ``inspect`` of a safetensors file (metadata only: import time dominates), of the torch
  training checkpoint, and ``inspect --json`` of a run directory of 200 checkpoints;
- ``convert --to bf16`` of the torch training checkpoint (model tensors streamed and cast);
- ``stats --all --no-cache`` of the same training checkpoint (every byte read, moments).

The baseline is a git revision (``--baseline REV``, default the last release tag or
``HEAD~1``), checked out with ``git worktree`` under the bench data directory, or a path to
another checkout (``--baseline-path``). Its compiled kernels are built in place first, so the
comparison is of the Python around them. Prints wall and CPU seconds and peak RSS of both and
the ratio now/before (below 1.0 is faster); the verdict allows 10% for noise. Beside them, the
modules each command loads in each tree (one more, untimed run under ``-X importtime``): a
count that the machine's load does not move.

Run: python -m bench.compare_trees [--quick] [--baseline REV | --baseline-path DIR]
     [--rounds N]
"""

from __future__ import annotations

import argparse
import compileall
import shutil
import subprocess
import sys
from pathlib import Path

from bench import _common as bc

NOISE = 1.10


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=bc.ROOT, check=True, capture_output=True,
                          text=True).stdout.strip()


def baseline_tree(rev: str) -> Path:
    """A worktree of ``rev`` under the data directory, its kernels built in place."""
    sha = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
    dest = bc.DATA / f"baseline-{sha[:12]}"
    if not (dest / "ckpt_cli").is_dir():
        if dest.exists():
            shutil.rmtree(dest)
        _git("worktree", "add", "--detach", str(dest), sha)
    if not list((dest / "ckpt_cli" / "tensors").glob("_moments*.so")):
        subprocess.run([bc.PY, "setup.py", "-q", "build_ext", "--inplace"], cwd=dest,
                       check=True, capture_output=True)
    return dest


def modules_loaded(root: Path, argv: list[str]) -> int:
    """How many modules ``ckpt argv`` imports when run from the tree ``root``."""
    p = subprocess.run([bc.PY, "-P", "-X", "importtime", "-m", "ckpt_cli", *argv],
                       env=bc.child_env({"PYTHONPATH": str(root)}), capture_output=True,
                       text=True, check=False)
    return sum(1 for line in p.stderr.splitlines()
               if line.startswith("import time:") and not line.endswith("imported package"))


def default_rev() -> str:
    try:
        return _git("describe", "--tags", "--abbrev=0")
    except subprocess.CalledProcessError:
        return "HEAD~1"


def inputs(quick: bool) -> dict[str, Path]:
    """The files both trees read, written by torch and safetensors, made once."""
    layers, dim = (2, 512) if quick else (4, 1024)
    train = bc.train_checkpoint(f"compare-train-{layers}x{dim}.pt", n_layers=layers, dim=dim)
    model = bc.DATA / f"compare-model-{layers}x{dim}.safetensors"
    if not model.exists():
        bc.in_subprocess("bench.compare_trees.write_model", model, str(train))
    run = bc.DATA / "compare-run-200"
    if not run.exists():
        bc.in_subprocess("bench.compare_trees.write_run", run, 200)
    return {"train": train, "model": model, "run": run}


def write_model(path: str, train: str) -> None:
    """The training checkpoint's model tensors as one safetensors file."""
    import torch
    from safetensors.torch import save_file

    sd = torch.load(train, mmap=True, weights_only=True)["model"]
    tmp = Path(path).with_suffix(".tmp")
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp))
    tmp.rename(path)


def write_run(path: str, n: int) -> None:
    """A run directory of ``n`` small torch.save checkpoints, ``checkpoint-<step>.pt``."""
    import torch

    tmp = Path(path + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    for i in range(n):
        sd = {f"layers.{j}.weight": torch.randn(16, 16, generator=g) for j in range(4)}
        torch.save({"model": sd, "step": (i + 1) * 100}, tmp / f"checkpoint-{(i + 1) * 100}.pt")
    tmp.rename(path)


def commands(files: dict[str, Path], out: Path) -> dict[str, list[str]]:
    """Name -> ckpt arguments (the same for both trees)."""
    return {
        "inspect safetensors": ["inspect", str(files["model"])],
        "inspect torch training": ["inspect", str(files["train"])],
        "inspect --json run of 200": ["inspect", str(files["run"]), "--json"],
        "convert --to bf16": ["convert", str(files["train"]), "--to", "bf16", "-o",
                              str(out / "bf16"), "--force"],
        "stats --all --no-cache": ["stats", str(files["train"]), "--all", "--no-cache",
                                   "--json"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller inputs, 3 rounds")
    ap.add_argument("--baseline", help="git revision to compare with")
    ap.add_argument("--baseline-path", help="another checkout to compare with")
    ap.add_argument("--rounds", type=int, default=0)
    args = ap.parse_args()
    bc.DATA.mkdir(parents=True, exist_ok=True)
    base = (Path(args.baseline_path).resolve() if args.baseline_path
            else baseline_tree(args.baseline or default_rev()))
    # As bc.child_env does for this checkout: no round of either tree pays for compiling.
    compileall.compile_dir(str(base / "ckpt_cli"), quiet=1)
    rounds = args.rounds or (3 if args.quick else 5)
    files = inputs(args.quick)
    out = bc.fresh_dir(bc.DATA / "compare-out")
    cmds = commands(files, out)
    trees = {"now": bc.ROOT, "before": base}
    best: dict[tuple[str, str], bc.Run] = {}
    for i in range(rounds):
        for name, argv in cmds.items():
            for tree, root in (trees.items() if i % 2 == 0 else reversed(trees.items())):
                # -P: the current directory is not put first on sys.path; PYTHONPATH picks the tree.
                r = bc.timed(f"ckpt {name}", [bc.PY, "-P", "-m", "ckpt_cli", *argv],
                             env={"PYTHONPATH": str(root)})
                key = (name, tree)
                if key not in best or r.seconds < best[key].seconds:
                    best[key] = r
    loaded = {(name, tree): modules_loaded(root, argv)
              for name, argv in cmds.items() for tree, root in trees.items()}
    rows: list[tuple[str, str]] = [("before", str(base)), ("rounds", f"{rounds}, best of each")]
    slower = []
    for name in cmds:
        now, before = best[(name, "now")], best[(name, "before")]
        ratio = now.cpu_seconds / before.cpu_seconds if before.cpu_seconds else float("nan")
        rss = now.peak_rss / before.peak_rss if before.peak_rss else float("nan")
        rows.append((name, f"now {now.seconds:.2f} s wall, {now.cpu_seconds:.2f} s CPU, "
                           f"{bc.human_bytes(now.peak_rss)} | before {before.seconds:.2f} s, "
                           f"{before.cpu_seconds:.2f} s CPU, {bc.human_bytes(before.peak_rss)}"
                           f" | CPU x{ratio:.2f}, RSS x{rss:.2f} | modules "
                           f"{loaded[(name, 'now')]} / {loaded[(name, 'before')]}"))
        if ratio > NOISE or rss > NOISE:
            slower.append(name)
    rows.append(("verdict", "unchanged or better (within 10%)" if not slower
                 else "SLOWER or heavier: " + ", ".join(slower)))
    bc.report("this checkout against " + (args.baseline_path or args.baseline or default_rev()),
              rows)
    shutil.rmtree(out, ignore_errors=True)
    if slower:
        sys.exit(1)


if __name__ == "__main__":
    main()
