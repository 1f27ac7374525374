"""What ``ckpt stats`` flags in a run's figures, module by module, checkpoint by checkpoint.

* ``nan`` / ``inf``: a module holds NaN or infinite values where the previous checkpoint
  listed held none (or in the first one listed): flagged where it appears, not again while
  it stays. -Inf in a buffer is an attention mask's, on purpose: never flagged.
* ``norm-jump``: a module's L2 norm grew more than ``jump`` times since the previous checkpoint
  (its norm there not zero: a zero-initialized bias grows from nothing legitimately). The norm
  is that of its floating-point tensors: an integer buffer (BatchNorm's
  ``num_batches_tracked``) counts steps, and grows with them, not with the weights' health; a
  module of integer tensors only is not judged on its norm. A module growing from zero (a
  LoRA ``B``, a zero-initialized projection) grows with the steps since (each optimizer step
  moves its values by about the learning rate, which a warmup raises linearly: the norm grows
  up to the square of the steps): from step ``t-1`` to ``t`` it may grow
  ``jump * ((t - t0) / (t-1 - t0)) ** 2`` times, ``t0`` being its last step at zero, or step 0
  when no checkpoint listed shows it at zero (no step-0 save) but its norm is still below
  :data:`NEAR_ZERO` of its own scale (``ModuleStats.init_sq``: the norm its matrices would
  have at torch's default initialization). Optimizer state (Adam's moments) starts at zero at
  step 0: it is judged so, always.
* ``frozen``: a module's weights are bit for bit those of the previous checkpoint while they
  had changed between the two before: training stopped updating it (a lost ``requires_grad``,
  an optimizer that lost its parameter group). A module that never changed (frozen on
  purpose, a constant buffer) is not flagged, nor are two saves of one step (Lightning's
  ``last.ckpt`` beside the checkpoint it copies).
* ``dead``: a tensor became all zeros (it was not in the previous checkpoint): a wiped or
  never-restored tensor. One all zeros from the start (a LoRA ``B``, a zero-initialized
  projection) is not flagged.

* ``unreadable``: a tensor whose values could not be read (a truncated or damaged file, a
  record failing its CRC, ZeRO partitions that cannot be gathered), or a checkpoint of the run
  that could not be opened at all: its figures are unknown, which a gate must not pass.
* ``mismatch``: a checkpoint whose weights and buffers differ from the previous one's in names
  or shapes: not the same model (two runs in one directory); updates are computed only
  between tensors of the same name and shape.

Non-parameter state (group ``other``: callbacks, loop counters, Lightning's
``best_model_score``, which ModelCheckpoint sets to ``inf`` on purpose) is shown, never judged.

A single checkpoint is judged on NaN, Inf and unreadable tensors only (there is nothing to
compare it with): :func:`detect` of a list of one.
"""

from __future__ import annotations

import math

from ckpt_cli.errors import CkptError
from ckpt_cli.ops.stats.result import CHECKPOINT, Anomaly, CheckpointStats, ModuleStats

NEAR_ZERO = 0.1
"""A module whose norm is below this fraction of its own scale is still growing from zero."""
"""The ``module`` of anomalies of a whole checkpoint (``unreadable``, ``mismatch``)."""


def _advanced(prev: CheckpointStats | None, c: CheckpointStats) -> bool:
    """Whether training went on between two checkpoints (not two saves of one step)."""
    return prev is None or prev.step is None or c.step is None or c.step != prev.step


def _jump(c: CheckpointStats, prev: CheckpointStats | None, m: ModuleStats, old: ModuleStats,
          jump: float, zero_at: int | None) -> Anomaly | None:
    """A ``norm-jump`` of module ``m`` from ``old`` (in ``prev``) to ``m`` (in ``c``), if it
    is one (see the module notes: growth from zero is judged against the steps since)."""
    was, now, module = old.float_l2, m.float_l2, m.name
    if was is None or now is None or not (was > 0 and math.isfinite(was)
                                          and math.isfinite(now)):
        return None
    limit = jump
    if zero_at is None and (m.optimizer or was < NEAR_ZERO * math.sqrt(old.init_sq)):
        zero_at = 0  # no save shows it at zero, but it is still growing from there
    if zero_at is not None and prev is not None and prev.step is not None \
            and c.step is not None and prev.step > zero_at:
        limit = jump * max(1.0, (c.step - zero_at) / (prev.step - zero_at)) ** 2
    if now <= limit * was:
        return None
    return Anomaly(c.step, c.name, module, "norm-jump",
                   f"L2 norm grew {now / was:,.3g}x ({was:.4g} -> {now:.4g})",
                   {"l2": now, "previous_l2": was, "ratio": now / was})


def _nonfinite(kind: str, c: CheckpointStats, name: str, count: int, numel: int) -> Anomaly:
    what = "NaN" if kind == "nan" else "infinite"
    return Anomaly(c.step, c.name, name, kind, f"{count:,} of {numel:,} values are {what}",
                   {kind: count, "numel": numel})


