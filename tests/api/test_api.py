"""The Python API (``ckpt_cli.inspect(...)``...) against the CLI: on the same real checkpoints
(``ckpt sample``'s run: torch files, a 4-rank DCP checkpoint, an HF export) and the same
arguments, ``result.to_dict()`` is the ``--json`` document the command prints."""

from __future__ import annotations

import io
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import Result

import ckpt_cli
from ckpt_cli.errors import CkptError, DestinationExistsError, UsageError

# The fixtures write real checkpoints with torch (``ckpt sample``).
pytestmark = pytest.mark.requires_torch

# What differs between two runs of one command: wall times and throughputs.
_VOLATILE = {"seconds", "bytes_per_second"}


def stable(doc: Any) -> Any:
    """``doc`` without the figures that vary from run to run."""
    if isinstance(doc, dict):
        return {k: stable(v) for k, v in doc.items() if k not in _VOLATILE}
    if isinstance(doc, list):
        return [stable(v) for v in doc]
    return doc


def _json(result: Result, code: int = 0) -> Any:
    assert result.exit_code == code, result.output
    return json.loads(result.stdout)


def test_inspect_is_the_cli_document(sample_run: Path, cli: Callable[..., Result]) -> None:
    r = ckpt_cli.inspect(sample_run, tree=True, depth=2, name_glob="*.attn.*", sort="size")
    doc = r.to_dict()
    assert doc == _json(cli("inspect", sample_run, "--tree", "--depth", "2", "--name-glob",
                            "*.attn.*", "--sort", "size", "--json"))
    assert (doc["schema_version"], doc["command"], doc["kind"]) == (1, "inspect", "run")
    assert r.index is not None and doc["num_parameters"] == r.index.num_parameters > 0
    assert r.tensors and all(".attn." in t.name for t in r.tensors)


def test_inspect_of_one_file(sample_run: Path, cli: Callable[..., Result]) -> None:
    path = sample_run / "step_000100"
    assert ckpt_cli.inspect(str(path), tensors=True).to_dict() == _json(
        cli("inspect", path, "--tensors", "--json"))


def test_validate_is_the_cli_document(sample_run: Path, cli: Callable[..., Result]) -> None:
    seen: list[tuple[str, int, int]] = []
    r = ckpt_cli.validate(sample_run, strict=True, on_progress=lambda *a: seen.append(a))
    assert r.ok and r.valid and r.strict
    doc = r.to_dict()
    assert stable(doc) == stable(_json(cli("validate", sample_run, "--strict", "--json")))
    assert doc["strict"] is True and doc["summary"]["checkpoints"] == len(r.checkpoints) > 1
    # Progress: (phase, bytes done, bytes total), done never beyond total.
    assert seen and all(isinstance(p, str) and 0 <= d <= t for p, d, t in seen if t)


def test_validate_finds_what_the_cli_finds(sample_copy: Path,
                                           cli: Callable[..., Result]) -> None:
    # A shard cut short: the API's verdict and document are the CLI's (exit 1).
    shard = next((sample_copy / "export").glob("*.safetensors"))
    with shard.open("r+b") as f:
        f.truncate(shard.stat().st_size - 100)
    r = ckpt_cli.validate(sample_copy / "export")
    assert not r.ok and not r.valid
    assert any(f.severity == "error" for f in r.findings)
    assert stable(r.to_dict()) == stable(_json(cli("validate", sample_copy / "export",
                                                     "--json"), code=1))


def test_diff_is_the_cli_document(sample_run: Path, cli: Callable[..., Result]) -> None:
    a, b = sample_run / "step_000100", sample_run / "step_000300"
    r = ckpt_cli.diff(a, b, by_module=True, depth=2, rtol=1e-3)
    assert not r.equal
    doc = r.to_dict()
    assert doc == _json(cli("diff", a, b, "--by-module", "--depth", "2", "--rtol", "1e-3",
                            "--json"), code=1)
    assert doc["modules"] and doc["equal"] is False
    same = ckpt_cli.diff(a, a, structure_only=True, all_tensors=True)
    assert same.equal
    assert same.to_dict() == _json(cli("diff", a, a, "--structure-only", "--all", "--json"))


