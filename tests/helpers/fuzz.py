"""Fuzzing every reader through the commands: seeds written by the real libraries, mutations
of their bytes and of their structures, each case run in-process under a time and a memory
limit. Shared by ``tests/test_fuzz.py`` (a small, derandomized run in CI) and
``bench/fuzz.py`` (a long random one, ``--duration``).

A case is one mutated copy of one seed and one command on it. It passes when the command ends
with exit 0, 1 or 2 (prune's refusal, 3, too), one error line (and hints) when it is 2, no
internal error (101) or traceback, within :data:`TIME_LIMIT` seconds, and without the
process's peak resident memory growing by more than :data:`MEMORY_BUDGET`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import struct
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hypothesis import strategies as st

from tests.conftest import run_cli, third_party_quiet

SPARSE = 2 << 30
"""The size of a sparse file a mutation leaves (past every side-file cap)."""
TIME_LIMIT = 20.0
"""Seconds one case may take (a hang is a failure, not a stuck suite)."""
MEMORY_BUDGET = 512 << 20
"""How much one case may raise the process's peak resident memory (the seeds are kilobytes:
anything near this is a read sized by a declared number, not by the file)."""

# --- the seeds: one small checkpoint per format, written by the real libraries ---------------


@dataclass(frozen=True)
class Seed:
    """A checkpoint to mutate: the argument commands take, and the files a mutation may hit."""

    name: str
    root: Path  # the directory copied for each case
    arg: str  # the checkpoint argument, relative to the copy
    kind: str  # "file", "dir" or "run"

    def files(self) -> list[str]:
        """The files of the seed, relative to its root, in a stable order."""
        return sorted(str(p.relative_to(self.root)) for p in self.root.rglob("*") if p.is_file())


def build_seeds(base: Path) -> list[Seed]:
    """Write the seed corpus under ``base`` (a few seconds, a few hundred kilobytes)."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    from tests.helpers.makers import hf_sharded, tiny_state_dict, training_checkpoint

    seeds = []
    d = base / "safetensors"
    d.mkdir(parents=True)
    save_file(tiny_state_dict(), d / "model.safetensors",
              metadata={"step": "100", "epoch": "2", "format": "pt"})
    seeds.append(Seed("safetensors", d, "model.safetensors", "file"))

    d = base / "torch"
    d.mkdir()
    torch.save(training_checkpoint(), d / "ck.pt")
    seeds.append(Seed("torch", d, "ck.pt", "file"))

    d = base / "legacy"
    d.mkdir()
    torch.save({"w": torch.arange(6.0).reshape(2, 3), "step": 3}, d / "ck.pt",
               _use_new_zipfile_serialization=False)
    seeds.append(Seed("legacy", d, "ck.pt", "file"))

    d = base / "hf"
    d.mkdir()
    hf_sharded(d, tiny_state_dict(), max_shard_size=700)
    (d / "config.json").write_text(json.dumps({"torch_dtype": "float32",
                                               "architectures": ["X"], "hidden_size": 8}))
    seeds.append(Seed("hf", d, ".", "dir"))

    d = base / "fp8"
    d.mkdir()
    save_file({"l.weight": torch.randn(128, 128).to(torch.float8_e4m3fn),
               "l.weight_scale_inv": torch.ones(1, 1), "n.weight": torch.ones(8)},
              d / "model.safetensors")
    (d / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16", "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
        "modules_to_not_convert": ["n"]}}))
    seeds.append(Seed("fp8", d, ".", "dir"))

    d = base / "dcp"
    with third_party_quiet():
        dcp.save({"model": dict(tiny_state_dict()), "extra": {"step": 7}},  # type: ignore[attr-defined]
                 checkpoint_id=str(d))
    seeds.append(Seed("dcp", d, ".", "dir"))

    d = base / "run"
    for step in (100, 200):
        (d / f"step_{step}").mkdir(parents=True)
        torch.save({"model": {"w": torch.full((4,), float(step))}, "step": step},
                   d / f"step_{step}" / "checkpoint.pt")
    (d / "trainer_state.json").write_text(json.dumps({
        "best_model_checkpoint": "step_100", "log_history": [
            {"step": 100, "eval_loss": 1.5}, {"step": 200, "eval_loss": 1.2}]}))
    (d / "latest").write_text("step_200\n")
    r = run_cli("watch", d, "--once", "--settle", "0s")  # writes manifests and the ledger
    assert r.exit_code == 0, r.output
    seeds.append(Seed("run", d, ".", "run"))
    seeds.extend(hostile_seeds(base))
    return seeds


