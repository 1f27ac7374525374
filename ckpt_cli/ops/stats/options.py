"""What ``ckpt stats`` computes: :class:`StatsOptions`, declared in
:mod:`ckpt_cli.ops.options.stats` and re-exported here."""

from __future__ import annotations

from ckpt_cli.ops.options.stats import DEFAULT_JUMP as DEFAULT_JUMP
from ckpt_cli.ops.options.stats import StatsOptions as StatsOptions