def test_stats_is_the_cli_document(sample_run: Path, cli: Callable[..., Result],
                                   tmp_path: Path) -> None:
    def same(doc: dict[str, Any]) -> dict[str, Any]:
        return {**doc, "read": {k: v for k, v in doc["read"].items() if k != "seconds"}}

    r = ckpt_cli.stats(sample_run, depth=2, cache_dir=tmp_path)
    assert r.run and r.exit_code == 0 and r.last_good is None
    doc = r.to_dict()
    again = _json(cli("stats", sample_run, "--depth", "2", "--cache-dir", tmp_path, "--json"))
    assert same(doc) == same({**again, "read": {**again["read"], "bytes": doc["read"]["bytes"],
                                                "cached_tensors": 0, "computed_tensors":
                                                doc["read"]["computed_tensors"]}})
    assert again["read"]["bytes"] == 0  # the API's call filled the cache
    one = ckpt_cli.stats(sample_run / "step_000300", all_tensors=True, name_glob="*exp_avg_sq",
                         no_cache=True)
    assert one.to_dict() | {"read": None} == _json(cli(
        "stats", sample_run / "step_000300", "--all", "--filter", "*exp_avg_sq", "--no-cache",
        "--json")) | {"read": None}
    assert all(t.name.endswith("exp_avg_sq") for t in one.checkpoints[0].tensors)


def test_convert_is_the_cli_document(sample_run: Path, tmp_path: Path,
                                     cli: Callable[..., Result]) -> None:
    src, out = sample_run / "step_000300", tmp_path / "model"
    seen: list[tuple[str, int, int]] = []
    r = ckpt_cli.convert(src, str(out) + "/", to="bf16", keep_fp32="*norm*",
                         on_progress=lambda *a: seen.append(a))
    doc = r.to_dict()
    shutil.rmtree(out)
    # The same document, its notes naming options as each caller does.
    assert "keep_fp32 '*norm*' matched no tensor of the output" in doc["notes"]
    r.caller = "cli"
    assert stable(r.to_dict()) == stable(_json(cli(
        "convert", src, "-o", str(out) + "/", "--to", "bf16", "--keep-fp32", "*norm*",
        "--json")))
    assert doc["casts"] and (out / "model.safetensors").is_file()
    # Bytes written, counted up to the total announced first.
    assert seen[-1] == ("writing", seen[-1][2], seen[-1][2]) and seen[-1][2] > 0
    with pytest.raises(DestinationExistsError):
        ckpt_cli.convert(src, out, to="bf16")


def test_consolidate_is_the_cli_document(sample_run: Path, tmp_path: Path,
                                         cli: Callable[..., Result]) -> None:
    src, out = sample_run / "step_000400", tmp_path / "full"
    r = ckpt_cli.consolidate(src, out, max_shard_size=0, verify=True)
    doc = r.to_dict()
    shutil.rmtree(out)
    assert stable(doc) == stable(_json(cli("consolidate", src, "-o", out,
                                             "--max-shard-size", "0", "--verify", "--json")))
    assert r.lost_elements == 0 and doc["verified"] == r.tensors > 0


def test_prune_is_the_cli_document(sample_copy: Path, cli: Callable[..., Result]) -> None:
    before = sorted(p.name for p in sample_copy.iterdir())
    r = ckpt_cli.prune(sample_copy, keep=1, grace=0)  # a dry run by default
    assert r.dry_run and r.deleted == [] and r.ok
    doc = r.to_dict()
    cli_doc = _json(cli("prune", sample_copy, "--keep", "1", "--grace", "0", "--dry-run",
                        "--json"))
    # The reasons name options as each caller spells them: keep=1 here, --keep 1 there.
    reasons = [c.pop("reasons") for c in doc["checkpoints"]]
    cli_reasons = [c.pop("reasons") for c in cli_doc["checkpoints"]]
    assert doc == cli_doc
    assert any("newest 1 complete (keep=1)" in rs for rs in reasons)
    assert [[r.replace("keep=1", "--keep 1") for r in rs] for rs in reasons] == cli_reasons
    assert sorted(p.name for p in sample_copy.iterdir()) == before
    doomed = [c["name"] for c in doc["checkpoints"] if c["action"] == "delete"]
    assert doomed
    seen: list[tuple[str, int, int]] = []
    done = ckpt_cli.prune(sample_copy, keep=1, grace="0", dry_run=False,
                          on_progress=lambda *a: seen.append(a))
    assert done.deleted == doomed and not any((sample_copy / n).exists() for n in doomed)
    assert seen[-1] == ("deleting", len(doomed), len(doomed))


def test_plan_is_the_cli_document(cli: Callable[..., Result]) -> None:
    r = ckpt_cli.plan(params="7B", bandwidth="2GB/s", mtbf=12 * 3600, keep=3, interval="30m")
    doc = r.to_dict()
    assert doc == _json(cli("plan", "--params", "7B", "--bandwidth", "2GB/s", "--mtbf", "12h",
                            "--keep", "3", "--interval", "30m", "--json"))
    assert r.daly is not None and doc["intervals"]["daly"]["seconds"] > 0