def hostile_seeds(base: Path) -> list[Seed]:
    """Hostile files of issue #46 (``tests/test_small_holes.py``): a torch zip whose
    ``data.pkl`` hides a second pickle after STOP; a run whose checkpoint links a file of
    random bytes outside the run, beside a name with a newline; FP8 scales the shared scale
    rule refuses (0-d under a block config, subnormal BF16). Seeded for ``bench.fuzz`` and
    the unmutated-seed check; the mutated CI run keeps to :data:`tests.test_fuzz.SEEDS`."""
    from safetensors.torch import save_file

    seeds = []
    d = base / "hidden-pickle"
    d.mkdir()
    torch.save({"w": torch.ones(2, 2)}, d / "plain.pt")
    with zipfile.ZipFile(d / "plain.pt") as zin, \
            zipfile.ZipFile(d / "ck.pt", "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename.endswith("/data.pkl"):
                data += b"\x80\x02cos\nsystem\nX\x04\x00\x00\x00true\x85R."
            zout.writestr(info.filename, data)
    (d / "plain.pt").unlink()
    seeds.append(Seed("hidden-pickle", d, "ck.pt", "file"))

    d = base / "linked"
    (d / "outside").mkdir(parents=True)
    (d / "outside" / "secret").write_bytes(struct.pack("<Q", 3_619_251_681_095_544_690)
                                           + os.urandom(256))
    for step in (1, 2):
        (d / "run" / f"checkpoint-{step}").mkdir(parents=True)
        (d / "run" / f"checkpoint-{step}" / "trainer_state.json").write_text(
            json.dumps({"global_step": step, "log_history": []}))
    (d / "run" / "checkpoint-1" / "model.safetensors").symlink_to("../../outside/secret")
    save_file({"w": torch.ones(2, 2)}, d / "run" / "checkpoint-2" / "model.safetensors")
    (d / "run" / "checkpoint-3\n").mkdir()
    seeds.append(Seed("linked", d, "run", "run"))

    d = base / "fp8-scales"
    d.mkdir()
    sub = torch.full((1, 1), 1e-39, dtype=torch.bfloat16)  # subnormal BF16
    save_file({"a.weight": torch.randn(128, 128).to(torch.float8_e4m3fn),
               "a.weight_scale_inv": torch.tensor(0.01),  # 0-d under a block config
               "b.weight": torch.randn(128, 128).to(torch.float8_e4m3fn),
               "b.weight_scale_inv": sub}, d / "model.safetensors")
    (d / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}))
    seeds.append(Seed("fp8-scales", d, ".", "dir"))
    return seeds


# --- mutations -----------------------------------------------------------------------------

INTERESTING_NUMBERS = ("0", "-1", "1", "255", "65536", "4294967296", "9223372036854775807",
                       "9223372036854775808", "18446744073709551615", "1e400", "-0", "9" * 40,
                       "9" * 5000, "\u00b2", "\u0663", "1.5", "NaN")
INTERESTING_JSON: tuple[Any, ...] = (
    None, True, 0, -1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1, 1e308, "", "\u00b2", "9" * 5000,
    "a\nb\x1b[2K", "../../etc/passwd", "/abs", [], {}, [0, 2**64 - 1], [-1, 5], [[[[[]]]]],
    {"__metadata__": {}}, "F8_E4M3", "BOOL", "F4", [2**62, 2**62], list(range(70)))
# Pickle opcode runs a hostile or careless writer could leave in a pickle.
PICKLE_SNIPPETS = (b"cos\nsystem\n", b"c__torch__.os\nsystem\n", b"(" * 2000, b"]" * 3000,
                   b"\x8a\x08" + b"\xff" * 8, b"\x8b\xff\xff\xff\x7f", b"J\xff\xff\xff\xff",
                   b"h\xff", b"j\xff\xff\xff\xff", b"\x95" + b"\xff" * 8, b"N" * 100 + b"t",
                   b"X\xff\xff\xff\xff", b"\x80\x05", b"}" * 2000 + b"s" * 10, b".",
                   b"I99999999999999999999999999\n", b"L" + b"9" * 5000 + b"L\n",
                   b"ctorch._utils\n_rebuild_tensor_v2\n")


