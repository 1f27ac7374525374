"""Checks of a checkpoint's layout and training state, for ``validate``.

Rank-file sets against the world sizes the files record (DeepSpeed, Megatron), ``latest``
pointers, resumability (a step without optimizer state), weight files an HF index does not
name, and temporary or trash entries left by interrupted writes. Each function returns
findings (and a one-line summary); :mod:`ckpt_cli.ops.validate` files them under its checks.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import cast

from ckpt_cli import storage
from ckpt_cli.errors import CkptError
from ckpt_cli.formats import deepspeed, hf_index, megatron
from ckpt_cli.formats.base import rel_to
from ckpt_cli.formats.containers import holds_optimizer_state
from ckpt_cli.formats.names import is_leftover
from ckpt_cli.formats.provenance import written_by_ckpt
from ckpt_cli.model import CheckpointIndex, Finding
from ckpt_cli.runs import POINTER_FILES, PointerError, read_pointer
from ckpt_cli.trust.ledger import thinned_on_purpose


def rank_findings(index: CheckpointIndex, path: Path) -> tuple[list[Finding], str] | None:
    """Rank files against world sizes (DeepSpeed and Megatron layouts; None for others).

    Args:
        index: The checkpoint's index.
        path: The checkpoint directory.

    Returns:
        ``(findings, summary)``, or None when the format has no rank files.
    """
    if index.format == "deepspeed":
        return _deepspeed_ranks(index, path), _layout_summary(index)
    if index.format == "megatron":
        return _megatron_ranks(index, path), _layout_summary(index)
    return None


def _layout_summary(index: CheckpointIndex) -> str:
    keys = ("zero_stage", "world_size", "mp_world_size", "tp", "pp", "ep")
    parts = [f"{k} {index.layout[k]}" for k in keys if index.layout.get(k) is not None]
    return ", ".join(parts) or "rank files present"


def ds_world(index: CheckpointIndex) -> tuple[int, int] | None:
    """``(dp_world_size, mp_world_size)`` recorded in a DeepSpeed model-states file, if sane.

    When known, the rank checks name every missing file, so the reader's coarser
    ``missing-rank`` finding is redundant.
    """
    dp, mp = index.objects.get("dp_world_size"), index.objects.get("mp_world_size")
    if (isinstance(dp, int) and isinstance(mp, int) and not isinstance(dp, bool)
            and not isinstance(mp, bool) and 0 < dp <= 1 << 20 and 0 < mp <= 1 << 20):
        return dp, mp
    return None


def _deepspeed_ranks(index: CheckpointIndex, path: Path) -> list[Finding]:
    """Exact rank-file sets of a DeepSpeed tag directory, from the world sizes in its files."""
    model, optim, _expert = deepspeed.rank_files(deepspeed.tag_dir(path) or path)
    out: list[Finding] = []
    world = ds_world(index)
    if world is None:
        return out
    dp, mp = world
    names = {p.name for p in model + optim}
    zero3 = any(n.startswith("zero_pp_rank_") for n in (p.name for p in model))
    expected = ([f"zero_pp_rank_{d}_mp_rank_{m:02d}_model_states.pt"
                 for m in range(mp) for d in range(dp)] if zero3 else
                [f"mp_rank_{m:02d}_model_states.pt" for m in range(mp)])
    prefixes = {"bf16_" if p.name.startswith("bf16_") else "" for p in optim}
    if len(prefixes) > 1:
        out.append(Finding("error", "mixed-optimizer-files",
                           "both bf16_ and plain optimizer rank files: two different saves "
                           "were mixed in one directory"))
    if optim:
        pre = sorted(prefixes)[0]
        expected += [f"{pre}zero_pp_rank_{d}_mp_rank_{m:02d}_optim_states.pt"
                     for m in range(mp) for d in range(dp)]
    missing = [n for n in expected if n not in names]
    out.extend(Finding("error", "missing-rank-file",
                       f"expected for dp_world_size {dp}, mp_world_size {mp} but missing", n)
               for n in missing)
    counts = {v if isinstance(v, int) else max(v) for k, v in index.objects.items()
              if k.endswith("optimizer_state_dict.partition_count")
              and (isinstance(v, int) or (isinstance(v, list) and v
                                          and all(isinstance(x, int) for x in v)))}
    out.extend(Finding("error", "world-size",
                       f"optimizer state was partitioned {c} ways but dp_world_size is {dp}")
               for c in sorted(counts - {dp}))
    return out


def _megatron_ranks(index: CheckpointIndex, path: Path) -> list[Finding]:
    """Megatron: every rank directory has the same files and the directory's iteration."""
    out: list[Finding] = []
    ranks = megatron.rank_dirs(path)
    with_optim = [d.name for d, *_ in ranks if (d / "distrib_optim.pt").is_file()]
    if with_optim and len(with_optim) != len(ranks):
        lacking = [d.name for d, *_ in ranks if d.name not in with_optim]
        out.extend(Finding("error", "missing-rank-file",
                           "no distrib_optim.pt, which the other rank directories have",
                           f"{name}/distrib_optim.pt") for name in lacking)
    m = re.fullmatch(r"iter_(\d+)", path.name)
    if m:
        want = int(m.group(1))
        for key, v in index.objects.items():
            parts = key.split(".")
            if parts[-1] == "iteration" and len(parts) <= 2 and isinstance(v, int) and v != want:
                where = parts[0] if len(parts) == 2 else (ranks[0][0].name if ranks else None)
                out.append(Finding("error", "wrong-iteration",
                                   f"holds iteration {v} but sits in {path.name}", where))
    return out


