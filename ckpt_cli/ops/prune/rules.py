"""The retention rules of ``ckpt prune``, each deciding on its own which checkpoints it keeps
(:func:`keep_sets`), and the policy that names them (:class:`PrunePolicy`);
:mod:`ckpt_cli.ops.prune.retention` combines them with the protections.

Pure, as retention is: nothing here reads a file.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from ckpt_cli.errors import UsageError
from ckpt_cli.formats.names import is_last_copy
from ckpt_cli.model import RunEntry
from ckpt_cli.units import format_size

DEFAULT_GRACE = 600.0
"""Seconds: a checkpoint touched more recently than this may still be being written."""

# Retention rules, in the order reports list them.
RULES = ("keep", "keep-every", "keep-best", "older-than", "max-total-size")
@dataclass(frozen=True, slots=True)
class PrunePolicy:
    """What to keep. Rules combine: a checkpoint is kept if any of them keeps it.

    Attributes:
        keep: Keep the newest N checkpoints.
        keep_every: Keep checkpoints whose step is a multiple of this (milestones).
        keep_best: Keep the N best checkpoints by ``metric``.
        metric: The metric ``keep_best`` ranks by (``eval_loss``, ``val_loss``...).
        mode: ``min`` (lower is better, e.g. a loss) or ``max`` (e.g. an accuracy).
        older_than: Seconds; checkpoints modified more recently are kept.
        max_total_size: Bytes; the newest checkpoints that fit in it together are kept.
        grace: Seconds; anything changed more recently may still be being written and is never
            deleted. 0 turns this protection off (markers, locks and pointers still protect).
        thin_after: Thin what stays beyond the newest N counted checkpoints (see
            :mod:`ckpt_cli.trust.thinning`): rewrite it without optimizer state.
        thin_to: ``bf16`` to cast the weights of thinned checkpoints too.
        keep_full_every: Never thin checkpoints whose step is a multiple of this.
        keep_abandoned: Keep the checkpoints of a timeline a rollback abandoned (they still
            take no place of ``keep`` or ``keep_every``); by default they are deleted.
    """

    keep: int | None = None
    keep_every: int | None = None
    keep_best: int | None = None
    metric: str | None = None
    mode: Literal["min", "max"] = "min"
    older_than: float | None = None
    max_total_size: int | None = None
    grace: float = DEFAULT_GRACE
    thin_after: int | None = None
    thin_to: str | None = None
    keep_full_every: int | None = None
    keep_abandoned: bool = False

    def rules(self) -> list[str]:
        """The retention rules this policy uses.

        Returns:
            Rule names from :data:`RULES`, in that order.
        """
        given = {"keep": self.keep, "keep-every": self.keep_every, "keep-best": self.keep_best,
                 "older-than": self.older_than, "max-total-size": self.max_total_size}
        return [r for r in RULES if given[r] is not None]

    def check(self) -> None:
        """Reject policies that cannot be meant.

        Raises:
            UsageError: No rule at all (that would delete everything unprotected), a count or
                size below 1, ``keep_best`` without ``metric`` (or the reverse), a bad ``mode``,
                or a negative ``grace``.
        """
        if not self.rules() and self.thin_after is None:
            raise UsageError("say what to keep: keep N, keep_every STEPS, keep_best N "
                             "metric NAME, older_than AGE or max_total_size SIZE (or "
                             "what to thin: thin_after N)",
                             param=("keep", "keep_every", "keep_best", "metric", "older_than",
                                    "max_total_size", "thin_after"))
        if self.thin_after is None and (self.thin_to or self.keep_full_every):
            raise UsageError("thin_to and keep_full_every are used only with thin_after N",
                             param=("thin_to", "keep_full_every", "thin_after"))
        if self.thin_to is not None and self.thin_to != "bf16":
            raise UsageError(f"thin_to must be bf16, not {self.thin_to!r}", param="thin_to")
        for name, value in (("keep", self.keep), ("keep_every", self.keep_every),
                            ("thin_after", self.thin_after),
                            ("keep_full_every", self.keep_full_every),
                            ("keep_best", self.keep_best),
                            ("max_total_size", self.max_total_size)):
            if value is not None and value < 1:
                raise UsageError(f"{name} must be at least 1, not {value}", param=name)
        if self.older_than is not None and not self.older_than > 0:
            raise UsageError("older_than must be positive", param="older_than")
        if self.keep_best is not None and not self.metric:
            raise UsageError("keep_best needs metric NAME (e.g. metric eval_loss)",
                             param=("keep_best", "metric"))
        if self.metric and self.keep_best is None:
            raise UsageError("metric is used only with keep_best N", param=("metric", "keep_best"))
        if self.mode not in ("min", "max"):
            raise UsageError(f"mode must be min or max, not {self.mode!r}", param="mode")
        if not self.grace >= 0 or math.isinf(self.grace):
            raise UsageError("grace must be a duration of 0 or more", param="grace")


KeepSet = dict[str, tuple[bool, str]]
"""Per rule: checkpoint name -> (kept by this rule, the sentence saying why or why not)."""


def keep_sets(ranked: list[RunEntry], entries: list[RunEntry], policy: PrunePolicy,
               now: float, metrics: Mapping[str, float | None],
               uncounted: Mapping[str, str]) -> dict[str, KeepSet]:
    """Each rule's own verdict on every ranked checkpoint, independent of the other rules.

    Args:
        ranked: The checkpoints the rules rank, oldest first.
        entries: All of the listing's entries (``last.ckpt`` copies use up size budget).
        policy: The rules.
        now: The current time, for ``older_than``.
        metrics: Each checkpoint's ``--metric`` value (None: none).
        uncounted: Checkpoints ``keep`` does not count, and why.

    Returns:
        Rule name -> its :data:`KeepSet`.
    """
    out: dict[str, KeepSet] = {}
    newest_first = list(reversed(ranked))
    if policy.keep is not None:
        n = policy.keep
        counted = 0
        keep_set: KeepSet = {}
        for e in newest_first:
            why = uncounted.get(e.name)
            if counted >= n:
                keep_set[e.name] = (False, f"not among the newest {n} complete")
            elif why:
                # Fewer than N counted ones are newer: it sits among (or before) the newest
                # N, not necessarily newer than all of them.
                keep_set[e.name] = (True, f"fewer than {n} complete ones are newer "
                                          f"(`keep={n}`); not counted: {why}")
            else:
                counted += 1
                keep_set[e.name] = (True, f"newest {n} complete (`keep={n}`)")
        out["keep"] = keep_set
    if policy.keep_every is not None:
        k = policy.keep_every
        out["keep-every"] = {
            e.name: (True, f"step {e.step:,} is a multiple of {k:,} (`keep_every={k}`)")
            if e.step is not None and e.step % k == 0 else
            (False, f"step {e.step:,} is not a multiple of {k:,}" if e.step is not None
             else "no step to compare with `keep_every`")
            for e in ranked}
    if policy.keep_best is not None:
        out["keep-best"] = _best(ranked, policy, metrics)
    if policy.older_than is not None:
        limit = policy.older_than
        out["older-than"] = {
            e.name: (now - e.mtime < limit,
                     f"modified {ago(now - e.mtime)}, within `older_than={dur(limit)}`"
                     if now - e.mtime < limit else
                     f"modified {ago(now - e.mtime)}, older than {dur(limit)}")
            for e in ranked}
    if policy.max_total_size is not None:
        budget = policy.max_total_size
        # last.ckpt copies always stay, so they use up budget first.
        used = sum(e.bytes for e in entries if is_last_copy(e.name))
        fits = True
        verdict: KeepSet = {}
        for e in newest_first:
            used += e.bytes
            fits = fits and used <= budget
            verdict[e.name] = (fits, f"the newest checkpoints up to here fit in "
                                     f"`max_total_size={format_size(budget)}`" if fits else
                               f"beyond `max_total_size={format_size(budget)}` (newest kept first)")
        out["max-total-size"] = verdict
    return out


def _best(ranked: list[RunEntry], policy: PrunePolicy,
          metrics: Mapping[str, float | None]) -> KeepSet:
    n, metric = policy.keep_best or 0, policy.metric
    scored = [(metrics.get(e.name), i, e) for i, e in enumerate(ranked)
              if metrics.get(e.name) is not None]
    sign = 1.0 if policy.mode == "min" else -1.0
    # Better value first; among equal values the newer checkpoint wins.
    scored.sort(key=lambda t: (sign * (t[0] or 0.0), -t[1]))
    best = {e.name: rank for rank, (_v, _i, e) in enumerate(scored[:n])}
    out: KeepSet = {}
    for e in ranked:
        value = metrics.get(e.name)
        if e.name in best:
            out[e.name] = (True, f"best {n} by {metric} ({policy.mode}): {value:.6g} "
                                 f"(`keep_best={n}`)")
        elif value is None:
            out[e.name] = (False, f"no {metric} value")
        else:
            out[e.name] = (False, f"{metric} {value:.6g} is not among the best {n}")
    return out


def dur(seconds: float) -> str:
    """A duration as typed on the command line: ``7d``, ``10m``, ``90s``.

    Args:
        seconds: The duration.

    Returns:
        Its text.
    """
    for unit, secs in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= secs and seconds % secs == 0:
            return f"{int(seconds // secs)}{unit}"
    return f"{seconds:g}s"


def ago(seconds: float) -> str:
    """An age as a report says it: ``3m ago``, ``2.5h ago``.

    Args:
        seconds: The age (negative: in the future).

    Returns:
        Its text.
    """
    if seconds < 0:
        return "in the future (clock skew?)"
    if seconds < 90:
        return f"{seconds:.0f}s ago"
    if seconds < 5400:
        return f"{seconds / 60:.0f}m ago"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f}h ago"
    return f"{seconds / 86400:.1f}d ago"