def _at(data: bytes, frac: float) -> int:
    return min(len(data), int(frac * (len(data) + 1)))


def _json_paths(doc: Any, limit: int = 400) -> list[tuple[Any, Any]]:
    """(container, key) of every value in a JSON document, breadth first, at most ``limit``."""
    out: list[tuple[Any, Any]] = []
    queue = [doc]
    while queue and len(out) < limit:
        node = queue.pop(0)
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(
            node, list) else ()
        for k, v in items:
            out.append((node, k))
            if isinstance(v, (dict, list)):
                queue.append(v)
    return out


def _edit_json(text: bytes, pick: int, value: Any, rename: bool) -> bytes | None:
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    paths = _json_paths(doc)
    if not paths:
        return None
    node, key = paths[pick % len(paths)]
    if rename and isinstance(node, dict):
        node[f"{key}\u0000" if pick % 2 else str(value)[:40]] = node.pop(key)
    else:
        node[key] = value
    return json.dumps(doc).encode()


def _safetensors_header(data: bytes) -> tuple[int, bytes] | None:
    if len(data) < 8:
        return None
    (n,) = struct.unpack("<Q", data[:8])
    if not 0 < n <= len(data) - 8:
        return None
    return n, data[8:8 + n]


def _zip_payloads(data: bytes) -> list[tuple[str, int, int]]:
    """(name, payload offset, size) of a zip's records, from its local headers."""
    import io

    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            infos = zf.infolist()
    except (zipfile.BadZipFile, ValueError, OSError, EOFError):
        return []
    out = []
    for i in infos:
        at = i.header_offset
        if at + 30 > len(data):
            continue
        n, m = struct.unpack_from("<HH", data, at + 26)
        out.append((i.filename, at + 30 + n + m, i.compress_size))
    return out


