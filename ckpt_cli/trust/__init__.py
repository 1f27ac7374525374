"""Checkpoints you can trust: the run ledger and what writes and reads it.

- :mod:`~ckpt_cli.trust.ledger`: the run ledger ``ckpt-ledger.jsonl`` (one JSON line per verdict).
- :mod:`~ckpt_cli.trust.thinning`: rewrite old checkpoints in place without their optimizer
  state (``prune --thin-after``), one module per layout.

:func:`ckpt_cli.ops.resume.latest_verified` (resume-path's engine, an op) reads the ledger to
pick the checkpoint to resume from. Layering: ledger and thinning sit above formats/, tensors/
and writers/ and below ops/ (prune thins). ``ckpt watch``, which writes the ledger's verdicts,
is an op that drives ``validate`` and ``prune``: :mod:`ckpt_cli.ops.watch` (with ``wake`` and
``hooks`` beside it).
Nothing is imported here, so importing one of them loads only what it needs.
"""