def detect(checkpoints: list[CheckpointStats], *, jump: float) -> list[Anomaly]:
    """The anomalies of a list of checkpoints in step order.

    Args:
        checkpoints: Their figures (modules with ``update`` filled between neighbours).
        jump: The norm growth factor flagged.

    Returns:
        The anomalies, in step order then module order.
    """
    out: list[Anomaly] = []
    prev: CheckpointStats | None = None
    zero_at: dict[str, int] = {}  # module -> the last step where its norm was zero
    for c in checkpoints:
        pm = {m.name: m for m in prev.modules} if prev is not None else {}
        pt = {t.name: t for t in prev.tensors} if prev is not None else {}
        for m in c.modules:
            old = pm.get(m.name) if pm else None
            mo = m.moments
            # ModuleStats' suspect_nan and suspect_inf, said inline: a million modules.
            if mo.nan != m.state_nan and (old is None or not old.suspect_nan):
                out.append(_nonfinite("nan", c, m.name, m.suspect_nan, mo.numel))
            if mo.posinf + mo.neginf != m.masks + m.state_inf \
                    and (old is None or not old.suspect_inf):
                out.append(_nonfinite("inf", c, m.name, m.suspect_inf, mo.numel))
            if c.step is not None and m.float_sumsq == 0.0:  # float_l2 is 0.0 exactly then
                zero_at[m.name] = c.step
            if old is None:
                continue
            flagged = _jump(c, prev, m, old, jump, zero_at.get(m.name))
            if flagged is not None:
                out.append(flagged)
            # old.update > 0: it changed between the two checkpoints before this one.
            if (m.update == 0.0 and old.update is not None and old.update > 0
                    and _advanced(prev, c)):
                out.append(Anomaly(c.step, c.name, m.name, "frozen",
                                   "weights unchanged since the previous checkpoint, after "
                                   f"changing before it (update ratio {old.update_ratio or 0:.3g})",
                                   {"update_ratio": 0.0,
                                    "previous_update_ratio": old.update_ratio}))
        for t in c.tensors:
            tm = t.moments
            if tm is None or t.same_as is not None or not tm.numel or tm.zeros != tm.numel \
                    or t.group == "other":
                continue
            was_t = pt.get(t.name)
            if was_t is not None and was_t.moments is not None and \
                    was_t.moments.zeros < was_t.moments.numel:
                out.append(Anomaly(c.step, c.name, t.module, "dead",
                                   f"{t.name}: all {tm.numel:,} values became zero",
                                   {"tensor": t.name, "numel": tm.numel}))
        prev = c
    return out


def unreadable(c: CheckpointStats, errors: dict[str, str]) -> list[Anomaly]:
    """``unreadable`` anomalies: the tensors of ``c`` whose values could not be read.

    Args:
        c: The checkpoint's figures (its tensors name their module).
        errors: Why each tensor could not be read, by name.
    """
    if not errors:
        return []
    modules = {t.name: t.module for t in c.tensors}
    return [Anomaly(c.step, c.name, modules.get(name, ""), "unreadable",
                    f"{name}: values not read: {why}", {"tensor": name})
            for name, why in sorted(errors.items())]


def broken_checkpoint(name: str, step: int | None, err: CkptError) -> Anomaly:
    """``unreadable``: a checkpoint of a run, complete by its name and markers, that could not
    be opened (a truncated file, a damaged index).

    Args:
        name: Its name in the run.
        step: Its step, if its name gives one.
        err: Why it could not be opened.
    """
    return Anomaly(step, name, CHECKPOINT, "unreadable",
                   f"checkpoint not read: {err.message}", {"tensor": None})


def mismatches(checkpoints: list[CheckpointStats]) -> list[Anomaly]:
    """``mismatch``: each checkpoint whose weights and buffers differ from the previous one's
    in names or shapes (see the module notes).

    Args:
        checkpoints: Their figures, in step order.
    """
    out: list[Anomaly] = []
    prev: dict[str, tuple[int, ...]] | None = None
    prev_name = ""
    if len(checkpoints) < 2:
        return out  # nothing to compare with
    for c in checkpoints:
        now = {t.name: t.shape for t in c.tensors if t.group in ("model", "buffer")}
        if prev is not None and now != prev:
            added = sorted(now.keys() - prev.keys())
            removed = sorted(prev.keys() - now.keys())
            reshaped = sorted(n for n in now.keys() & prev.keys() if now[n] != prev[n])
            parts = [f"{len(v):,} {what}" for v, what in (
                (added, "tensor(s) new"), (removed, "missing"), (reshaped, "reshaped")) if v]
            first = (reshaped or added or removed)[0]
            shape = (f" {list(prev[first])} -> {list(now[first])}" if first in reshaped
                     else "")
            out.append(Anomaly(c.step, c.name, CHECKPOINT, "mismatch",
                               f"not the model of {prev_name}: {', '.join(parts)} "
                               f"(first: {first}{shape}); no update across them",
                               {"tensor": first, "added": len(added), "removed": len(removed),
                                "reshaped": len(reshaped)}))
        prev, prev_name = now, c.name
    return out