@dataclass(frozen=True)
class Mutation:
    """One change to one file of a seed, described for a failure report."""

    file: int  # index into Seed.files() (modulo)
    op: str
    a: float
    b: int
    value: Any

    def apply(self, data: bytes) -> bytes:
        """The mutated bytes."""
        op, a, b = self.op, self.a, self.b
        if op == "flip":
            out = bytearray(data)
            if out:
                for k in range(1 + b % 4):
                    # bias towards the first and last KiB, where headers and directories live
                    region = (a * (k + 1)) % 1.0
                    i = (int(region * 1024) if k % 3 == 0 else len(out) - 1 - int(region * 1024)
                         if k % 3 == 1 else int(region * len(out))) % len(out)
                    out[i] ^= 1 << (b >> (k + 2)) % 8
            return bytes(out)
        if op == "truncate":
            return data[:_at(data, a)]
        if op == "insert":
            i = _at(data, a)
            return data[:i] + bytes(self.value) + data[i:]
        if op == "number":
            runs = list(re.finditer(rb"[0-9]+", data[:1 << 16]))
            if not runs:
                return data
            m = runs[b % len(runs)]
            return data[:m.start()] + str(self.value).encode() + data[m.end():]
        if op in ("json", "json-key"):
            edited = self.with_json(data, self.value, rename=op == "json-key")
            return data if edited is None else edited
        if op == "deep":  # a value nested self.value deep, where a JSON value was
            marker = "\u0000deep\u0000"
            edited = self.with_json(data, marker)
            if edited is None:
                return data
            bomb = (b"[" * int(self.value) + b"]" * int(self.value))
            return edited.replace(json.dumps(marker).encode(), bomb, 1)
        if op == "metadata":  # safetensors metadata ckpt reads numbers and JSON from
            head = _safetensors_header(data)
            if head is None or data[8:9] != b"{":
                return data
            try:
                header = json.loads(head[1])
            except ValueError:
                return data
            keys = ("step", "global_step", "epoch", "ckpt.step", "ckpt.epoch",
                    "ckpt.quantization_config")
            meta = header.setdefault("__metadata__", {})
            if isinstance(meta, dict):
                meta[keys[b % len(keys)]] = str(self.value)
            raw = json.dumps(header).encode()
            return struct.pack("<Q", len(raw)) + raw + data[8 + head[0]:]
        if op == "duplicate-key":
            i = data.find(b'"data_offsets"')
            j = data.find(b'"', data.find(b"{", 9) + 1) if i < 0 else i
            if j <= 0:
                return data
            return data[:j] + b'"data\\u005foffsets":[0,0],' + data[j:]
        if op in ("record", "pickle"):
            records = _zip_payloads(data)
            if op == "pickle":
                records = [r for r in records if r[0].endswith(".pkl")] or records
            if not records:  # not a zip (a legacy file, .metadata): the whole file
                lo, size = 0, len(data)
            else:
                _, lo, size = records[b % len(records)]
            i = lo + int(a * size)
            if op == "record":
                out = bytearray(data)
                for k, byte in enumerate(bytes(self.value)[:16]):
                    if i + k < min(len(out), lo + size):
                        out[i + k] = byte
                return bytes(out)
            return data[:i] + self.value + data[i:]
        raise AssertionError(op)

    def with_json(self, data: bytes, value: Any, *, rename: bool = False) -> bytes | None:
        """``data`` with one JSON value replaced: in a safetensors header, one line of JSON
        lines (the ledger), or a JSON file; None when ``data`` holds no JSON."""
        b = self.b
        head = _safetensors_header(data)
        if head is not None and data[8:9] == b"{":
            edited = _edit_json(head[1], b, value, rename)
            if edited is not None:
                return struct.pack("<Q", len(edited)) + edited + data[8 + head[0]:]
        lines = data.split(b"\n")
        if len(lines) > 2:  # JSON lines (the ledger): edit one line
            k = b % len(lines)
            edited = _edit_json(lines[k], b // 7, value, rename)
            if edited is None:
                return None
            lines[k] = edited
            return b"\n".join(lines)
        return _edit_json(data, b, value, rename)


def mutations() -> st.SearchStrategy[Mutation]:
    """Hypothesis strategy of mutations (every kind, weighted towards structure)."""
    files = st.integers(0, 1000)
    frac = st.floats(0, 1, allow_nan=False)
    ints = st.integers(0, 2**20)
    junk = st.binary(min_size=1, max_size=40)
    return st.one_of(
        st.builds(Mutation, files, st.just("flip"), frac, ints, st.none()),
        st.builds(Mutation, files, st.just("truncate"), frac, ints, st.none()),
        st.builds(Mutation, files, st.just("insert"), frac, ints, junk),
        st.builds(Mutation, files, st.just("number"), frac, ints,
                  st.sampled_from(INTERESTING_NUMBERS)),
        st.builds(Mutation, files, st.sampled_from(["json", "json-key"]), frac, ints,
                  st.sampled_from(INTERESTING_JSON)),
        st.builds(Mutation, files, st.just("duplicate-key"), frac, ints, st.none()),
        st.builds(Mutation, files, st.just("deep"), frac, ints,
                  st.sampled_from([70, 129, 1000, 1100, 100_000])),
        st.builds(Mutation, files, st.just("metadata"), frac, ints,
                  st.sampled_from((*INTERESTING_NUMBERS, "[" * 5000 + "]" * 5000))),
        st.builds(Mutation, files, st.just("special"), frac, ints,
                  st.sampled_from(["fifo", "dev-zero", "sparse"])),
        st.builds(Mutation, files, st.just("record"), frac, ints, junk),
        st.builds(Mutation, files, st.just("pickle"), frac, ints,
                  st.sampled_from(PICKLE_SNIPPETS)),
    )


# --- commands and the check ------------------------------------------------------------------

COMMANDS = ("inspect", "validate", "diff", "convert", "plan", "consolidate", "prune",
            "resume-path", "stats")


def command_args(command: str, seed: Seed, case: Path, pristine: Path, out: Path,
                 json_out: bool) -> list[str | Path] | None:
    """The arguments of ``command`` on the mutated copy ``case`` (None: not for this seed)."""
    arg = case / seed.arg
    tail = ["--json"] if json_out else []
    if command == "inspect":
        return ["inspect", arg, *tail]
    if command == "validate":
        return ["validate", arg, *tail]
    if command == "diff":
        return ["diff", pristine / seed.arg, arg, *tail]
    if command == "plan":
        return ["plan", "--from", arg, "--bandwidth", "1GB/s", *tail]
    if command == "convert" and seed.kind != "run":
        suffix = ".safetensors" if seed.kind == "file" else ""
        extra = (["--to", "bf16"] if seed.name == "fp8" else
                 ["--to", "bf16", "--dequantize"] if seed.name == "fp8-scales" else [])
        return ["convert", arg, "-o", out / f"out{suffix}", *extra, *tail]
    if command == "consolidate" and seed.name in ("dcp", "hf"):
        return ["consolidate", arg, "-o", out / "consolidated", *tail]
    if command == "prune" and seed.kind == "run":
        return ["prune", arg, "--keep", "1", "-n", *tail]
    if command == "resume-path" and seed.kind == "run":
        return ["resume-path", arg, *tail]
    if command == "stats":  # every seed: a checkpoint, or a run's table; no cache written
        return ["stats", arg, "--no-cache", *tail]
    return None


def commands_for(seed: Seed) -> list[str]:
    """The commands that take ``seed``."""
    probe = Path("/nonexistent")
    return [c for c in COMMANDS
            if command_args(c, seed, probe, probe, probe, json_out=False) is not None]


class CaseTimeout(BaseException):
    """A case ran past :data:`TIME_LIMIT` (a BaseException: no handler turns it into exit
    101)."""


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1)) << 10  # type: ignore[union-attr]


