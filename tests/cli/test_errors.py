"""Library errors name parameters; the command line words them as its flags.

A library call raises ``UsageError("to must be ...", param="to")``; ``ckpt convert --to fp12``
prints ``--to must be ...`` on stderr and in its ``--json`` error document, byte for byte what
it printed before the library stopped naming flags (tests/test_param_wording.py keeps flags out
of the library's errors).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import save_file
from typer.testing import CliRunner

from ckpt_cli.cli.app import build
from ckpt_cli.errors import UsageError
from ckpt_cli.ops.convert import convert
from ckpt_cli.ops.inspect import InspectOptions, inspect
from ckpt_cli.ops.prune.retention import PrunePolicy
from ckpt_cli.ops.validate import validate
from ckpt_cli.ops.watch.wake import make_waker
from ckpt_cli.parts import parse_part
from ckpt_cli.storage import parse_options
from ckpt_cli.storage.reads import memory_budget
from tests.conftest import run_cli
from tests.helpers.makers import tiny_state_dict

pytestmark = pytest.mark.requires_torch


@pytest.fixture
def good(tmp_path: Path) -> Path:
    """A safetensors file, and beside it ``run/``: a run directory of three checkpoints."""
    sd = tiny_state_dict()
    for step in (1, 2, 3):
        (tmp_path / "run" / f"checkpoint-{step}").mkdir(parents=True)
        save_file(sd, str(tmp_path / "run" / f"checkpoint-{step}" / "model.safetensors"))
    save_file(sd, str(tmp_path / "good.safetensors"))
    return tmp_path / "good.safetensors"


@pytest.fixture
def run_dir(good: Path) -> Path:
    return good.parent / "run"


# -- the library names its parameters ------------------------------------------------------------

def test_library_errors_name_the_parameter(good: Path, tmp_path: Path) -> None:
    cases = [
        (lambda: convert(good, tmp_path / "o.safetensors", to="fp12"),
         "to must be fp16, bf16, fp32, fp8 or keep, not 'fp12'", ("to",)),
        (lambda: validate(good, manifest_hash="bogus"),
         "manifest_hash must be one of xxh3_128, blake3, sha256, not 'bogus'",
         ("manifest_hash",)),
        (lambda: memory_budget(1000),
         "max_memory must be at least 64MiB (one piece of a tensor), not 1,000 bytes",
         ("max_memory",)),
        (lambda: inspect(good, InspectOptions(sort="bogus")),  # type: ignore[arg-type]
         "sort must be name or size, not 'bogus'", ("sort",)),
        (lambda: parse_part("0/4"), "part 0/4: K must be between 1 and N (parts count from 1)",
         ("part",)),
        (lambda: parse_options(["novalue"]), "storage_options wants KEY=VALUE, not 'novalue'",
         ("storage_options",)),
        (lambda: make_waker("bogus", tmp_path), "wake must be one of auto, events, poll, not "
         "'bogus'", ("wake",)),
        (lambda: PrunePolicy(keep_best=1).check(),
         "keep_best needs metric NAME (e.g. metric eval_loss)", ("keep_best", "metric")),
    ]
    for call, message, params in cases:
        with pytest.raises(UsageError) as e:
            call()
        assert e.value.message == message
        assert e.value.params == params and e.value.param == params[0]
        assert "--" not in str(e.value)


def test_library_hints_name_the_parameter() -> None:
    with pytest.raises(UsageError) as e:
        parse_part("auto", env={})
    assert e.value.message.startswith("part auto: no launcher found in the environment")
    assert e.value.hint == "give part K/N" and e.value.params == ("part",)
    with pytest.raises(UsageError) as e:
        PrunePolicy().check()
    assert e.value.message == (
        "say what to keep: keep N, keep_every STEPS, keep_best N metric NAME, older_than AGE "
        "or max_total_size SIZE (or what to thin: thin_after N)")


# -- the command line words them as its flags ---------------------------------------------------

# (arguments, the error's message as printed, its hint); {good}, {run} and {tmp} are filled in.
CLI_CASES = [
    (["convert", "{good}", "--to", "fp12", "-o", "{tmp}/o.safetensors"],
     "--to must be fp16, bf16, fp32, fp8 or keep, not 'fp12'", None),
    # A value that is a parameter's name stays as it was given.
    (["convert", "{good}", "--to", "to", "-o", "{tmp}/o.safetensors"],
     "--to must be fp16, bf16, fp32, fp8 or keep, not 'to'", None),
    (["convert", "{good}", "--dequantize", "-o", "{tmp}/o.safetensors"],
     "--dequantize needs --to bf16, fp16 or fp32", None),
    (["convert", "{good}", "--to", "fp8", "--format", "pt", "-o", "{tmp}/o"],
     "--to fp8 writes safetensors (an HF directory); not --output-format pt", None),
    # The library's manifest_hash is validate's --manifest-hash.
    (["validate", "{good}", "--manifest-hash", "bogus"],
     "--manifest-hash must be one of xxh3_128, blake3, sha256, not 'bogus'", None),
    # A parameter before a colon is worded too.
    (["validate", "{good}", "--require", "nothing"],
     "--require: unknown requirement 'nothing'; choose from optimizer, step", None),
    (["inspect", "{good}", "--sort", "bogus"], "--sort must be name or size, not 'bogus'", None),
    (["diff", "{good}", "{good}", "--filter", "nomatch*"],
     "--name-glob 'nomatch*' matches no tensor on either side", None),
    # "to keep:" and "a part" are English, not the parameters keep and part.
    (["prune", "{run}", "--dry-run"],
     "say what to keep: --keep N, --keep-every STEPS, --keep-best N --metric NAME, "
     "--older-than AGE or --max-total-size SIZE (or what to thin: --thin-after N)", None),
    (["validate", "{good}", "--part", "0/2"],
     "--part 0/2: K must be between 1 and N (parts count from 1)", None),
    # Each flag is its parameter's name: --measure-dir, --from-path, --async-save.
    (["plan", "--params", "7B", "--measure-size", "1GB"],
     "--measure-size and --measure-streams need --measure-dir DIR", None),
    (["plan", "--params", "7B", "--input-format", "dcp"],
     "--input-format applies to --from-path PATH", None),
    (["plan", "--params", "7B", "--bandwidth", "10MB/s", "--mtbf", "1h"],
     "the checkpoint write time (2h 43m) is at least twice the MTBF (1h): Daly's formula "
     "does not apply there and the run would spend most of its time saving and redoing work; "
     "use faster storage, --async-save, or a more reliable job", None),
    # A hint naming a flag: --overwrite in every command (--force is its alias).
    (["convert", "{good}", "-o", "{tmp}/exists.safetensors"], "already exists",
     "pass --overwrite to replace it"),
    (["sample", "{tmp}/notes"], "already exists", "pass --overwrite to replace it"),
]


def _args(args: list[str], good: Path, run: Path, tmp: Path) -> list[str]:
    return [a.format(good=good, run=run, tmp=tmp) for a in args]


def _alone(argv: list[str]) -> tuple[int, str]:
    """Exit code and stderr of ``argv`` run by an app built with its command alone, as
    ``ckpt COMMAND ...`` runs: the other commands' options are not there to be asked."""
    r = CliRunner().invoke(build(argv[0]), argv, prog_name="ckpt",  # type: ignore[arg-type]
                           env={"NO_COLOR": "1", "COLUMNS": "100", "TERM": "dumb"})
    return r.exit_code, r.stderr


