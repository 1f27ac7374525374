"""The options of ``ckpt prune`` (:func:`ckpt_cli.ops.prune.prune`): :class:`PrunePolicy`,
the retention rules (``ckpt watch`` retains by them too), and :class:`PruneOptions`, the
policy plus where to look; each field the one declaration of a ``ckpt prune`` flag and a
``ckpt_cli.prune()`` keyword (light: ``ckpt prune --help`` builds its flags from them)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ckpt_cli.choices import MetricMode, ThinDtype
from ckpt_cli.errors import UsageError
from ckpt_cli.ops.options import common
from ckpt_cli.optionspec import option

DEFAULT_GRACE = 600.0
"""Seconds: a checkpoint touched more recently than this may still be being written."""

# Retention rules, in the order reports list them.
RULES = ("keep", "keep-every", "keep-best", "older-than", "max-total-size")


@dataclass(frozen=True, slots=True)
class PrunePolicy:
    """What to keep. Rules combine: a checkpoint is kept if any of them keeps it. Counts,
    sizes (bytes) and ages (seconds) are numbers here; the command line and the API also
    take them as text (``10K``, ``2TB``, ``7d``).

    A ``grace`` of 0 turns that protection off (markers, locks and pointers still protect);
    thinning (``thin_after``, :mod:`ckpt_cli.trust.thinning`) rewrites what stays beyond the
    newest N counted checkpoints without optimizer state.
    """

    keep: int | None = option(None, metavar="N", help=(
        "Keep the newest N complete (and, with a run ledger, verified) checkpoints; others "
        "newer than the N-th of them are kept but not counted."))
    keep_every: int | None = option(None, metavar="STEPS", kind="count", help=(
        "Keep milestones: checkpoints whose step is a multiple of STEPS (e.g. 10K)."))
    keep_best: int | None = option(None, metavar="N",
                                   help="Keep the N best checkpoints by `metric`.")
    metric: str | None = option(None, metavar="NAME", help=(
        "Metric for `keep_best` (eval_loss, val_loss...): from trainer_state.json, Lightning "
        "file names or `metrics_file`."))
    mode: MetricMode = option("min", metavar="min|max", help=(
        "Whether lower (min) or higher (max) `metric` values are better."))
    older_than: float | None = option(None, metavar="AGE", kind="duration", help=(
        "Keep checkpoints modified within AGE (e.g. 7d); older ones may go."))
    max_total_size: int | None = option(None, metavar="SIZE", kind="size", help=(
        "Keep the newest checkpoints that fit in SIZE together (e.g. 2TB); older ones may "
        "go."))
    grace: float = option(DEFAULT_GRACE, metavar="AGE", kind="duration", allow_zero=True,
                          help=(
        "Never delete anything changed within AGE: it may still be being written (0 turns "
        "this off)."))
    thin_after: int | None = common.thin_after()
    thin_to: ThinDtype | None = common.thin_to()
    keep_full_every: int | None = common.keep_full_every()
    keep_abandoned: bool = common.keep_abandoned()

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


@dataclass(frozen=True, slots=True)
class PruneOptions(PrunePolicy):
    """What ``ckpt prune`` is asked to do: the :class:`PrunePolicy`, where the metrics and the
    checkpoints are found, and which directories it may prune. (Whether it deletes is the
    call's ``dry_run``: the API plans unless told otherwise, the command line asks.)"""

    metrics_file: str | Path | None = option(None, metavar="FILE", kind="path", help=(
        "Metrics by step: CSV with a step column (Lightning CSVLogger), JSON lines, or JSON."))
    pattern: str | None = option(None, metavar="REGEX", help=(
        "Which entries are checkpoints, for unusual layouts (a 'step' group gives the step)."))
    any_dir: bool = option(False, help=(
        "Prune even /, $HOME or a directory that does not look like a run directory."))

    def check(self) -> None:
        """Reject options that cannot be meant (:meth:`PrunePolicy.check`, and more).

        Raises:
            UsageError: ``metrics_file`` without ``keep_best``, an empty ``metric`` or
                ``pattern`` (which would drop a rule or match everything), or what
                :meth:`PrunePolicy.check` refuses.
        """
        if self.metrics_file is not None and self.keep_best is None:
            raise UsageError("metrics_file only feeds keep_best; give keep_best N and "
                             "metric NAME too", param=("metrics_file", "keep_best", "metric"))
        for value, what in ((self.metric, "metric"), (self.pattern, "pattern")):
            if value is not None and not value.strip():
                raise UsageError(f"{what} {value!r} is empty", param=what)
        PrunePolicy.check(self)
