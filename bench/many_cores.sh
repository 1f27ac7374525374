#!/usr/bin/env bash
# Issue 27's figures on a many-core machine, in one run of at most ~9 minutes.
#
# Run from the repository root:  bash bench/many_cores.sh [--smoke]
# Results go to $OUT (default ./bench-out): one text file per benchmark plus machine.txt.
# --smoke: the small checkpoints instead of --big (a check of the script itself, ~3 min on 2 cores).
#
# On a machine without network (a lent device machine) whose python3 lacks some dependencies,
# download their wheels here first, into .whl/ (git-ignored), and carry that folder along:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl orjson isal typer==0.28.0 annotated-doc shellingham
# The script installs .whl/*.whl into /tmp/site when the folder exists.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-$PWD/bench-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -d .whl ] && ls .whl/*.whl > /dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
# The benchmarks' data on the machine's own disk (the big checkpoint is ~11.5 GB).
export CKPT_BENCH_DIR=${CKPT_BENCH_DIR:-/tmp/ckpt-bench}
mkdir -p "$CKPT_BENCH_DIR"

size=--big
[ "${1:-}" = "--smoke" ] && size=--quick

{
  date -u
  echo "cores: $(nproc)"
  grep -m1 "model name" /proc/cpuinfo
  free -g | head -2
  df -h "$CKPT_BENCH_DIR" | tail -1
  "$PY" -c "import sys, torch, numpy, typer; print(sys.version.split()[0], 'torch', torch.__version__, 'numpy', numpy.__version__, 'typer', typer.__version__)"
  "$PY" -m ckpt_cli --version
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

bench() {  # bench NAME SECONDS MODULE ARGS...
  local name=$1 limit=$2
  shift 2
  echo "== $name ($(date -u +%T))"
  timeout "$limit" "$PY" -m "$@" 2>&1 | tee "$OUT/$name.txt"
}

# convert --to fp16 (ckpt, the peer, the floor, per-stage busy time and threads).
bench convert 300 bench.bench_convert "$size"
# consolidate of the 8-rank DCP, and 1 process vs parts.
bench consolidate 120 bench.bench_consolidate
# validate: CRC, --write-manifest, manifest verify, --values.
if [ "$size" = --quick ]; then
  bench validate 120 bench.bench_validate --quick
else
  bench validate 120 bench.bench_validate
fi
echo "done $(date -u +%T); results in $OUT"
