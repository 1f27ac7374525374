"""Every shell and Python example in README.md and docs/*.md runs as written (issue 39).

Each fenced ``bash`` block is split into commands (a trailing backslash continues a line) and
run with the real ``ckpt`` (``python -m ckpt_cli`` on the PATH as ``ckpt``) by bash, in a
fresh copy of a workspace holding what the examples name: ``demo-run`` (``ckpt sample``), a
Lightning run (``ckpts/``, with ``last.ckpt``), an HF Trainer run (``out/``) and a Megatron
save (``megatron_save/``). Commands of one block run in order in the same directory, so an
example may use what the one before it wrote. A command must exit 0, or 1 where its comment
starts with ``exit N:`` (``# exit 1: training moved``, a diff that finds differences).

A ``python`` block runs as a script (``python -``) in the same workspace, and must exit 0;
those of docs/python.md build on each other and are run in order, in one namespace, by
``tests/api`` instead.

An HTML comment on the line before a block says how it runs instead:

- ``<!-- docs-test: fresh -->``: in an empty directory (``ckpt sample`` itself).
- ``<!-- docs-test: stop N -->``: a command that runs until stopped (``ckpt watch`` beside
  training): stopped with SIGTERM after N seconds, it must exit 143 then, and not before.
- ``<!-- docs-test: s3 -->``: against a real S3 endpoint (moto's server, started here) holding
  ``demo-run`` under ``s3://ml-ckpts/demo-run/``.
- ``<!-- docs-test: skip REASON -->``: not run, for one of :data:`SKIP_REASONS` only.
- ``<!-- docs-test: then -->``: after the block before it, in its directory (a ``bash`` block
  using what a ``python`` block just wrote: that block then runs as ``python -`` first).
- ``<!-- docs-test: output -->`` before a ``text`` block: a captured example. Each line
  starting with ``$ `` is a command, the lines after it what it prints (stdout and stderr, at
  100 columns); run in the workspace in order, each must print that, up to what changes from
  run to run: dates and times, durations (``0.45s``, ``1m 5s``, ``7m``), the workspace's
  path, and where lines wrap and how many spaces separate words. ``ckpt sample demo-run`` is
  not run again: the workspace's own ``ckpt sample`` printed it.

Pages are README.md and every page under docs/ (docs/prune/thinning.md too).

``ckpt stats`` keeps its cache in a directory of the test's own (``CKPT_CACHE_DIR``), never in
the user's.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
MARKER = re.compile(r"<!-- docs-test: (\w+)(?: ([^>]*?))? -->")
SKIP_REASONS = {
    "installs": "installs packages into a new virtualenv (the quick start; CI runs its steps)",
    "ci": "runs the whole test suite (.ci/run, python -m pytest), which is what CI does",
    "benchmark": "a benchmark: minutes and GBs of generated data (bench/ runs them)",
    "endpoint": "names the reader's own S3-compatible endpoint and credentials (the s3 "
                "examples run against moto's server)",
}
"""The only reasons a block may not run: each says who runs it instead."""

pytestmark = [pytest.mark.requires_torch,
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    commands: tuple[tuple[str, int], ...]
    """``(command, expected exit code)`` each (a Python block: its source, 0)."""
    how: str
    reason: str
    lang: str = "bash"

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _commands(lines: list[str]) -> tuple[tuple[str, int], ...]:
    out: list[tuple[str, int]] = []
    cur = ""
    for line in lines:
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            continue
        cur += line.rstrip()
        if cur.endswith("\\"):
            cur = cur[:-1] + " "
            continue
        # "# exit N: why" at the start of its comment: the status it must end with
        want = re.search(r"#\s*exit (\d+):", cur)
        out.append((cur, int(want[1]) if want else 0))
        cur = ""
    return tuple(out)


def blocks() -> list[Block]:
    found: list[Block] = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        i = 0
        while i < len(lines):
            lang = lines[i].strip().removeprefix("```")
            if lines[i].strip().startswith("```") and (
                    lang in ("bash", "python") or (lang == "text" and i and MARKER.search(
                        lines[i - 1]) and MARKER.search(lines[i - 1])[1] == "output")):
                start = i
                body: list[str] = []
                i += 1
                while lines[i].strip() != "```":
                    body.append(lines[i])
                    i += 1
                m = MARKER.search(lines[start - 1]) if start else None
                how, reason = (m[1], m[2] or "") if m else ("run", "")
                commands = (_commands(body) if lang == "bash" else _outputs(body)
                            if lang == "text" else ((textwrap.dedent("\n".join(body)), 0),))
                # docs/python*.md's examples build on each other (one namespace, in page
                # order): tests/api/test_surface.py runs them so, and they are not run here.
                if how == "then":
                    before = found.pop()
                    assert before.page == page and before.how == "run", (page, start)
                    first = tuple((f"python - <<'PYTHON_BLOCK'\n{src}\nPYTHON_BLOCK", want)
                                  for src, want in before.commands) \
                        if before.lang == "python" else before.commands
                    found.append(Block(page, before.line, first + commands, "run", "", lang))
                elif not (lang == "python" and (page.stem.startswith("python")
                                                or page.parent.name == "python")):
                    found.append(Block(page, start + 1, commands, how, reason, lang))
            elif lines[i].strip().startswith("```"):
                i += 1  # another language's block: skip to its end
                while lines[i].strip() != "```":
                    i += 1
            i += 1
    return found


def _outputs(lines: list[str]) -> tuple[tuple[str, int], ...]:
    """An ``output`` block's ``(command + "\\n" + what it prints, exit status)`` pairs."""
    out: list[tuple[str, int]] = []
    for line in lines:
        if line.startswith("$ "):
            want = re.search(r"#\s*exit (\d+):", line)
            out.append((line[2:].split("  #")[0].strip(), int(want[1]) if want else 0))
        else:
            assert out, f"an output block starts with its command ($ ...): {line!r}"
            out[-1] = (out[-1][0] + "\n" + line, out[-1][1])
    return tuple(out)