@pytest.mark.parametrize("args,message,hint", CLI_CASES, ids=lambda v: str(v)[:40])
def test_cli_words_parameters_as_flags(args: list[str], message: str, hint: str | None,
                                       good: Path, run_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "exists.safetensors").write_bytes(b"x")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "notes.txt").write_text("not a sample")
    argv = _args(args, good, run_dir, tmp_path)
    r = run_cli(*argv)
    assert r.exit_code == 2, r.output
    first, *rest = r.stderr.splitlines()
    assert first.startswith("ckpt: error: ") and message in first, r.stderr
    assert ("hint: " + hint in rest) if hint else not any("hint: --" in x for x in rest)
    assert _alone(argv) == (r.exit_code, r.stderr)
    # No parameter name the library used is left on the line.
    for name in ("manifest_algorithm", "measure_dir", "from_path", "async_save", "keep_best",
                 "max_total_size", "older_than", "thin_after", "filter_glob"):
        assert name not in r.stderr
    # --json: the document says the same, in the same words.
    r = run_cli(*argv, "--json")
    doc = json.loads(r.stdout)
    assert doc["exit_code"] == 2 and r.exit_code == 2
    err = doc["error"]
    assert message in err["message"] and err["text"].endswith(err["message"])
    assert r.stderr.splitlines()[0] == f"ckpt: error: {err['text']}"
    assert err["hint"] == hint if hint else not (err["hint"] or "").startswith("--")


def test_cli_words_the_determiner_case_and_the_hint_apart(good: Path) -> None:
    # "no part of" is English; the hint's "part K/N" is the parameter.
    r = run_cli("validate", good, "--finalize")
    assert r.exit_code == 2
    assert "nothing to finalize: no part of the validation of" in r.stderr, r.stderr
    assert "hint: run the parts with --part K/N first" in r.stderr


def test_cli_words_a_url_refused_while_parsing() -> None:
    # A path argument's URL is refused by its parser (click's message), worded all the same.
    r = run_cli("inspect", "s3://user:pw@bucket/x")
    assert r.exit_code == 2
    assert r.stderr.strip() == ("ckpt: error: Invalid value for 'path': s3://***@bucket/x: "
                                "credentials in a URL are not accepted; use the standard "
                                "environment variables or --storage-option")


def test_watch_words_the_flags_it_shares_with_prune(run_dir: Path) -> None:
    # watch has no --keep-best or --older-than of its own: the retention rule's error names
    # prune's flags, as it always did.
    r = run_cli("watch", run_dir, "--once", "--thin-to", "bf16")
    assert r.exit_code == 2
    assert _alone(["watch", str(run_dir), "--once", "--thin-to", "bf16"]) == (2, r.stderr)
    assert r.stderr.splitlines()[0] == (
        "ckpt: error: say what to keep: --keep N, --keep-every STEPS, --keep-best N --metric "
        "NAME, --older-than AGE or --max-total-size SIZE (or what to thin: --thin-after N)")



def test_each_alias_names_a_real_option() -> None:
    import typer

    from ckpt_cli.cli.app import app
    from ckpt_cli.cli.errors import _CLI_NAMES

    commands = typer.main.get_command(app).commands  # type: ignore[attr-defined]
    options = {name: {p.name for p in c.params if p.param_type_name == "option"}
               for name, c in commands.items()}
    for command, aliases in _CLI_NAMES.items():
        for cli in aliases.values():
            having = [n for n, o in options.items() if cli in o]
            assert (having if command == "*" else command in having), (command, cli)