def pointer_findings(index: CheckpointIndex,
                     path: Path) -> tuple[list[Finding], str] | None:
    """``latest`` pointers inside the checkpoint, and (DeepSpeed/Megatron) beside it.

    Args:
        index: The checkpoint's index.
        path: The checkpoint.

    Returns:
        ``(findings, summary)``, or None when there are no pointer files.
    """
    dirs = [(path, "")] if path.is_dir() else []
    if index.format in ("deepspeed", "megatron") or index.flavor == "megatron-dist":
        dirs.append((path.parent, "../"))
    findings: list[Finding] = []
    found: list[str] = []
    for d, prefix in dirs:
        more, named = directory_pointers(d, prefix)
        findings += more
        found += named
    if found or findings:
        return findings, ", ".join(found) or "pointer files present"
    return None


def directory_pointers(directory: Path, prefix: str = "") -> tuple[list[Finding], list[str]]:
    """Check the pointer files of one directory (``latest`` and the like) strictly.

    Args:
        directory: Where the pointer files are.
        prefix: Prepended to their names in findings (``../`` for a checkpoint's parent).

    Returns:
        ``(findings, ["latest -> global_step3", ...])``: an unreadable or malformed pointer is
        a ``bad-pointer`` error, one naming nothing that exists a ``dangling-pointer`` error.
    """
    findings: list[Finding] = []
    found: list[str] = []
    for name in POINTER_FILES:
        rel = prefix + name
        try:
            target = read_pointer(directory, name)
        except PointerError as e:
            findings.append(Finding("error", "bad-pointer", str(e), rel))
            continue
        if target is None:
            continue
        # read_pointer gives an entry of ``directory``, or the raw text when the pointer
        # leads out of it: that names nothing here either.
        if "/" in target or not (directory / target).exists():
            findings.append(Finding(
                "error", "dangling-pointer",
                f"names {target!r}, which does not exist: resuming from it will fail", rel))
        else:
            found.append(f"{rel} -> {target}")
    return findings, found


def _thinned(path: Path) -> bool:
    return thinned_on_purpose(path)


def resumable_findings(index: CheckpointIndex, require: tuple[str, ...],
                       path: Path | None = None) -> tuple[list[Finding], str]:
    """Whether the checkpoint holds what resuming training needs.

    A checkpoint that records a step but no optimizer state is flagged (a warning), unless it
    was thinned on purpose (a note); ``require`` (``optimizer``, ``step``) turns absences
    into errors.

    Args:
        index: The checkpoint's index.
        require: What must be present.
        path: The checkpoint, to ask its run ledger whether ``prune --thin-after`` thinned
            it (:func:`ckpt_cli.trust.ledger.thinned_on_purpose`).

    Returns:
        ``(findings, summary)``.
    """
    step = index.metadata.get("step")
    has_step = isinstance(step, int) and not isinstance(step, bool)
    has_opt = holds_optimizer_state(index)
    findings: list[Finding] = []
    if "step" in require and not has_step:
        findings.append(Finding("error", "missing-step",
                                "no training step recorded (--require step)"))
    if "optimizer" in require and not has_opt:
        why = ""
        if path is not None and _thinned(path):
            why = (": thinned by ckpt prune --thin-after (the run ledger says so), its "
                   "optimizer state dropped, only its hyperparameters (param_groups) kept")
        elif any(".param_groups." in f".{k}." for k in index.objects):
            why = (": its optimizer's state is empty, only its hyperparameters (param_groups) "
                   "are saved (a fresh or thinned optimizer)")
        findings.append(Finding("error", "missing-optimizer",
                                f"no optimizer state (--require optimizer){why}"))
    elif has_step and not has_opt and written_by_ckpt(index.metadata):
        # convert/consolidate leave optimizer state out unless asked: weights only by design.
        findings.append(Finding(
            "info", "no-optimizer",
            f"step {step} was carried over by ckpt from the checkpoint it converted; the "
            "optimizer state was left out (--keep-optimizer / --with-optimizer keep it)"))
    elif has_step and not has_opt and path is not None and _thinned(path):
        findings.append(Finding(
            "info", "no-optimizer",
            f"step {step}: thinned by ckpt prune --thin-after (the run ledger says so), its "
            "optimizer state dropped on purpose (its param_groups kept); resuming from it "
            "restarts the optimizer's moments"))
    elif has_step and not has_opt:
        findings.append(Finding(
            "warning", "no-optimizer",
            f"records step {step} but holds no optimizer state: resuming from it restarts "
            "the optimizer (momentum and Adam moments lost); --require optimizer makes this "
            "an error"))
    if has_step:
        summary = f"step {step}, " + ("with optimizer state" if has_opt else
                                      "no optimizer state")
    else:
        summary = "no training step recorded (weights only)" + (
            ", with optimizer state" if has_opt else "")
    return findings, summary


