"""Fuzzing for longer: random mutations of real checkpoints of every format, through every
read-only command and convert, until ``--duration`` seconds have passed.

The same seeds, mutations, commands, limits and judgement as ``tests/test_fuzz.py`` (see
``tests/helpers/fuzz.py``), but random (a new hypothesis seed per batch) instead of the fixed
cases CI runs. Prints how many cases ran, by command and exit code, and every failure found
(shrunk by hypothesis: the mutation and the command line). A failure found here is fixed and
kept in ``tests/test_fuzz.py`` as a regression case.

Run: python -m bench.fuzz --duration 300 [--seed N] [--batch 50]
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
import tempfile
import time
import warnings
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st


def main(argv: list[str] | None = None) -> int:
    """Run the fuzzer; exit 1 if it found anything."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=300.0, help="seconds to run (300)")
    ap.add_argument("--seed", type=int, default=None, help="first hypothesis seed (random)")
    ap.add_argument("--batch", type=int, default=50, help="cases per hypothesis run (50)")
    args = ap.parse_args(argv)

    from tests.helpers import fuzz

    warnings.simplefilter("ignore")
    rng = random.Random(args.seed)
    counts: collections.Counter[tuple[str, int]] = collections.Counter()
    failures: list[str] = []
    slowest = (0.0, "")
    biggest = (0, "")
    with tempfile.TemporaryDirectory(prefix="ckpt-fuzz-") as tmp:
        base = Path(tmp)
        t0 = time.monotonic()
        seeds = fuzz.build_seeds(base / "seeds")
        print(f"seeds: {', '.join(s.name for s in seeds)} ({time.monotonic() - t0:.1f} s)",
              flush=True)
        start = time.monotonic()
        batches = 0
        def run_batch(seed_obj: fuzz.Seed, batch_seed: int) -> None:
            @hypothesis_seed(batch_seed)
            @settings(max_examples=args.batch, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(mutation=fuzz.mutations(),
                   command=st.sampled_from(fuzz.commands_for(seed_obj)),
                   json_out=st.booleans())
            def case(mutation: fuzz.Mutation, command: str, json_out: bool) -> None:
                nonlocal slowest, biggest
                if time.monotonic() - start > args.duration:
                    return
                outcome = fuzz.fuzz_one(seed_obj, mutation, command, json_out,
                                        base / "work")
                assert outcome is not None
                counts[(command, outcome.exit_code)] += 1
                line = f"{seed_obj.name}: {mutation} -> ckpt {' '.join(outcome.args)}"
                if outcome.seconds > slowest[0]:
                    slowest = (outcome.seconds, line)
                if outcome.grew > biggest[0]:
                    biggest = (outcome.grew, line)
                assert outcome.problem is None, f"{line}: {outcome.problem}"

            try:
                case()
            except AssertionError as e:
                first = str(e).splitlines()[0]
                print(f"FOUND (seed {batch_seed}): {first}", flush=True)
                failures.append(first)

        while time.monotonic() - start < args.duration:
            run_batch(seeds[batches % len(seeds)], rng.randrange(2**32))
            batches += 1
        took = time.monotonic() - start
    total = sum(counts.values())
    print(f"\n{total:,} cases in {took:.0f} s ({total / took:.1f}/s), {batches} batches")
    by_command: dict[str, dict[int, int]] = collections.defaultdict(dict)
    for (command, code), n in sorted(counts.items()):
        by_command[command][code] = n
    for command, codes in sorted(by_command.items()):
        print(f"  {command:12} " + ", ".join(f"exit {c}: {n}" for c, n in sorted(codes.items())))
    print(f"slowest case: {slowest[0]:.2f} s ({slowest[1][:200]})")
    print(f"largest peak memory growth: {biggest[0] >> 20} MiB ({biggest[1][:200]})")
    print(f"failures: {len(failures)}")
    for f in failures:
        print(f"  {f[:500]}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
