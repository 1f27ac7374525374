"""``prune``'s thinning step (``--thin-after``): after the deletions, each checkpoint the plan
thins is re-checked by the run's site and rewritten without its optimizer state by
:mod:`ckpt_cli.trust.thinning`, with an intent line in the run ledger before the first change and a
``thinned`` line after it."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path

from ckpt_cli import storage
from ckpt_cli.errors import CkptError
from ckpt_cli.model import RunEntry
from ckpt_cli.ops.prune.result import PruneEvent, PruneResult
from ckpt_cli.ops.prune.retention import PrunePlan
from ckpt_cli.runs import tree_scan
from ckpt_cli.trust.ledger import Ledger, read_ledger


def thin(root: Path, plan: PrunePlan, result: PruneResult,
         recheck_one: Callable[[RunEntry], str | None],
         report: Callable[[PruneEvent], None]) -> None:
    """Rewrite the checkpoints the plan thins (``--thin-after``), each re-checked first
    (``recheck_one``: the site's re-check), and append a ``thinned`` line to the run ledger for
    each."""
    from ckpt_cli.trust.ledger import THINNED, LedgerEntry, append
    from ckpt_cli.trust.thinning import PENDING, can_thin, thin_file, tidy

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
            _confirm_interrupted(root, name, d.entry.step)
            continue
        if done.manifest_digest is None and name in manifested:
            from ckpt_cli.manifest import write_manifest
            from ckpt_cli.trust.ledger import manifest_digest

            with contextlib.suppress(CkptError):  # watch writes it when it verifies it
                write_manifest(d.entry.path)
                done.manifest_digest = manifest_digest(d.entry.path)
        result.thinned[name] = done
        detail = {"dropped": done.dropped, "dtype": done.dtype,
                  "bytes_before": done.bytes_before}
        append(root, LedgerEntry(path=name, step=d.entry.step, time=time.time(), event=THINNED,
                                 verdict="good", bytes=done.bytes_after,
                                 manifest_digest=done.manifest_digest, detail=detail))
        report(PruneEvent("thinned", name, f"dropped {', '.join(done.dropped) or 'nothing'}"
                          f"{', weights to ' + done.dtype if done.dtype else ''}: "
                          f"{done.bytes_before:,} -> {done.bytes_after:,} bytes", plan=plan))


def _killed_thinning(book: Ledger, name: str) -> bool:
    """Whether the newest ``thinned`` line of checkpoint ``name`` is a pending intent."""
    from ckpt_cli.trust.ledger import THINNED
    from ckpt_cli.trust.thinning import pending

    line = next((e for e in reversed(book.entries) if e.path == name and e.event == THINNED),
                None)
    return line is not None and pending(line)


def _confirm_interrupted(root: Path, name: str, step: int | None) -> None:
    """A checkpoint thinned by a prune that was killed before recording it (its newest
    ``thinned`` line is still the intent): give it its manifest again (when it has none) and
    record the thinning as done."""
    from ckpt_cli.manifest import manifest_path, write_manifest
    from ckpt_cli.trust.ledger import THINNED, LedgerEntry, append, manifest_digest
    from ckpt_cli.trust.thinning import PENDING, pending

    book = read_ledger(root)
    # Its newest thinning line (a watch pass may have verified it again since).
    line = next((e for e in reversed(book.entries) if e.path == name and e.event == THINNED),
                None) if book is not None else None
    if line is None or not pending(line):
        return
    path = root / name
    if not manifest_path(path).exists():
        with contextlib.suppress(CkptError):  # then watch writes it when it verifies it
            write_manifest(path)
    detail = {k: v for k, v in line.detail.items() if k != PENDING}
    append(root, LedgerEntry(path=name, step=step, time=time.time(), event=THINNED,
                             verdict="good", bytes=tree_scan(path).bytes,
                             manifest_digest=manifest_digest(path), detail=detail))