def _reset_peak() -> int:
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _peak_rss()


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    def fire(signum: int, frame: Any) -> None:
        raise CaseTimeout(f"still running after {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@dataclass
class Outcome:
    """What one case did."""

    args: list[str]
    exit_code: int
    seconds: float
    grew: int
    problem: str | None


def run_case(args: list[str | Path]) -> Outcome:
    """Run one command in-process under the limits and judge it."""
    base = _reset_peak()
    t0 = time.monotonic()
    shown = [str(a) for a in args]
    try:
        with _time_limit(TIME_LIMIT):
            r = run_cli(*args)
    except CaseTimeout as e:
        return Outcome(shown, -1, time.monotonic() - t0, 0, f"hang: {e}")
    took = time.monotonic() - t0
    grew = max(0, _peak_rss() - base)
    problem = judge(args[0] == "prune", r.exit_code, r.stdout, r.stderr)
    if problem is None and grew > MEMORY_BUDGET:
        problem = f"peak memory grew by {grew >> 20} MiB (budget {MEMORY_BUDGET >> 20} MiB)"
    return Outcome(shown, r.exit_code, took, grew, problem)


def judge(prune: bool, code: int, stdout: str, stderr: str) -> str | None:
    """Why an outcome is a failure, or None."""
    if code not in ((0, 1, 2, 3) if prune else (0, 1, 2)):
        return f"exit {code}: {stderr.strip()[-300:]}"
    if "Traceback" in stdout + stderr or "internal error" in stderr:
        return f"traceback or internal error: {stderr.strip()[-300:]}"
    if code == 2 and stderr.strip():
        first, *rest = stderr.strip().splitlines()
        if not first.startswith("ckpt: error: ") or not all(x.startswith("hint: ")
                                                             for x in rest):
            return f"exit 2 without one error line: {stderr.strip()[:300]!r}"
    return None


def fuzz_one(seed: Seed, mutation: Mutation, command: str, json_out: bool,
             work: Path) -> Outcome | None:
    """Copy ``seed``, apply ``mutation``, run ``command``; None when the command does not
    apply to the seed."""
    case = work / "case"
    out = work / "out"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(seed.root, case, symlinks=True)
    out.mkdir()
    files = seed.files()
    target = case / files[mutation.file % len(files)]
    if mutation.op == "special":
        # the file replaced by what no reader may open blocking or read whole
        target.unlink()
        if mutation.value == "fifo":
            os.mkfifo(target)
        elif mutation.value == "dev-zero":
            target.symlink_to("/dev/zero")
        else:
            with open(target, "wb") as f:
                f.truncate(SPARSE)
    else:
        target.write_bytes(mutation.apply(target.read_bytes()))
    args = command_args(command, seed, case, seed.root, out, json_out)
    if args is None:
        return None
    return run_case(args)