def stray_shards(index: CheckpointIndex) -> list[Finding]:
    """Weight files beside an HF index that it does not name (a stale export mixed in).

    Args:
        index: The checkpoint's index.

    Returns:
        One warning per unnamed file.
    """
    out: list[Finding] = []
    for f in index.files:
        if f.role != "index" or not f.path.endswith(hf_index.INDEX_SUFFIXES):
            continue
        idx = index.path_of(f.path)
        try:
            named = set(hf_index.load_index_json(idx)[0].values())
        except CkptError:
            continue  # reported by the reader
        ext = ".safetensors" if f.path.endswith(".safetensors.index.json") else ".bin"
        strays = sorted(p.name for p in idx.parent.iterdir()
                        if p.name.endswith(ext) and p.name not in named and p.is_file())
        out.extend(Finding("warning", "unindexed-file",
                           f"not named by {idx.name} (left from another export?); loaders that "
                           "glob for weights will pick it up", rel_to(idx.parent / n,
                                                                       index.base))
                   for n in strays)
    return out


def leftover_message(name: str) -> str:
    """What a leftover entry is, and whether it may be deleted."""
    kind = "trash from an interrupted prune" if ".ckpt-trash-" in name else (
        "temporary output of an interrupted write")
    return f"{kind}; safe to delete once no job is writing here"


def leftover_findings(path: Path, *, ignore: str | None = None) -> list[Finding]:
    """Temporary or trash entries inside the checkpoint, or named after it beside it.

    Args:
        path: The checkpoint.
        ignore: A sibling that is no leftover (the staging directory of the parts of the
            validation running, with ``--part``).

    Returns:
        One warning per leftover.
    """
    found: list[Finding] = []
    if path.is_dir():
        for dirpath, dirnames, filenames in storage.walk(path):
            for name in sorted(dirnames + filenames):
                if is_leftover(name):
                    rel = rel_to(dirpath / name, path)
                    found.append(Finding("warning", "leftover", leftover_message(name), rel))
            dirnames[:] = [d for d in dirnames if not is_leftover(d)]
    try:
        siblings = [p.name for p in path.parent.iterdir()
                    if p.name.startswith(f".{path.name}.ckpt-") and p.name != ignore]
    except OSError:
        siblings = []
    found.extend(Finding("warning", "leftover", leftover_message(name), f"../{name}")
                 for name in sorted(siblings))
    if storage.has_multipart_uploads(path):
        found.extend(_unfinished_uploads(cast(storage.ObjectPath, path)))
    return found


def _unfinished_uploads(path: storage.ObjectPath) -> list[Finding]:
    """Multipart uploads of this checkpoint's keys never completed: a write was killed (or
    is still running). Invisible to listings, but their parts are billed."""
    key = path.key
    out = []
    try:
        pending = path.store.pending_uploads(key)
    except CkptError:  # a read-only role may not list uploads: nothing to say then
        return []
    for k, _uid, last in pending:
        if k != key and not k.startswith(key + "/"):
            continue  # another key that merely starts with the same letters
        rel = k[len(key) + 1:] if k != key else path.name
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(last))
        out.append(Finding("warning", "unfinished-upload",
                           f"an unfinished multipart upload (last part {when}): a write was "
                           "interrupted, or is still running; its parts are billed until it "
                           "is aborted (ckpt prune does, after --grace)", rel))
    return out
