"""Splitting one job over many processes: ``--part K/N``, the plan every part shares, receipts.

A job split into N parts (a consolidation over the nodes of a cluster, a validation of 1,000
rank files) runs as N independent processes that do not talk to each other: a torchrun world,
a SLURM array, or N shells. Each one computes the same plan from the source's metadata (the
plan is deterministic), does only its own share, and records what it did in a small receipt
in a staging directory they all see. Whoever finds every receipt there, each matching the plan,
finalizes: the last part to finish, or a later run with ``--finalize``.

This module holds what every command splitting work needs: parsing ``--part``, reading the
part from the launcher's environment, a deterministic assignment of work items to parts, the
plan's fingerprint, and :class:`PartStore`, the staging directory with its receipts and lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from ckpt_cli import storage
from ckpt_cli.errors import CkptError, UsageError
from ckpt_cli.storage.atomic import atomic_file

_SPEC = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")
PLAN_FILE = "plan.json"
RECEIPTS = "receipts"
LOCK_FILE = ".lock"
STAGING_MARKER = ".ckpt-tmp-parts"
"""In the staging directory's name: the run listing, ``prune`` and ``inspect`` see a save in
progress (:data:`ckpt_cli.formats.names.TEMP_MARKERS` holds ``.ckpt-tmp-``)."""


class PartsIncompleteError(CkptError):
    """A finalize found parts missing, or parts planned differently."""

    kind = "parts-incomplete"


@dataclass(slots=True)
class PartOutcome:
    """What one part of a split job did, for the result and ``--json``'s ``part`` object.

    Attributes:
        part: This process's part (None for a ``--finalize`` on its own).
        count: Parts in the plan.
        files: The files this part wrote (relative names).
        finalized: Whether the job is finished (by this process or another part).
        finalized_here: Whether this process finalized it.
        waiting_for: The parts without a receipt yet.
    """

    part: Part | None
    count: int
    files: list[str]
    finalized: bool = False
    finalized_here: bool = False
    waiting_for: list[int] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The ``part`` object of ``--json``."""
        return {"index": self.part.index if self.part else None, "count": self.count,
                "origin": self.part.origin if self.part else "--finalize",
                "files": self.files, "finalized": self.finalized,
                "finalized_here": self.finalized_here, "waiting_for": self.waiting_for or []}

    def describe(self) -> str:
        """One line for people: which part, and what is left."""
        who = f"part {self.part.label} ({self.part.origin})" if self.part else "finalize"
        if self.finalized_here:
            return f"{who}: every part's receipt matched the plan; finalized the output"
        if self.finalized:
            return f"{who}: done; another part finalized the output"
        return (f"{who}: done; waiting for {describe_parts(self.waiting_for or [])} of "
                f"{self.count} (the last to finish finalizes; or run with --finalize)")


@dataclass(frozen=True, slots=True)
class Part:
    """This process's share of a split job.

    Attributes:
        index: Which part, from 1.
        count: How many parts in all.
        origin: Where it came from, for messages (``--part 2/4``, ``torchrun RANK=1``...).
    """

    index: int
    count: int
    origin: str = ""

    @property
    def label(self) -> str:
        """``2/4``."""
        return f"{self.index}/{self.count}"


def parse_part(spec: str | None, env: Mapping[str, str] | None = None) -> Part | None:
    """Read ``--part``: ``K/N`` (1 <= K <= N) or ``auto`` (from the launcher's environment).

    ``auto`` reads, in this order: torchrun's ``RANK`` and ``WORLD_SIZE``; a SLURM array's
    ``SLURM_ARRAY_TASK_ID`` and ``SLURM_ARRAY_TASK_COUNT`` (offset by ``SLURM_ARRAY_TASK_MIN``,
    so ``--array=1-4`` works); ``srun``'s ``SLURM_PROCID`` and ``SLURM_NTASKS``.

    Args:
        spec: The option's value, or None when it was not given.
        env: The environment (default ``os.environ``).

    Returns:
        The :class:`Part`, or None without ``spec``.

    Raises:
        UsageError: A malformed spec, or ``auto`` with no launcher in the environment.
    """
    if spec is None:
        return None
    if spec.strip().lower() == "auto":
        return _from_env(os.environ if env is None else env)
    m = _SPEC.match(spec)
    if not m:
        raise UsageError(f"part must be K/N (e.g. 2/8) or auto, not {spec!r}", param="part")
    k, n = int(m.group(1)), int(m.group(2))
    if n < 1 or not 1 <= k <= n:
        raise UsageError(f"part {spec}: K must be between 1 and N (parts count from 1)",
                         param="part")
    return Part(k, n, f"--part {k}/{n}")


