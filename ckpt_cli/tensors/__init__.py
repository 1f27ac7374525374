"""Tensor data, piece by piece: :mod:`~ckpt_cli.tensors.source` (``TensorSource``, the one façade
commands read tensor data through), :mod:`~ckpt_cli.tensors.cast` (dtype casts and ``CastPlan``)
and :mod:`~ckpt_cli.tensors.select` (which source tensors become which output names);
:mod:`~ckpt_cli.tensors.gather` rebuilds full tensors from DeepSpeed ZeRO partitions.

Nothing is imported here, so importing one of them loads only what it needs.
"""
