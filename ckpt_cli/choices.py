"""The enumerated values the API's keywords take, as ``Literal`` aliases, so that a type
checker refuses ``convert(src, out, to="fp12")`` before it runs. Each alias lists the same
values as the tuple or table the op checks at run time (``tests/api/test_types.py`` keeps them
equal); the ops still check every value, for callers without a type checker."""

from __future__ import annotations

from typing import Literal

InputFormat = Literal["safetensors", "hf-index", "torch", "dcp", "deepspeed", "megatron", "dir"]
"""``input_format``: skip detection and read the input as this format."""

OutputFormat = Literal["safetensors", "pt"]
"""``format`` of ``convert``/``consolidate``: the file format written."""

CastTarget = Literal["fp16", "bf16", "fp32", "keep"]
"""``to`` of ``consolidate``: the floating dtype written (``keep``: as stored)."""

ConvertTarget = Literal["fp16", "bf16", "fp32", "fp8", "keep", "dcp"]
"""``to`` of ``convert``: ``CastTarget``, ``fp8`` (weight-only FP8 E4M3 with scales) or ``dcp``
(the training state as a torch.distributed.checkpoint directory)."""

DcpLayout = Literal["torchtitan", "recipe"]
"""``dcp_layout`` of ``convert --to dcp``: torchtitan's top-level keys or the DCP recipe's."""

Fp8Layout = Literal["block", "channel", "tensor"]
"""``fp8_layout`` of ``convert --to fp8``: one scale per 128x128 block, per row or per tensor."""

Fp8Activations = Literal["dynamic", "none"]
"""``fp8_activations``: what the written config tells engines to do with activations."""

ManifestHash = Literal["xxh3_128", "blake3", "sha256"]
"""``manifest_hash`` of ``validate``: the checksum a manifest records."""

InspectSort = Literal["name", "size"]
"""``sort`` of ``inspect``: file order, or largest first."""

MetricMode = Literal["min", "max"]
"""``mode`` of ``prune``: whether a smaller or a larger ``metric`` is better."""

ThinDtype = Literal["bf16"]
"""``thin_to``: the dtype thinned checkpoints' weights are cast to."""

Precision = Literal["fp32", "bf16", "mixed"]
"""``precision`` of ``plan``: how the model trains."""

Optimizer = Literal["adam", "adamw", "sgd", "adafactor"]
"""``optimizer`` of ``plan``: what its state weighs per parameter."""

__all__ = ["CastTarget", "ConvertTarget", "DcpLayout", "Fp8Activations", "Fp8Layout", "InputFormat",
           "InspectSort", "ManifestHash", "MetricMode", "Optimizer", "OutputFormat", "Precision",
           "ThinDtype"]