def _from_env(env: Mapping[str, str]) -> Part:
    def num(key: str) -> int | None:
        v = env.get(key, "").strip()
        return int(v) if v.isdigit() else None

    rank, world = num("RANK"), num("WORLD_SIZE")
    if rank is not None and world is not None:
        return _checked(rank + 1, world, f"torchrun RANK={rank} WORLD_SIZE={world}")
    task, count = num("SLURM_ARRAY_TASK_ID"), num("SLURM_ARRAY_TASK_COUNT")
    if task is not None and count is not None:
        low = num("SLURM_ARRAY_TASK_MIN") or 0
        return _checked(task - low + 1, count,
                        f"SLURM array task {task} of {count} (from {low})")
    proc, ntasks = num("SLURM_PROCID"), num("SLURM_NTASKS")
    if proc is not None and ntasks is not None:
        return _checked(proc + 1, ntasks, f"srun SLURM_PROCID={proc} SLURM_NTASKS={ntasks}")
    raise UsageError("part auto: no launcher found in the environment (torchrun's RANK and "
                     "WORLD_SIZE, a SLURM array's SLURM_ARRAY_TASK_ID and "
                     "SLURM_ARRAY_TASK_COUNT, or srun's SLURM_PROCID and SLURM_NTASKS)",
                     hint="give part K/N", param="part")


def _checked(k: int, n: int, origin: str) -> Part:
    if n < 1 or not 1 <= k <= n:
        raise UsageError(f"part auto: {origin} is not a part between 1 and {n} "
                         "(a SLURM array must be contiguous, without a step)", param="part")
    return Part(k, n, origin)


def assign(weights: Sequence[int], count: int) -> list[int]:
    """Deal work items to ``count`` parts so that their total weights are close.

    Largest item first, each to the part with the least weight so far (the lowest-numbered
    on ties): deterministic, so every part computes the same assignment, and within 4/3 of the
    best possible longest part.

    Args:
        weights: Each item's cost (bytes).
        count: How many parts.

    Returns:
        For each item, its part (from 1).
    """
    load = [0] * count
    owner = [0] * len(weights)
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        p = min(range(count), key=lambda p: (load[p], p))
        owner[i] = p + 1
        load[p] += weights[i]
    return owner


def fingerprint(plan: Any) -> str:
    """A short stable digest of a plan (any JSON-able value; key order does not matter)."""
    data = orjson.dumps(plan, option=orjson.OPT_SORT_KEYS, default=str)
    return hashlib.sha256(data).hexdigest()[:24]


def staging_dir(dest: Path) -> Path:
    """Where the parts of a job writing ``dest`` meet: a hidden sibling of ``dest``."""
    return dest.parent / f".{dest.name}{STAGING_MARKER}"


def receipt_name(index: int, count: int) -> str:
    """``part-00002-of-00004.json``."""
    return f"part-{index:05d}-of-{count:05d}.json"


