"""``prune``'s thinning step (``--thin-after``): after the deletions, each checkpoint the plan
thins is re-checked by the run's site and rewritten without its optimizer state by
:mod:`ckpt_cli.trust.thinning`, with an intent line in the run ledger before the first change and a
``thinned`` line after it.

Then, whatever the plan chose, every checkpoint that stays and whose newest ``thinned`` line is
still an intent (a prune killed while thinning it) is settled (:func:`settle`): thinned, it gets
its manifest and the confirming line; still whole, a line that says the thinning was not
carried out. So a thinning converges even when the next prune does not thin that checkpoint
again (its inode-change time, new since the swap, keeps it within ``--grace``; no
``--thin-after``; a failed re-check)."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ckpt_cli import storage
from ckpt_cli.errors import CkptError
from ckpt_cli.formats import read_index
from ckpt_cli.formats.containers import holds_optimizer_state
from ckpt_cli.manifest import manifest_path, verify_manifest, write_manifest
from ckpt_cli.model import RunEntry
from ckpt_cli.ops.prune.result import PruneEvent, PruneResult
from ckpt_cli.ops.prune.retention import PrunePlan
from ckpt_cli.runs import tree_scan
from ckpt_cli.trust.ledger import (
    THINNED,
    VERIFIED,
    Ledger,
    LedgerEntry,
    append,
    manifest_digest,
    read_ledger,
)
from ckpt_cli.trust.thinning import PENDING, UNDONE, Thinned, can_thin, pending, thin_file, tidy

if TYPE_CHECKING:
    from ckpt_cli.trust.thinning import Thinned


def thin(root: Path, plan: PrunePlan, result: PruneResult,
         recheck_one: Callable[[RunEntry], str | None],
         report: Callable[[PruneEvent], None]) -> None:
    """Rewrite the checkpoints the plan thins (``--thin-after``), each re-checked first
    (``recheck_one``: the site's re-check), and append a ``thinned`` line to the run ledger for
    each."""

    book = read_ledger(root) if any(d.thin for d in plan.decisions) else None
    # Checkpoints that had a manifest (a killed thinning may have set it aside already).
    manifested = {e.path for e in book.entries if e.manifest_digest} if book else set()
    for d in plan.decisions:
        if not d.thin:
            continue
        name = d.entry.name
        why = can_thin(d.entry.path) or recheck_one(d.entry)
        if not why and d.entry.step is None and not storage.has_file_system(d.entry.path):
            # Its place in the run comes from its objects' LastModified, which the rewrite
            # would reset (S3 cannot set it): it would then pass for the newest checkpoint.
            why = ("no step in its name or metadata: ordered by modification time, which "
                   "rewriting it on object storage would reset; left whole")
        if why:
            result.thin_skipped[name] = why
            report(PruneEvent("thin-skipped", name, why, plan=plan))
            continue

        def intent(dropped: list[str], dtype: str | None, before: int,
                   name: str = name, step: int | None = d.entry.step) -> None:
            # Recorded before the first change: a crash from here on leaves a checkpoint that
            # is whole or thinned, with or without its manifest; readers of the ledger then
            # verify it afresh instead of reporting it bad (see thinning.pending).
            append(root, LedgerEntry(path=name, step=step, time=time.time(), event=THINNED,
                                     verdict="good", bytes=before,
                                     detail={"dropped": dropped, "dtype": dtype,
                                             "bytes_before": before, PENDING: True}))

        try:
            if book is not None and _killed_thinning(book, name):
                tidy(d.entry.path)  # object storage: what the killed thinning left unnamed
            done = thin_file(d.entry.path, to=plan.policy.thin_to, on_start=intent)
        except CkptError as e:
            result.thin_skipped[name] = e.message
            report(PruneEvent("thin-skipped", name, e.message, plan=plan))
            continue
        if done is None:
            result.thin_skipped[name] = "no optimizer state to drop (thinned already?)"
            continue  # a killed prune's thinning of it: finished by settle() below
        if done.manifest_digest is None and name in manifested:
            with contextlib.suppress(CkptError):  # watch writes it when it verifies it
                write_manifest(d.entry.path)
                done.manifest_digest = manifest_digest(d.entry.path)
        result.thinned[name] = done
        detail = {"dropped": done.dropped, "dtype": done.dtype,
                  "bytes_before": done.bytes_before}
        append(root, LedgerEntry(path=name, step=d.entry.step, time=time.time(), event=THINNED,
                                 verdict="good", bytes=done.bytes_after,
                                 manifest_digest=done.manifest_digest, detail=detail))
        report(PruneEvent("thinned", name, f"{dropped_words(done.dropped)}"
                          f"{', weights to ' + done.dtype if done.dtype else ''}: "
                          f"{done.bytes_before:,} -> {done.bytes_after:,} bytes", plan=plan))
    settle(root, plan, result, report)


def _killed_thinning(book: Ledger, name: str) -> bool:
    """Whether the newest ``thinned`` line of checkpoint ``name`` is a pending intent."""

    line = next((e for e in reversed(book.entries) if e.path == name and e.event == THINNED),
                None)
    return line is not None and pending(line)


def dropped_words(dropped: list[str]) -> str:
    """What thinning dropped, in words: each optimizer entry keeps its ``param_groups``."""
    if not dropped:
        return "dropped nothing"
    return (f"dropped the optimizer state of {', '.join(dropped)} (param_groups kept)")


def settle(root: Path, plan: PrunePlan, result: PruneResult,
           report: Callable[[PruneEvent], None]) -> None:
    """Finish or undo every thinning a killed prune left unconfirmed, whether or not this plan
    thins the checkpoint: each one that stays, is complete and whose newest ``thinned`` line
    is still the intent (:func:`ckpt_cli.trust.thinning.pending`).

    Holding no optimizer state now (:func:`ckpt_cli.formats.containers.holds_optimizer_state`),
    it was thinned: its manifest is written (when missing or not matching) and the thinning
    confirmed, as this prune's own (``result.thinned``). Still whole, a ``thinned`` line with
    ``"undone": true`` records that the thinning was not carried out, followed by its last
    verdict again when its manifest is still the one that verdict recorded (so ``resume-path``
    and ``watch`` judge it as before the intent). A manifest that cannot be written is a
    failure (``result.thin_failed``): the prune does not exit 0.
    """

    try:
        book = read_ledger(root)
    except CkptError:
        return  # unreadable: watch and resume-path say so; nothing here to go by
    if book is None:
        return
    newest = {e.path: e for e in book.entries if e.event == THINNED}
    entries = {e.name: e for e in plan.listing.entries}
    for name, line in newest.items():
        entry = entries.get(name)
        outcome = result.outcomes.get(name)
        if (not pending(line) or entry is None or not entry.complete
                or (outcome is not None and outcome.status == "deleted")):
            continue
        earlier = result.thin_skipped.pop(name, None)
        try:
            done = _settle_one(root, entry, line, book)
        except CkptError as e:
            why = f"a killed prune began thinning it; {e.message}"
            result.thin_failed[name] = why
            result.thin_skipped[name] = why
            report(PruneEvent("thin-skipped", name, why, plan=plan))
            continue
        if done is not None:
            result.thinned[name] = done
            report(PruneEvent("thinned", name, "finished the thinning a killed prune began "
                              f"({dropped_words(done.dropped)}): its manifest and ledger line "
                              "written", plan=plan))
            continue
        why = ("a killed prune recorded its intent to thin it but left it whole: recorded as "
               "not thinned" + (f" ({earlier})" if earlier else ""))
        result.thin_skipped[name] = why
        report(PruneEvent("thin-skipped", name, why, plan=plan))


def _settle_one(root: Path, entry: RunEntry, line: LedgerEntry, book: Ledger) -> Thinned | None:
    """Settle one interrupted thinning (see :func:`settle`): what was done when it is thinned,
    None when it is whole (recorded as not thinned).

    Raises:
        CkptError: It cannot be read, or its manifest cannot be written.
    """

    path, name = entry.path, entry.name
    if not storage.has_file_system(path):
        tidy(path)  # what the killed thinning uploaded and nothing names
    try:
        thinned = not holds_optimizer_state(read_index(path))
    except CkptError as e:
        raise CkptError(f"it does not read now ({e.message}); left for watch to verify",
                        path=path) from None
    detail = {k: v for k, v in line.detail.items() if k != PENDING}
    if thinned:
        check = verify_manifest(path) if manifest_path(path).exists() else None
        if check is None or not check.ok:
            try:
                write_manifest(path)
            except CkptError as e:
                raise CkptError(f"its manifest cannot be written ({e.message})",
                                path=path) from None
        digest = manifest_digest(path)
        after = tree_scan(path).bytes
        append(root, LedgerEntry(path=name, step=line.step, time=time.time(), event=THINNED,
                                 verdict="good", bytes=after, manifest_digest=digest,
                                 detail=detail))
        dropped = detail.get("dropped")
        dtype = detail.get("dtype")
        before = detail.get("bytes_before")
        return Thinned(path, [str(x) for x in dropped] if isinstance(dropped, list) else [],
                       dtype if isinstance(dtype, str) else None,
                       before if isinstance(before, int) else after, after, digest)
    # Whole: the intent was never carried out.
    digest = manifest_digest(path) if manifest_path(path).exists() else None
    verdict = next((e for e in reversed(book.entries) if e.path == name
                    and e.event == VERIFIED and e.time <= line.time), None)
    now = time.time()
    append(root, LedgerEntry(path=name, step=line.step, time=now, event=THINNED,
                             verdict="good", bytes=tree_scan(path).bytes,
                             manifest_digest=digest,
                             detail={**detail, "dropped": [], "dtype": None, UNDONE: True}))
    if verdict is not None and verdict.good and digest and verdict.manifest_digest == digest:
        # Its manifest is the one its last verdict recorded: that verdict holds again (every
        # reader re-checks the files against it before trusting it).
        append(root, dataclasses.replace(verdict, time=now))
    return None
