"""The retention rules of ``ckpt prune``, each deciding on its own which checkpoints it keeps
(:func:`keep_sets`), and the policy that names them (:class:`PrunePolicy`);
:mod:`ckpt_cli.ops.prune.retention` combines them with the protections.

Pure, as retention is: nothing here reads a file.
"""

from __future__ import annotations

from collections.abc import Mapping

from ckpt_cli.formats.names import is_last_copy
from ckpt_cli.model import RunEntry

# Declared in a light module (``ckpt prune --help`` builds its flags from it); re-exported.
from ckpt_cli.ops.options.prune import DEFAULT_GRACE as DEFAULT_GRACE
from ckpt_cli.ops.options.prune import RULES as RULES
from ckpt_cli.ops.options.prune import PrunePolicy as PrunePolicy
from ckpt_cli.units import format_size

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