BLOCKS = blocks()


def test_markers_are_known_and_skips_say_why() -> None:
    for b in BLOCKS:
        assert b.how in ("run", "fresh", "s3", "skip", "stop", "output"), b.id
        if b.how == "skip":
            assert b.reason in SKIP_REASONS, (b.id, b.reason)
    assert sum(b.how == "skip" for b in BLOCKS) <= 5  # a handful, each named above
    assert len([b for b in BLOCKS if b.how == "run"]) >= 15


@pytest.fixture(scope="session")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the examples name, made by the real writers."""
    from tests.conftest import third_party_quiet
    from tests.helpers.makers import hf_trainer_run, lightning_run, megatron_legacy

    ws = tmp_path_factory.mktemp("docs-workspace")
    r = subprocess.run([sys.executable, "-m", "ckpt_cli", "sample", str(ws / "demo-run")],
                       capture_output=True, text=True, timeout=600, env=_env(ws))
    assert r.returncode == 0, r.stderr
    # What docs/sample.md shows (the progress on stderr came first), for the output test.
    (ws.parent / "sample-output.txt").write_text(r.stderr + r.stdout)
    with third_party_quiet():
        lightning_run(ws / "ckpts", steps=4, every=2,
                      filename="{epoch}-{step}-{train_loss:.4f}")
        hf_trainer_run(ws / "out", steps=4, save_steps=2, evaluate=True)
    megatron_legacy(ws / "megatron_save", tp=1)
    # Saved a while ago, as a run's checkpoints are: prune's --grace (10m) protects only
    # what changed within it.
    past = time.time() - 7200
    for p in ws.rglob("*"):
        os.utime(p, (past, past), follow_symlinks=False)
    return ws


def _env(cwd: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """``ckpt`` on the PATH (this interpreter's ``python -m ckpt_cli``), plain output."""
    bindir = cwd.parent / "docs-bin"
    bindir.mkdir(exist_ok=True)
    shim = bindir / "ckpt"
    if not shim.exists():
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m ckpt_cli "$@"\n')
        shim.chmod(0o755)
    return {**os.environ, "PATH": f"{bindir}{os.pathsep}{Path(sys.executable).parent}"
            f"{os.pathsep}{os.environ.get('PATH', '')}", "NO_COLOR": "1", "COLUMNS": "100",
            "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1",
            "CKPT_CACHE_DIR": str(cwd.parent / "ckpt-cache"), **(extra or {})}


def _run(block: Block, cwd: Path, extra: dict[str, str] | None = None) -> None:
    env = _env(cwd, extra)
    if block.lang == "python":
        (source, _), = block.commands
        r = subprocess.run([sys.executable, "-"], input=source, cwd=cwd, env=env,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"{block.id}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        return
    if block.how == "stop":
        (cmd, _), = block.commands
        p = subprocess.Popen(["bash", "-c", f"exec {cmd}"], cwd=cwd, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            _, err = p.communicate(timeout=float(block.reason))
            pytest.fail(f"{block.id}: `{cmd}` ended by itself (exit {p.returncode})\n{err}")
        except subprocess.TimeoutExpired:
            p.terminate()
            _, err = p.communicate(timeout=60)
        assert p.returncode == 143, f"{block.id}: `{cmd}` exited {p.returncode}\n{err}"
        assert "Traceback" not in err
        return
    for cmd, want in block.commands:
        if "jq" in cmd and shutil.which("jq") is None:
            pytest.skip("jq is not installed")
        r = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], cwd=cwd, env=env,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == want, (
            f"{block.id}: `{cmd}` exited {r.returncode}, not {want}\n{r.stdout[-3000:]}\n"
            f"{r.stderr[-3000:]}")
        assert "Traceback" not in r.stderr, f"{block.id}: `{cmd}`\n{r.stderr[-3000:]}"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.how in ("run", "fresh", "stop")],
                         ids=lambda b: b.id)