class PartStore:
    """The staging directory the parts of one job share.

    It holds ``plan.json`` (the plan's fingerprint and part count, written by the first part
    to arrive), ``receipts/`` (one JSON receipt per finished part) and whatever the job stages
    there (the output shards, in ``out/``). Receipts are written atomically (temporary name,
    fsync, rename), so a receipt that is there is whole.

    Args:
        root: The staging directory.
        plan_id: The plan's fingerprint (:func:`fingerprint`).
        count: Parts in the plan.
        what: What the job is, for messages (``the output``...).
    """

    def __init__(self, root: Path, plan_id: str, count: int, *, what: str):
        self.root, self.plan_id, self.count, self.what = root, plan_id, count, what

    @property
    def receipts_dir(self) -> Path:
        """Where the receipts go."""
        return self.root / RECEIPTS

    def join(self) -> None:
        """Create the staging directory, or check that the one there is for this plan.

        Raises:
            PartsIncompleteError: Its parts were planned differently (other options, another
                source, another part count).
        """
        self.receipts_dir.mkdir(parents=True, exist_ok=True)
        with self.lock():
            recorded = self.recorded_plan()
            if recorded is None:
                _write_atomic(self.root / PLAN_FILE,
                              {"plan": self.plan_id, "parts": self.count})
            else:
                self._check_same(recorded)

    def recorded_plan(self) -> dict[str, Any] | None:
        """``plan.json``, or None when there is none yet."""
        try:
            raw = storage.read_side(self.root / PLAN_FILE, "plan")
            if raw is None:
                return None
            data = orjson.loads(raw)
        except (OSError, CkptError, orjson.JSONDecodeError) as e:
            raise PartsIncompleteError(f"unreadable part plan: {e}",
                                       path=self.root / PLAN_FILE) from None
        return data if isinstance(data, dict) else {}

    def _check_same(self, recorded: dict[str, Any]) -> None:
        if recorded.get("plan") != self.plan_id or recorded.get("parts") != self.count:
            raise PartsIncompleteError(
                f"parts of a different plan are staged here ({recorded.get('parts')} parts, "
                f"plan {recorded.get('plan')}; this run: {self.count} parts, plan "
                f"{self.plan_id}): other options, another source or another part count",
                path=self.root, hint="rerun with the same options, or remove the directory")

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Hold the staging directory's lock (``flock``; parts on one host or NFSv4).

        The directory is not created here: when a finalizer has removed it meanwhile, opening
        the lock raises FileNotFoundError, which tells the caller the job is finished.
        """
        fd = os.open(self.root / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def write_receipt(self, index: int, payload: dict[str, Any]) -> Path:
        """Record part ``index`` as done, with what it did.

        Args:
            index: The part (from 1).
            payload: JSON-able details (files written and their sizes, findings...).

        Returns:
            The receipt's path.
        """
        path = self.receipts_dir / receipt_name(index, self.count)
        _write_atomic(path, {"plan": self.plan_id, "part": index, "parts": self.count,
                             **payload})
        return path

    def receipts(self) -> dict[int, dict[str, Any]]:
        """The receipts of this plan there are, by part; others (a different plan) are left out."""
        found: dict[int, dict[str, Any]] = {}
        for k in range(1, self.count + 1):
            try:
                raw = storage.read_side(self.receipts_dir / receipt_name(k, self.count), "plan")
                data = orjson.loads(raw) if raw is not None else None
            except (OSError, CkptError, orjson.JSONDecodeError):
                continue
            if isinstance(data, dict) and data.get("plan") == self.plan_id \
                    and data.get("part") == k:
                found[k] = data
        return found

    def missing(self, have: Mapping[int, Any]) -> list[int]:
        """The parts without a receipt."""
        return [k for k in range(1, self.count + 1) if k not in have]

    def incomplete(self, missing: Sequence[int]) -> PartsIncompleteError:
        """The error for a finalize that found parts missing (names them)."""
        return PartsIncompleteError(
            f"cannot finalize {self.what}: {describe_parts(missing)} of "
            f"{self.count} not done (no receipt in {self.receipts_dir})", path=self.root,
            hint="run the missing parts with the same options, then finalize",
            param="finalize")


def describe_parts(parts: Sequence[int]) -> str:
    """``part 3`` / ``parts 2, 5 and 7`` / ``parts 2, 3, 4 and 60 more``."""
    shown = [str(p) for p in parts[:4]]
    if len(parts) > 4:
        return f"parts {', '.join(shown)} and {len(parts) - 4} more"
    if len(parts) == 1:
        return f"part {shown[0]}"
    return f"parts {', '.join(shown[:-1])} and {shown[-1]}"


def _write_atomic(path: Path, doc: dict[str, Any]) -> None:
    with atomic_file(path, overwrite=True) as tmp:
        tmp.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS)
                        + b"\n")


def source_identity(base: Path, rels: Sequence[str]) -> list[tuple[str, int, int]]:
    """``(name, size, mtime in ns)`` of a source's files: in the plan, so that parts of one
    job never mix a source that changed between them. Files that cannot be read count as
    missing (``-1``); the reader reports them."""
    return [_identity(base, rel) for rel in rels]


def _identity(base: Path, rel: str) -> tuple[str, int, int]:
    try:
        st = os.stat(base / rel)
    except OSError:
        return (rel, -1, -1)
    return (rel, st.st_size, st.st_mtime_ns)


def staged_count(root: Path, dest: Path) -> int:
    """How many parts the job staged under ``root`` for ``dest`` was split into (``finalize``
    without ``part``), from its recorded plan.

    Raises:
        PartsIncompleteError: Nothing staged there, or a plan that cannot be read.
    """
    recorded = PartStore(root, "", 0, what=str(dest)).recorded_plan()
    if recorded is None:
        raise PartsIncompleteError(
            f"nothing to finalize: no parts are staged for it (expected {root})", path=dest,
            hint="run the parts with part K/N first (with the same options)", param="part")
    count = recorded.get("parts")
    if not isinstance(count, int) or count < 1:
        raise PartsIncompleteError("the staged part plan is unreadable", path=root)
    return count
