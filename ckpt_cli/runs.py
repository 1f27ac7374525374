"""Run directories: many checkpoints of one training run, listed and ordered by step.

Recognised entries: ``checkpoint-N`` (HF Trainer), ``global_stepN`` (DeepSpeed), ``iter_NNNNNNN``
(Megatron), ``step_N``/``step-N``, ``epoch=E-step=S.ckpt`` (Lightning), numbered directories
(Orbax) and numbered ``.pt``/``.safetensors`` files, plus any directory that is a DCP checkpoint.
Pointers (``latest``, ``latest_checkpointed_iteration.txt``, ``last.ckpt``) are resolved;
temporary and trash names are reported as leftovers, never as checkpoints.

``ckpt prune`` lists with ``strict=True``: loose files count as checkpoints only when their name
says so (``model_1000.pt``, ``step=500.ckpt``), never merely because it ends in a number
(``data_0001.bin`` may be a dataset shard).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import NamedTuple

from ckpt_cli import storage
from ckpt_cli.dtypes import strict_int
from ckpt_cli.errors import CkptError, CorruptCheckpointError, UsageError
from ckpt_cli.formats import dcp, deepspeed, detect, hf_index, megatron, read_index
from ckpt_cli.formats.directory import checkpoint_files
from ckpt_cli.formats.names import (
    FILE_EXTENSIONS,
    is_last_copy,
    is_leftover,
    step_from_name,
)

# Re-exported: the pointer files' parser, as it was reachable here before formats/pointers.py.
from ckpt_cli.formats.pointers import POINTER_FILES as POINTER_FILES
from ckpt_cli.formats.pointers import PointerError as PointerError
from ckpt_cli.formats.pointers import read_pointer as read_pointer
from ckpt_cli.formats.pointers import read_pointers as read_pointers
from ckpt_cli.formats.probe import (
    LINK_OUT,
    Probe,
    named_unfinished,
    open_file_status,
    quick_status,
)
from ckpt_cli.model import (
    DANGLING_POINTER,
    MTIME_ORDER,
    Finding,
    RunEntry,
    RunListing,
)
from ckpt_cli.runfiles import LOCK_SUFFIX as LOCK_SUFFIX
from ckpt_cli.runfiles import PRUNE_LOCK as PRUNE_LOCK
from ckpt_cli.runfiles import STALE_TEMP_AGE as STALE_TEMP_AGE
from ckpt_cli.runfiles import TreeScan as TreeScan
from ckpt_cli.runfiles import stale_temporaries as stale_temporaries
from ckpt_cli.runfiles import tree_scan as tree_scan
from ckpt_cli.runfiles import tree_stats as tree_stats
from ckpt_cli.runfiles import writer_lock as writer_lock
from ckpt_cli.storage import special_kind

_METRIC = re.compile(r"(?P<key>[A-Za-z_][A-Za-z0-9_/]*)=(?P<val>[-+]?(?:\d+\.?\d*|\.\d+)"
                     r"(?:[eE][-+]?\d+)?)")
# Numbered files that are parts of one checkpoint, not checkpoints of their own.
_PART_NAME = re.compile(r"rank|rng|random_states|optim|scheduler|shard|-of-|sampler|scaler",
                        re.IGNORECASE)


def metrics_from_name(name: str) -> dict[str, float]:
    """``key=value`` metrics in a name (Lightning: ``epoch=2-step=300-val_loss=0.12.ckpt``)."""
    out: dict[str, float] = {}
    if "=" not in name:
        return out
    stem = name.removesuffix(".ckpt").removesuffix(".pt")
    for m in _METRIC.finditer(stem):
        key = m.group("key").lstrip("-_")
        if key not in ("epoch", "step"):
            try:
                out[key] = float(m.group("val").rstrip("."))
            except ValueError:
                continue
    return out


# What a job's or an experiment's output directory holds and a checkpoint does not.
_JOB_MARKERS = (".hydra", ".submitit", "wandb", "lightning_logs", "tensorboard", "runs")
_JOB_FILE_SUFFIXES = (".log", ".out", ".err", ".yaml", ".yml")


def _job_output(path: Path) -> bool:
    """Whether a directory looks like a job's output (config, logs), not a checkpoint.

    Only bare numbers name both (Orbax step directories; Hydra multirun and other sweep job
    directories), and deleting a job directory would take its logs and configs along.
    """
    try:
        with storage.scandir(path) as it:
            return any(e.name in _JOB_MARKERS or e.name.endswith(_JOB_FILE_SUFFIXES)
                       for e in it)
    except OSError:
        return False


def _is_checkpoint_name(entry: os.DirEntry[str], strict: bool = False) -> bool:
    return _checkpoint_step(entry, strict)[0]


def _checkpoint_step(entry: os.DirEntry[str], strict: bool = False) -> tuple[bool, int | None]:
    """Whether a child is named or laid out like a checkpoint, and the step its name gives
    (one pass over the name patterns: a listing does this for every entry)."""
    name = entry.name
    if name.startswith(".") or name in POINTER_FILES:
        return False, None
    if entry.is_dir(follow_symlinks=False):
        if strict and name.isdigit() and _job_output(storage.locate(entry.path)):
            # A sweep's job directory (Hydra multirun 0/, 1/...), not a checkpoint.
            return False, None
        step = step_from_name(name, strict=strict)
        return step is not None or (storage.locate(entry.path) / dcp.METADATA).is_file(), step
    if entry.is_file(follow_symlinks=False):
        if not name.endswith(FILE_EXTENSIONS) or _PART_NAME.search(name):
            return False, None
        step = step_from_name(name, strict=strict)
        return step is not None or is_last_copy(name), step
    return False, None


def is_run_dir(path: Path) -> bool:
    """Whether ``path`` holds checkpoints (rather than being one).

    A directory that is itself a DCP, DeepSpeed-tag or Megatron-iteration checkpoint is not a run
    directory; one with any child named or laid out like a checkpoint is.
    """
    if not path.is_dir():
        return False
    if (dcp.metadata_file(path) is not None or (path / "trainer_state.json").is_file()
            or hf_index.find_index(path) is not None
            or deepspeed.DeepSpeedReader().sniff(path) is None
            or megatron.MegatronReader().sniff(path) is None):
        return False
    try:
        with storage.scandir(path) as it:
            return any(_is_checkpoint_name(e) for e in it)
    except OSError:
        return False


RESUME_POINTERS = ("latest", "latest_checkpointed_iteration.txt")


class Followed(NamedTuple):
    """A run directory's pointer followed to the one checkpoint it names.

    Attributes:
        pointer: The pointer file (``latest``, ``latest_checkpointed_iteration.txt``).
        checkpoint: The entry it names.
        path: That entry's path.
    """

    pointer: str
    checkpoint: str
    path: Path

    def to_dict(self) -> dict[str, str]:
        """JSON-ready form."""
        return {"pointer": self.pointer, "checkpoint": self.checkpoint, "path": str(self.path)}


def follow_pointer(path: Path) -> Followed | None:
    """The checkpoint a run directory's resume pointer names, for commands that need one.

    ``convert``, ``diff`` and ``consolidate`` of a DeepSpeed save directory (``latest``) or a
    Megatron one (``latest_checkpointed_iteration.txt``) read what training would resume from,
    as DeepSpeed's own ``zero_to_fp32`` does. Anything that is not a run directory is left as
    it is (None), so single checkpoints, HF Trainer checkpoint directories and a DeepSpeed
    save directory of one non-numbered tag keep their own handling.

    Args:
        path: The path a command was given.

    Returns:
        The :class:`Followed` pointer, or None when ``path`` is not a run directory or has no
        resume pointer.

    Raises:
        CorruptCheckpointError: If a pointer cannot be read, or names an entry that is not
            there (resuming from it would fail too).
    """
    if not is_run_dir(path):
        return None
    for name in RESUME_POINTERS:
        try:
            target = read_pointer(path, name)
        except PointerError as e:
            raise CorruptCheckpointError(f"cannot tell which checkpoint {name} names: {e}",
                                         path=path / name) from None
        if target is None:
            continue
        chosen = path / target
        if "/" in target or target in (".", "..") or not storage.lexists(chosen):
            raise CorruptCheckpointError(f"{name} names {target!r}, which is not in the "
                                         "directory", path=path / name,
                                         hint=f"ckpt inspect {path} lists its checkpoints")
        return Followed(name, target, chosen)
    return None


def _compile(pattern: str | None) -> re.Pattern[str] | None:
    if not pattern:
        return None
    try:
        return re.compile(pattern)
    except re.error as e:
        raise UsageError(f"pattern is not a valid regular expression: {e}",
                         param="pattern") from None


def _recognise(entry: os.DirEntry[str], rx: re.Pattern[str] | None,
               strict: bool) -> tuple[bool, int | None]:
    """Whether a (non-symlink, non-leftover) child is a checkpoint, and the step its name gives.

    With a pattern, hidden names and pointer files never match, whatever the pattern says.
    """
    if rx is None:
        return _checkpoint_step(entry, strict)
    if entry.name.startswith(".") or entry.name in POINTER_FILES:
        return False, None
    m = rx.search(entry.name)
    if not m:
        return False, None
    group = m.groupdict().get("step") or (m.group(1) if m.groups() else None)
    return True, strict_int(str(group)) if group else None


def run_dir_problem(path: Path, pattern: str | None = None) -> str | None:
    """Why ``path`` is not a run directory of checkpoints (None when it is one).

    Stricter than :func:`is_run_dir`: an HF Trainer output directory that also holds the final
    model is a run directory here. A directory that is itself one checkpoint (DCP, DeepSpeed
    tag, Megatron iteration, HF ``checkpoint-N``), or holds nothing recognised as a
    checkpoint, is not.

    Args:
        path: A directory.
        pattern: The ``--pattern`` regex, if any, instead of name recognition.

    Returns:
        A phrase saying what is wrong, or None.

    Raises:
        UsageError: If ``pattern`` is not a regex.
    """
    rx = _compile(pattern)
    if (dcp.metadata_file(path) is not None or deepspeed.DeepSpeedReader().sniff(path) is None
            or megatron.MegatronReader().sniff(path) is None
            or ((path / "trainer_state.json").is_file()
                and step_from_name(path.name, strict=True) is not None)):
        return itself_a_checkpoint(path)
    try:
        with storage.scandir(path) as it:
            for e in it:
                if not is_leftover(e.name) and not e.is_symlink() and _recognise(
                        e, rx, strict=True)[0]:
                    return None
    except OSError as e:
        return f"cannot be listed: {e.strerror}"
    if one_checkpoint(path):
        return itself_a_checkpoint(path)
    return NO_CHECKPOINTS


NO_CHECKPOINTS = "holds no checkpoints ckpt recognises (not a run directory)"
"""What :func:`run_dir_problem` says of a directory without checkpoints (yet)."""
ITSELF = "is itself a checkpoint, not a run directory of checkpoints"
"""How :func:`run_dir_problem` begins when the directory is one checkpoint."""


def itself_a_checkpoint(path: Path) -> str:
    """The refusal of a checkpoint given where a run directory was meant, naming the run."""
    return f"{ITSELF}; its run directory is {path.parent}"


def one_checkpoint(path: Path) -> bool:
    """Whether a directory that holds no checkpoints is itself one (any format a reader
    recognises: a step directory holding one torch file, an HF final model, DCP...). A
    directory holding only logs, configs, numbered files such as dataset shards, or nothing
    is not.

    Args:
        path: A directory.

    Returns:
        Whether it is one checkpoint.
    """
    if not path.is_dir():
        return False
    try:
        reader = detect(path)
    except (CkptError, OSError):
        return False
    # Loose numbered files alone (data_0001.bin, tokens_2.pt) may be a dataset's shards in a
    # run directory before its first save, as list_run(strict=True) treats them; a directory
    # named like a checkpoint, or holding any other checkpoint file or an HF state file, is one.
    return not (reader.name == "dir" and step_from_name(path.name, strict=True) is None
                and _only_numbered_files(path))


def _only_numbered_files(path: Path) -> bool:
    """Whether every checkpoint-like file at the top of ``path`` has a number in its name and
    is no part of a checkpoint (no ``rank``, ``-of-``, ``optim``...), with no JSON state."""
    if any((path / n).exists() for n in ("trainer_state.json", "config.json")):
        return False
    files = checkpoint_files(path)
    return bool(files) and all(re.search(r"\d", f.name) and not _PART_NAME.search(f.name)
                               for f in files)


def holds_final_model(path: Path) -> bool:
    """Whether ``path`` is one checkpoint with checkpoints below it: an HF Trainer output dir.

    ``trainer.save_model()`` writes the final model (``model.safetensors``, ``config.json``,
    ``trainer_state.json``) into ``output_dir`` beside the ``checkpoint-N/`` saved on the way.
    Such a directory is no run directory for :func:`is_run_dir` (it is a checkpoint itself),
    but commands that describe or check it cover both: the final model and the run.

    Args:
        path: A directory.

    Returns:
        True when ``path`` is a checkpoint directory of loose files (not itself named like a
        checkpoint) holding run-directory entries.
    """
    if not path.is_dir() or step_from_name(path.name, strict=True) is not None:
        return False
    if not is_run_dir(path):
        return run_dir_problem(path) is None
    # Listed like a run directory by its children (no trainer_state.json beside them, say):
    # still an output dir when files by the final model's names lie there, whatever state
    # they are in, so that a damaged final model is checked rather than passed over.
    try:
        with storage.scandir(path) as it:
            return any(_FINAL_MODEL.fullmatch(e.name) and e.is_file() for e in it)
    except OSError:
        return False


def is_final_model_only(path: Path) -> bool:
    """Whether ``path`` is an HF Trainer ``output_dir`` holding only its final model.

    That is what ``trainer.save_model()`` (and ``save_state()``) leave when no ``checkpoint-N``
    was kept (``save_strategy="no"``, or the checkpoints removed): the final model's weights by
    their usual names, with ``training_args.bin`` or ``trainer_state.json`` beside them, in a
    directory not itself named like a checkpoint. ``validate --latest`` checks it as the run's
    only (and so latest) checkpoint.
    """
    if not path.is_dir() or step_from_name(path.name, strict=True) is not None:
        return False
    try:
        with storage.scandir(path) as it:
            names = {e.name for e in it if e.is_file()}
    except OSError:
        return False
    return (any(_FINAL_MODEL.fullmatch(n) for n in names)
            and bool(names & {"training_args.bin", "trainer_state.json"}))


# The names transformers' save_model() gives a final model's weights (and their index).
_FINAL_MODEL = re.compile(r"(?:model|pytorch_model|adapter_model|diffusion_pytorch_model)"
                          r"(?:-\d+-of-\d+)?\.(?:safetensors|bin)(?:\.index\.json)?")


def list_run(root: Path, pattern: str | None = None, *, step_from_metadata: bool = True,
             strict: bool = False) -> RunListing:
    """List the checkpoints of a run directory, oldest first.

    Args:
        root: The run directory.
        pattern: A regex overriding name recognition; a ``step`` group (or the first group)
            gives the step. Hidden names and pointer files never match.
        step_from_metadata: Read checkpoint metadata for entries whose name has no step.
        strict: Recognise loose files only by checkpoint-like names (see the module notes).

    Returns:
        The :class:`RunListing`.

    Raises:
        CkptError: If ``root`` is not a readable directory, or ``pattern`` is not a regex.
    """
    if not root.is_dir():
        raise CkptError("not a directory", path=root)
    rx = _compile(pattern)
    listing = RunListing(root=root)
    listing.pointers, listing.findings = read_pointers(root)
    try:
        with storage.scandir(root) as it:
            children = sorted(it, key=lambda e: e.name)
    except OSError as err:
        raise CkptError(f"cannot list: {err.strerror}", path=root) from None
    found: list[tuple[str, int | None, bool]] = []
    for entry in children:
        if is_leftover(entry.name):
            listing.leftovers.append(entry.name)
            continue
        if "\n" in entry.name or "\r" in entry.name:
            # A line break in a name forges lines in logs and scripts; no writer makes one.
            listing.findings.append(Finding(
                "warning", ODD_NAME_SKIPPED, "a line break in its name: not treated as a "
                "checkpoint", entry.name))
            continue
        if entry.is_symlink():
            # Pointers such as last.ckpt -> epoch=...ckpt, or links elsewhere: never an entry
            # of their own, never followed.
            if entry.name not in listing.pointers:
                listing.findings.append(Finding(
                    "info", "symlink-skipped", f"{entry.name} is a symbolic link; not followed",
                    entry.name))
            continue
        matched, step = _recognise(entry, rx, strict)
        if matched:
            found.append((entry.path, step, entry.is_file(follow_symlinks=False)))
        elif (strict and rx is None and entry.name.isdigit()
              and entry.is_dir(follow_symlinks=False)):
            listing.findings.append(Finding(
                "warning", "job-dir-skipped", f"{entry.name}/ holds logs or configs, like a "
                "sweep's job directory: not treated as a checkpoint (--pattern selects it)",
                entry.name))
    listing.entries = _entries(found)
    _fill_steps(listing, step_from_metadata)
    latest = listing.pointers.get("latest") or listing.pointers.get(
        "latest_checkpointed_iteration.txt") or next(
        (v for k, v in listing.pointers.items() if k.startswith("last")), None)
    names = {en.name for en in listing.entries}
    for k, v in listing.pointers.items():
        if v not in names:
            listing.findings.append(Finding("warning", DANGLING_POINTER,
                                            f"{k} names {v!r}, which is not in the directory",
                                            k))
    if latest in names:
        listing.latest = latest
    for en in listing.entries:
        if en.name in listing.pointers.values() or is_last_copy(en.name):
            en.latest = True
    return listing


ODD_NAME_SKIPPED = "odd-name-skipped"
"""Finding code: a run entry whose name holds ``\n`` or ``\r``, listed and skipped."""


# The first entries are read in turn; when each took this long, the storage is slow (a network
# file system, a cold disk) and threads overlap the waits for the rest. On a warm local disk
# an entry takes ~50 us of Python, and threads contending for the GIL only add to that.
_PROBE = 64
_SLOW_ENTRY = 0.5e-3


def _entries(found: list[tuple[str, int | None, bool]]) -> list[RunEntry]:
    """The run entries of ``(path, step, is_file)``, in the order given."""
    out: list[RunEntry] = []
    t0 = time.perf_counter()
    for i, (p, step, is_file) in enumerate(found):
        out.append(_entry(p, step, is_file))
        if (i + 1 == _PROBE and len(found) > 2 * _PROBE
                and time.perf_counter() - t0 > _PROBE * _SLOW_ENTRY):
            from concurrent.futures import ThreadPoolExecutor  # lazy: only slow listings use a pool

            with ThreadPoolExecutor(max_workers=16) as pool:
                out.extend(pool.map(lambda f: _entry(*f), found[i + 1:], chunksize=64))
            break
    return out


def _entry(where: str, step: int | None, is_file: bool = False,
           run: Path | None = None) -> RunEntry:
    path = storage.locate(where)
    scan: TreeScan | None = None
    status: Probe | None = None
    if is_file and storage.has_file_system(path):
        # One open serves the sizes and times (fstat) and the status (header reads): at
        # thousands of checkpoints, each extra stat or open is a measurable share.
        try:
            # Non-blocking: the listing saw a regular file, but a FIFO swapped in since must
            # not hang the open; the descriptor is checked again below.
            fd = os.open(where, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            pass
        else:
            try:
                st = os.fstat(fd)
                kind = special_kind(st.st_mode)
                if kind is not None:
                    raise CorruptCheckpointError(f"not a regular file ({kind})", path=path)
                scan = TreeScan(st.st_size, 1, st.st_mtime, max(st.st_mtime, st.st_ctime))
                status = open_file_status(path, fd, st.st_size)
            except (OSError, CkptError) as e:
                status = Probe(None, False, f"unreadable: {e}")
            finally:
                os.close(fd)
            if status is not None:
                status = named_unfinished(path, status)  # as quick_status does
    if scan is None:
        # Its own files' times: a manifest ckpt wrote into it later does not make it recent.
        scan = tree_scan(path, own_times=True)
    fmt, complete, reason = (status if status is not None
                             else quick_status(path, run=run if run is not None else path.parent))
    return RunEntry(name=path.name, path=path, step=step, step_source="name" if step is not None
                    else "unknown", format=fmt, bytes=scan.bytes, files=scan.files,
                    mtime=scan.mtime, complete=complete, reason=reason,
                    metrics=metrics_from_name(path.name), changed=scan.changed)


def run_entry(path: Path, run: Path | None = None) -> RunEntry:
    """The run-listing entry of one checkpoint file or directory (its step from its name).

    Args:
        path: The checkpoint.
        run: The run directory whose files it may link to (default: its parent).

    Returns:
        The :class:`RunEntry`.
    """
    step = step_from_name(path.name)
    return _entry(str(path), step, path.is_file() and not path.is_symlink(), run)


def _fill_steps(listing: RunListing, from_metadata: bool) -> None:
    unknown = [e for e in listing.entries if e.step is None]
    if from_metadata:
        for e in unknown:
            if LINK_OUT in (e.reason or ""):
                continue  # nothing of it is read
            step = _step_from_metadata(e.path)
            if step is not None:
                e.step, e.step_source = step, "metadata"
    stepped = [e for e in listing.entries if e.step is not None]
    # last.ckpt-style copies duplicate a ranked checkpoint: their missing step orders nothing.
    unstepped = [e for e in listing.entries if e.step is None]
    for e in unstepped:
        e.step_source = "mtime"
    if not stepped:
        if unstepped and not all(is_last_copy(e.name) for e in unstepped):
            listing.findings.append(Finding(
                "warning", MTIME_ORDER, "no checkpoint has a step in its name or metadata; they "
                "are ordered by modification time"))
        listing.entries.sort(key=lambda e: e.mtime)
        return
    if any(not is_last_copy(e.name) for e in unstepped):
        names = ", ".join(e.name for e in unstepped if not is_last_copy(e.name))
        listing.findings.append(Finding(
            "warning", MTIME_ORDER, f"no step in the name or metadata of {names}: listed after "
            "the others by modification time, and not ordered against them"))
    # Steps decide the order; modification times (copies, restores, rsync) never override them.
    listing.entries = (sorted(stepped, key=lambda e: (e.step or 0, e.mtime))
                       + sorted(unstepped, key=lambda e: e.mtime))


def _step_from_metadata(path: Path) -> int | None:
    try:
        index = read_index(path)
    except CkptError:
        return None
    step = index.metadata.get("step")
    return step if isinstance(step, int) else None
