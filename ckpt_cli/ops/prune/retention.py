"""Retention: which checkpoints of a run directory ``ckpt prune`` keeps and deletes, and why.

Pure: :func:`plan_prune` decides from what it is given and never touches the filesystem.
Everything it needs that comes from reading files (which checkpoints pass a quick validation,
lock files, metric values) is gathered by :mod:`ckpt_cli.ops.prune` into a :class:`RunFacts`
first, so the decision itself can be tested exhaustively.

The rules, in words:

- Each retention rule (``--keep``, ``--keep-every``, ``--keep-best``, ``--older-than``,
  ``--max-total-size``) computes its own keep set; a checkpoint is kept if any rule keeps it.
- ``--keep N`` counts only checkpoints worth keeping: complete, not possibly still being written
  (incomplete, within the grace period, locked, newer than what a pointer names), not failed by
  quick validation and, where the run has a ledger (``ckpt-ledger.jsonl``), whose newest ledger
  line says ``good``. It keeps everything newer than the N-th such checkpoint too (a save in
  progress, an unverified one, a bad one: kept, not counted), and lets older ones go. So a bad
  checkpoint is left while it is among the newest and deleted like any other once N good ones
  are newer; the newest valid checkpoint is never deleted.
- Timelines: a checkpoint a rollback abandoned (the ledger shows a lower step committed after
  it) takes no place of any rule, so after a rollback ``--keep N`` holds N checkpoints of the
  current timeline; it is deleted (unless ``keep_abandoned``) when no protection keeps it.
- Protections override every rule: what a pointer names, ``last.ckpt`` copies, anything that may
  still be being written (incomplete, changed within the grace period, locked, newer than what
  ``latest`` names), the newest valid checkpoint, and names the caller pins (HF Trainer's
  ``best_model_checkpoint``).
- If what a pointer names cannot be told, or no checkpoint passes validation, nothing is deleted.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from ckpt_cli.formats.names import is_last_copy
from ckpt_cli.formats.probe import LINK_OUT
from ckpt_cli.model import DANGLING_POINTER, POINTER_UNREADABLE, Finding, RunEntry, RunListing

# Re-exported: the policy and its constants were defined here before ops/prune/rules.py.
from ckpt_cli.ops.prune.rules import DEFAULT_GRACE as DEFAULT_GRACE
from ckpt_cli.ops.prune.rules import RULES as RULES
from ckpt_cli.ops.prune.rules import KeepSet, ago, dur, keep_sets
from ckpt_cli.ops.prune.rules import PrunePolicy as PrunePolicy
from ckpt_cli.units import format_size

# Protections: reasons a checkpoint is never deleted, whatever the rules say.
PROTECTIONS = ("halt", "pointer", "last-copy", "newer-than-pointer", "incomplete", "recent",
               "locked", "newest-valid", "pinned", "unordered")


@dataclass(slots=True)
class RunFacts:
    """What reading the run directory's files found, for :func:`plan_prune`.

    Attributes:
        validity: For the checkpoints that were validated: None when valid, else why not. A
            complete checkpoint missing here counts as valid (the caller validates from the
            newest back and stops at the first valid one).
        metrics: The ``--metric`` value of each checkpoint that has one (from a metrics file
            or trainer state); a metric in the checkpoint's name is used when absent here.
        locks: Checkpoints with a writer's lock file, and the file.
        pinned: Checkpoints to keep for a reason found in the files (for example HF Trainer's
            ``best_model_checkpoint``), and that reason.
        ledger: Whether the run has a ledger; then only checkpoints in ``verdicts`` with a good
            verdict count towards ``--keep``.
        verdicts: Checkpoint name -> whether its newest ledger line says ``good``.
        abandoned: Checkpoints of a timeline a rollback abandoned (a lower step was committed
            after them, :func:`ckpt_cli.trust.ledger.abandoned`) and still as verified, with
            the sentence saying so: they take no place of any rule and are deleted unless
            ``keep_abandoned``.
    """

    validity: dict[str, str | None] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    locks: dict[str, str] = field(default_factory=dict)
    pinned: dict[str, str] = field(default_factory=dict)
    ledger: bool = False
    verdicts: dict[str, bool] = field(default_factory=dict)
    abandoned: dict[str, str] = field(default_factory=dict)


# Protections that say a checkpoint may still be being written: it is never counted by --keep.
IN_PROGRESS = ("incomplete", "recent", "locked", "newer-than-pointer")


@dataclass(slots=True)
class Decision:
    """What happens to one checkpoint, and why.

    Attributes:
        entry: The checkpoint.
        delete: Whether it is to be deleted.
        kept_by: Retention rules (:data:`RULES`) that keep it, and ``keep-abandoned``.
        protected_by: Protections (:data:`PROTECTIONS`) that forbid deleting it.
        reasons: One plain sentence per rule or protection that decided, or, for a deletion,
            why each rule let it go.
        metric: Its ``--metric`` value, if any.
        valid: Whether quick validation passed (None: not validated).
        thin: Whether ``--thin-after`` thins it (it stays, without optimizer state).
    """

    entry: RunEntry
    delete: bool
    kept_by: list[str] = field(default_factory=list)
    protected_by: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    metric: float | None = None
    valid: bool | None = None
    thin: bool = False


@dataclass(slots=True)
class PrunePlan:
    """The decisions for a run directory.

    Attributes:
        listing: The run directory as listed.
        policy: The policy applied.
        now: The time the plan was made for (seconds since the epoch).
        decisions: One per checkpoint, oldest first.
        newest_valid: The newest checkpoint that is complete and passed validation.
        findings: Notes for the report (ordering by mtime, a budget that cannot be met...).
    """

    listing: RunListing
    policy: PrunePolicy
    now: float
    decisions: list[Decision]
    newest_valid: str | None
    findings: list[Finding] = field(default_factory=list)

    @property
    def to_delete(self) -> list[Decision]:
        """The decisions to delete, oldest first."""
        return [d for d in self.decisions if d.delete]

    @property
    def kept(self) -> list[Decision]:
        """The decisions to keep, oldest first."""
        return [d for d in self.decisions if not d.delete]

    @property
    def bytes_total(self) -> int:
        """Bytes of all checkpoints."""
        return sum(d.entry.bytes for d in self.decisions)

    @property
    def bytes_to_free(self) -> int:
        """Bytes of the checkpoints to delete."""
        return sum(d.entry.bytes for d in self.to_delete)


def plan_prune(listing: RunListing, policy: PrunePolicy, now: float,
               facts: RunFacts | None = None) -> PrunePlan:
    """Decide what to keep and what to delete in a run directory.

    Pure: the same arguments give the same plan, and nothing is read or written.

    Args:
        listing: The run directory's checkpoints, oldest first (``runs.list_run``).
        policy: The retention rules.
        now: The current time (seconds since the epoch), for ages and the grace period.
        facts: What reading files found (validation, metrics, locks, pins); none by default.

    Returns:
        The :class:`PrunePlan`.

    Raises:
        UsageError: If the policy is not usable (see :meth:`PrunePolicy.check`).
    """
    policy.check()
    facts = facts or RunFacts()
    entries = listing.entries
    decisions = {e.name: Decision(e, delete=False) for e in entries}
    findings: list[Finding] = []
    # "last.ckpt" copies are not ranked: they duplicate a ranked checkpoint and are always kept,
    # so "the newest N" means N distinct saves.
    ranked = ranked_entries(entries)
    # The rules rank the run's current timeline: what a rollback abandoned takes no place.
    current = [e for e in ranked if e.name not in facts.abandoned]
    for e in entries:
        decisions[e.name].metric = _metric_of(e, policy, facts)
        if e.name in facts.validity:
            decisions[e.name].valid = facts.validity[e.name] is None

    protections = _protections(listing, policy, now, facts)
    uncounted = {name: why for name, why in (
        (e.name, _not_counted(e, protections.get(e.name, []), facts)) for e in ranked) if why}
    rule_sets = keep_sets(current, entries, policy, now,
                          {n: d.metric for n, d in decisions.items()}, uncounted)
    newest_valid = _newest_valid(current, facts)
    if newest_valid is not None:
        protections.setdefault(newest_valid.name, []).append(
            ("newest-valid", _newest_valid_reason(current, newest_valid, facts, rule_sets)))
    halt = _halt_reason(listing, current, newest_valid)
    if halt:
        findings.append(Finding("error", "nothing-deleted", halt))

    for e in entries:
        d = decisions[e.name]
        for code, reason in protections.get(e.name, []):
            d.protected_by.append(code)
            d.reasons.append(reason)
        if halt:
            d.protected_by.insert(0, "halt")
            d.reasons.insert(0, halt)
        for rule in RULES:
            kept, reason = rule_sets.get(rule, {}).get(e.name, (False, ""))
            if kept:
                d.kept_by.append(rule)
                d.reasons.append(reason)
        abandoned = facts.abandoned.get(e.name)
        if abandoned and policy.keep_abandoned:
            d.kept_by.append("keep-abandoned")
            d.reasons.append(f"{abandoned}; kept (`keep_abandoned`), not counted")
        # Thinning alone (--thin-after without a retention rule) deletes nothing.
        d.delete = bool(policy.rules()) and not d.kept_by and not d.protected_by
        if d.delete and abandoned:
            d.reasons = [f"{abandoned} (`keep_abandoned` keeps it)"]
        elif d.delete:
            why_not = [rule_sets[rule][e.name][1] for rule in RULES
                       if rule in rule_sets and e.name in rule_sets[rule]]
            d.reasons = ["not kept by any rule: " + "; ".join(why_not)]
        elif abandoned and not policy.keep_abandoned:
            d.reasons.append(abandoned)

    if policy.thin_after is not None:
        _mark_thinning(ranked, policy, decisions, uncounted)
    for d in decisions.values():
        if not d.reasons:  # every line says why; kept without a rule only when none deletes
            d.reasons.append("no retention rule deletes it" if not policy.rules() else
                             "kept: no rule let it go")
    plan = PrunePlan(listing, policy, now, [decisions[e.name] for e in entries],
                     newest_valid.name if newest_valid else None, findings)
    if policy.max_total_size is not None:
        after = plan.bytes_total - plan.bytes_to_free
        if after > policy.max_total_size:
            findings.append(Finding(
                "warning", "over-budget",
                f"{format_size(after)} stay after pruning, more than "
                f"`max_total_size={format_size(policy.max_total_size)}`: other rules or "
                "protections keep the rest"))
    return plan


def ranked_entries(entries: list[RunEntry]) -> list[RunEntry]:
    """The checkpoints the rules rank, oldest first: all but ``last.ckpt``-style copies (and,
    when some entries have a step, those that have none).

    Those copies duplicate a ranked checkpoint and are always kept, so "the newest N" means N
    distinct saves.

    Args:
        entries: A listing's entries, oldest first.

    Returns:
        The ranked ones, in the same order.
    """
    ranked = [e for e in entries if not is_last_copy(e.name)]
    # Entries without a step cannot be placed among those with one: they are kept
    # ("unordered") and do not take the places of the newest.
    if any(e.step is not None for e in ranked):
        ranked = [e for e in ranked if e.step is not None]
    return ranked


def pointer_protections(entries: list[RunEntry],
                        pointers: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """Checkpoints that pointers protect: what each names, and anything newer than that.

    Writers (DeepSpeed, Megatron, ``ckpt sample``) update the pointer after the save finishes,
    so a checkpoint newer than the newest one named may be a save in progress.

    Args:
        entries: A listing's entries, oldest first.
        pointers: Pointer file -> the name it points to.

    Returns:
        Name -> ``(protection code, reason)``, the pointer's own target taking precedence.
    """
    named_by: dict[str, list[str]] = {}
    for pointer, target in pointers.items():
        named_by.setdefault(target, []).append(pointer)
    ranked = ranked_entries(entries)
    position = {e.name: i for i, e in enumerate(ranked)}
    newest_target = max((position[t] for t in named_by if t in position), default=None)
    out: dict[str, tuple[str, str]] = {}
    unordered = [e.name for e in entries if e.name in named_by and e.name not in position
                 and not is_last_copy(e.name)]
    if unordered:
        # A pointer names a checkpoint with no step: which ones are newer cannot be told, and
        # any of them may be a save in progress.
        target = unordered[0]
        for e in ranked:
            out[e.name] = ("newer-than-pointer",
                           f"{' and '.join(sorted(named_by[target]))} names {target}, which has "
                           "no step: any checkpoint may be newer, and still being written")
    elif newest_target is not None:
        target = ranked[newest_target].name
        for e in ranked[newest_target + 1:]:
            out[e.name] = ("newer-than-pointer",
                           f"newer than {target}, which {' and '.join(sorted(named_by[target]))}"
                           " names: may still be being written (writers update the pointer "
                           "last)")
    for e in entries:
        if e.name in named_by:
            out[e.name] = ("pointer", f"{' and '.join(sorted(named_by[e.name]))} names it")
    return out


def _metric_of(e: RunEntry, policy: PrunePolicy, facts: RunFacts) -> float | None:
    if not policy.metric:
        return None
    value = facts.metrics.get(e.name, e.metrics.get(policy.metric))
    return value if value is not None and not math.isnan(value) else None



# Protections under which a checkpoint is never rewritten either.
_NO_THIN = ("halt", "pointer", "last-copy", "newer-than-pointer", "incomplete", "recent",
            "locked", "pinned", "unordered")


def _mark_thinning(ranked: list[RunEntry], policy: PrunePolicy,
                   decisions: Mapping[str, Decision], uncounted: Mapping[str, str]) -> None:
    """Mark the checkpoints ``--thin-after`` rewrites: those that stay, older than the newest
    ``thin_after`` counted ones, not protected, not kept whole by ``--keep-full-every``."""
    k, every = policy.thin_after or 0, policy.keep_full_every
    counted = 0
    for e in reversed(ranked):
        d = decisions[e.name]
        if counted < k:
            counted += e.name not in uncounted
            if not d.reasons:  # thinning alone: no retention rule said anything
                d.reasons.append(f"among the newest {k} complete: kept whole "
                                 f"(`thin_after={k}`)")
            continue
        if d.delete or e.name in uncounted or any(p in _NO_THIN for p in d.protected_by):
            continue
        if every and e.step is not None and e.step % every == 0:
            d.reasons.append(f"kept whole: step {e.step:,} is a multiple of {every:,} "
                             f"(`keep_full_every={every}`)")
            continue
        d.thin = True
        d.reasons.append(f"older than the newest {k} complete: its optimizer state goes "
                         f"(`thin_after={k}`"
                         + (f", `thin_to={policy.thin_to}`)" if policy.thin_to else ")"))


def _not_counted(e: RunEntry, protections: list[tuple[str, str]], facts: RunFacts) -> str | None:
    """Why ``--keep`` does not count checkpoint ``e`` among the N it keeps (None: it counts)."""
    if e.name in facts.abandoned:
        return "abandoned by a rollback"
    busy = [code for code, _ in protections if code in IN_PROGRESS]
    if busy or not e.complete:
        return "may still be being written"
    verdict = facts.verdicts.get(e.name)
    if verdict is False:
        return "its run ledger verdict is bad"
    if facts.validity.get(e.name) is not None:
        return "failed quick validation"
    if facts.ledger and verdict is None:
        return "not verified yet (not in the run ledger)"
    return None


def _protections(listing: RunListing, policy: PrunePolicy, now: float,
                 facts: RunFacts) -> dict[str, list[tuple[str, str]]]:
    """Why each checkpoint must not be deleted, whatever the rules say (newest valid aside)."""
    out: dict[str, list[tuple[str, str]]] = {}

    def add(name: str, code: str, reason: str) -> None:
        out.setdefault(name, []).append((code, reason))

    by_pointer = pointer_protections(listing.entries, listing.pointers)
    has_steps = any(e.step is not None for e in listing.entries)
    for e in listing.entries:
        if has_steps and e.step is None and not is_last_copy(e.name):
            add(e.name, "unordered", "no step in its name or metadata: cannot be ordered "
                                     "against the checkpoints that have one")
        if e.name in by_pointer and not (by_pointer[e.name][0] == "newer-than-pointer"
                                          and e.name in facts.abandoned):
            # A higher step a rollback abandoned is newer than the pointer but no save in
            # progress: the ledger verified it, and its files are still what was verified.
            add(e.name, *by_pointer[e.name])
        if is_last_copy(e.name):
            add(e.name, "last-copy", "a last checkpoint (last.ckpt): training resumes from it")
        if not e.complete and LINK_OUT not in (e.reason or ""):
            # (A checkpoint linking out of the run is not read, nor kept as if being written:
            # it is deleted or kept by the rules, its links removed, never followed.)
            add(e.name, "incomplete", f"incomplete ({e.reason or 'unknown reason'}): may still "
                                      "be being written")
        age = now - e.changed
        if age < 0:  # a clock ahead of ours (NFS): its age is unknown, so it may be in use
            add(e.name, "recent", f"changed {ago(age)}: may still be being written")
        elif policy.grace and age < policy.grace:
            add(e.name, "recent", f"changed {ago(age)}, within `grace={dur(policy.grace)}`: "
                                  "may still be being written")
        if e.name in facts.locks:
            add(e.name, "locked", f"lock file {facts.locks[e.name]} present: a writer may hold "
                                  "it")
        if e.name in facts.pinned:
            add(e.name, "pinned", facts.pinned[e.name])
    return out


def _is_valid(e: RunEntry, facts: RunFacts) -> bool:
    return e.complete and facts.validity.get(e.name) is None


def _newest_valid(ranked: list[RunEntry], facts: RunFacts) -> RunEntry | None:
    return next((e for e in reversed(ranked) if _is_valid(e, facts)), None)


def _newest_valid_reason(ranked: list[RunEntry], newest: RunEntry, facts: RunFacts,
                         keep_sets: Mapping[str, KeepSet]) -> str:
    newer = ranked[ranked.index(newest) + 1:]
    if not newer:
        return "the newest valid checkpoint"
    why = ", ".join(f"{e.name}: {e.reason if not e.complete else facts.validity.get(e.name)}"
                    for e in newer[-3:])
    more = f" and {len(newer) - 3} more" if len(newer) > 3 else ""
    dropped = "keep" in keep_sets and not keep_sets["keep"][newest.name][0]
    note = ", kept although `keep` would drop it" if dropped else ""
    return (f"the newest valid checkpoint{note}: the {len(newer)} newer one(s) are incomplete "
            f"or invalid ({why}{more})")


def _halt_reason(listing: RunListing, ranked: list[RunEntry],
                 newest_valid: RunEntry | None) -> str | None:
    unreadable = [f for f in listing.findings if f.code == POINTER_UNREADABLE]
    if unreadable:
        return (f"nothing is deleted: {unreadable[0].message}, so what training resumes from "
                "is unknown")
    dangling = [f for f in listing.findings if f.code == DANGLING_POINTER]
    if dangling:
        return (f"nothing is deleted: {dangling[0].message}, so what training resumes from is "
                "unknown (`pattern` if it is a checkpoint ckpt does not recognise)")
    if ranked and newest_valid is None and any(e.complete for e in ranked):
        return ("nothing is deleted: no checkpoint passed quick validation, so there is no "
                "known-good checkpoint to fall back on")
    return None
