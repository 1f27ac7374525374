"""The options of :func:`ckpt_cli.ops.plan.plan`: :class:`PlanOptions`, declared in
:mod:`ckpt_cli.ops.options.plan` (a light module ``ckpt plan`` builds its flags from)."""

from __future__ import annotations

from ckpt_cli.ops.options.plan import PlanOptions as PlanOptions

__all__ = ["PlanOptions"]