def test_plan_from_a_checkpoint(sample_run: Path, cli: Callable[..., Result]) -> None:
    r = ckpt_cli.plan(from_path=sample_run, bandwidth=1e9, mtbf="4h")
    assert r.to_dict() == _json(cli("plan", "--from", sample_run, "--bandwidth", "1GB/s",
                                    "--mtbf", "4h", "--json"))


def _events(doc_lines: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in doc_lines.splitlines()]


def test_watch_once_and_resume_path(sample_run: Path, tmp_path: Path,
                                    cli: Callable[..., Result]) -> None:
    mine, theirs = tmp_path / "a", tmp_path / "b"
    shutil.copytree(sample_run, mine, symlinks=True)
    shutil.copytree(sample_run, theirs, symlinks=True)
    assert ckpt_cli.resume_path(mine).path is None
    events: list[Any] = []
    r = ckpt_cli.watch_once(mine, settle=0, on_event=events.append)
    assert r.ok and r.events == events
    assert r.verified == sorted(p.name for p in mine.glob("step_*"))
    printed = cli("watch", theirs, "--once", "--settle", "0", "--json")
    assert printed.exit_code == 0, printed.output

    def same(e: dict[str, Any]) -> dict[str, Any]:
        # The two copies' runs and manifests (their write times) differ, nothing else.
        return {**e, "run": None, "manifest_digest": e["manifest_digest"] is not None}

    doc = r.to_dict()
    assert (doc["command"], doc["ok"]) == ("watch", True)
    assert [same(e) for e in doc["events"]] == [same(e) for e in _events(printed.stdout)]

    resume = ckpt_cli.resume_path(mine, full=True)
    assert resume.ok and resume.path == mine / "step_000400" and resume.step == 400
    cli_doc = _json(cli("resume-path", mine, "--full", "--json"))
    assert resume.to_dict() == cli_doc

    # Retention after the pass, as `ckpt watch --keep 1`: the verified older ones go.
    third = tmp_path / "c"
    shutil.copytree(sample_run, third, symlinks=True)
    kept = ckpt_cli.watch_once(third, settle=0, keep=1, grace=0)
    assert [(e.event, e.deleted) for e in kept.events][-1] == (
        "pruned", ["step_000100", "step_000200", "step_000300"])
    assert ckpt_cli.resume_path(third).path == third / "step_000400"


# -- errors: CkptError subclasses, the CLI's message with keywords for flags ---------------------

def test_errors_name_the_keywords(sample_run: Path, cli: Callable[..., Result]) -> None:
    with pytest.raises(UsageError) as e:
        ckpt_cli.validate(sample_run, manifest_hash="md5")
    printed = cli("validate", sample_run, "--manifest-hash", "md5")
    assert printed.exit_code == e.value.exit_code == 2
    assert f"ckpt: error: {e.value}".replace("manifest_hash", "--manifest-hash") in printed.stderr
    assert e.value.params == ("manifest_hash",) and "--" not in str(e.value)

    with pytest.raises(UsageError, match=r"^sort must be name or size, not 'bogus'$"):
        ckpt_cli.inspect(sample_run, sort="bogus")
    with pytest.raises(UsageError, match="keep_every"):
        ckpt_cli.prune(sample_run, keep_every="ten")
    with pytest.raises(UsageError, match=r"^max_shard_size must be positive"):
        ckpt_cli.convert(sample_run, sample_run / "never", max_shard_size=-1)
    with pytest.raises(CkptError, match=r"does not exist|no such"):
        ckpt_cli.inspect(sample_run / "missing")
    with pytest.raises(UsageError, match="depth must be at least 1"):
        ckpt_cli.diff(sample_run / "step_000100", sample_run / "step_000100", depth=0)


# -- progress: a callback; tqdm is one ---------------------------------------------------------

def test_progress_drives_tqdm(sample_run: Path, tmp_path: Path) -> None:
    from tqdm import tqdm

    out = io.StringIO()
    with tqdm(unit="B", unit_scale=True, file=out, mininterval=0) as bar:
        def show(phase: str, done: int, total: int) -> None:
            bar.set_description(phase, refresh=False)
            bar.total = total
            bar.update(done - bar.n)

        ckpt_cli.convert(sample_run / "step_000100", tmp_path / "m.safetensors", to="fp16",
                         on_progress=show)
        assert bar.n == bar.total > 0
    assert "writing" in out.getvalue()
