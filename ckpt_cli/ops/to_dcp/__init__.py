"""``ckpt convert SRC --to dcp``: a run's training state (weights, optimizer moments, LR
schedule, step, RNG) moved into a torch.distributed.checkpoint directory (issue 48).

Each source framework is read into one :class:`~ckpt_cli.ops.to_dcp.state.TrainingState`
(``state.py``); one writer turns that into DCP. Nothing here runs code from a checkpoint.
"""