def test_example_runs(block: Block, workspace: Path, tmp_path: Path) -> None:
    cwd = tmp_path / "ws"
    if block.how == "fresh":
        cwd.mkdir()
    else:
        shutil.copytree(workspace, cwd, symlinks=True)
        # Copying changed every file's ctime: a watcher lets a save settle (--settle 1s)
        # before it judges it, as it would a save that just landed.
        time.sleep(1.2)
    _run(block, cwd)


_VARIES = [(re.compile(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d(:\d\d)?"), "<time>"),
           (re.compile(r"\b\d+(\.\d+)?(ms|[smhdy])( \d+[smhd])?\b"), "<duration>")]


def _same(text: str, cwd: Path) -> list[str]:
    """``text``'s words, without what changes from run to run (see the module's docstring):
    compared word by word, so a line wrapped at another place (a longer path) is the same."""
    text = text.replace(f"{cwd}{os.sep}", "")
    for pattern, put in _VARIES:
        text = pattern.sub(put, text)
    return text.split()


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.how == "output"], ids=lambda b: b.id)
def test_output_example_is_true(block: Block, workspace: Path, tmp_path: Path) -> None:
    """A captured example is what the command prints on the workspace, run after run."""
    cwd = tmp_path / "ws"
    shutil.copytree(workspace, cwd, symlinks=True)
    time.sleep(1.2)
    for shown, want in block.commands:
        cmd, _, printed = shown.partition("\n")
        if cmd == "ckpt sample demo-run":
            got = (workspace.parent / "sample-output.txt").read_text().replace(
                f"{workspace}{os.sep}", "")
        else:
            r = subprocess.run(["bash", "-c", f"{cmd} 2>&1"], cwd=cwd, env=_env(cwd),
                               capture_output=True, text=True, timeout=600)
            assert r.returncode == want, f"{block.id}: `{cmd}` exited {r.returncode}\n{r.stdout}"
            got = r.stdout
        assert _same(got, cwd) == _same(printed, cwd), (
            f"{block.id}: `{cmd}` printed, not what the page shows:\n{got}")


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.how == "s3"], ids=lambda b: b.id)
def test_s3_example_runs(block: Block, workspace: Path, tmp_path: Path) -> None:
    """The object-storage examples, against moto's S3 server holding the sample run."""
    from tests.helpers import s3

    with s3.moto_endpoint() as (url, _proxy):
        c = s3.client(url)
        for bucket in ("ml-ckpts", "ml-exports"):
            c.create_bucket(Bucket=bucket)
        run = workspace / "demo-run"
        for p in sorted(run.rglob("*")):
            if p.is_file() and not p.is_symlink():
                c.upload_file(str(p), "ml-ckpts", f"demo-run/{p.relative_to(run).as_posix()}")
        cwd = tmp_path / "ws"
        shutil.copytree(workspace, cwd, symlinks=True)
        time.sleep(1.2)
        _run(block, cwd, {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "testing",
                          "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"})
