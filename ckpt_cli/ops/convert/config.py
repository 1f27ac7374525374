"""``convert``'s side files: ``config.json`` and the tokenizer's, copied beside the output,
the config's dtype rewritten to the output's; and which tensors ``--keep-fp32`` kept."""

from __future__ import annotations

import fnmatch
import json
import re
from pathlib import Path
from typing import Any

from ckpt_cli import dtypes, storage
from ckpt_cli.errors import CkptError
from ckpt_cli.model import CheckpointIndex
from ckpt_cli.writers import FILE_SUFFIXES, SIDE_FILES, OutTensor


def kept_fp32(outs: list[OutTensor], globs: tuple[str, ...],
               notes: list[str]) -> dict[str, list[str]]:
    """Each ``--keep-fp32`` glob and the FP32 output tensors it matched (a glob that matched
    none gets a note: a typo would otherwise go unnoticed)."""
    out: dict[str, list[str]] = {}
    for g in globs:
        out[g] = [o.name for o in outs if o.dtype == "F32" and fnmatch.fnmatchcase(o.name, g)]
        if not out[g]:
            notes.append(f"`keep_fp32` {g!r} matched no tensor of the output")
    return out


def side_files(index: CheckpointIndex, given: Path, out: Path,
                notes: list[str]) -> dict[str, bytes]:
    """config.json, tokenizer files...: from the directory the user named (an HF Trainer +
    DeepSpeed ``checkpoint-N`` keeps them beside ``latest`` and ``global_stepN/``), else
    from the directory the weights were read in."""
    if out.suffix.lower() in FILE_SUFFIXES:
        return {}
    dirs = [d for d in dict.fromkeys((given, index.base)) if d.is_dir()]
    found: dict[str, bytes] = {}
    for name in SIDE_FILES:
        for d in dirs:
            p = d / name
            if p.is_file() and p.stat().st_size < 64 << 20:
                data = storage.read_side(p, "json-state")
                if data is not None:
                    if name == "config.json":
                        # rewritten below (dtype, quantization_config): its nesting must be
                        # bounded before anything walks it
                        storage.parse_json(data, what="the JSON", path=p)
                    found[name] = data
                    break
    if found:
        notes.append(f"copied {', '.join(sorted(found))}")
    return found


def json_object(data: bytes | None) -> dict[str, Any] | None:
    """A side file's JSON object (None: absent, not JSON, or not an object), through the one
    bounded JSON parser."""
    if data is None:
        return None
    try:
        doc = storage.parse_json(data, what="config.json", path=None)
    except CkptError:
        return None
    return doc if isinstance(doc, dict) else None


_DTYPE_KEYS = ("dtype", "torch_dtype")  # transformers 4.56+ writes "dtype", older "torch_dtype"
_FLOAT_NAMES = ("float64", "float32", "float16", "bfloat16", "float", "double", "half")
_DTYPE_VALUE = re.compile(rb'("(?:torch_)?dtype"\s*:\s*)"(?:' + b"|".join(
    n.encode() for n in _FLOAT_NAMES) + rb')"')


def retype_config(data: bytes, target: str) -> tuple[bytes, dict[str, Any] | None]:
    """Make a copied ``config.json`` name the dtype its weights were cast to.

    ``from_pretrained`` loads weights in the dtype the config names (``"dtype"``, or the older
    ``"torch_dtype"``): left at ``float32`` after ``--to fp16``, the FP16 weights would load as
    FP32. Every such key holding a floating dtype is rewritten, at the top level and in nested
    sub-configs (``text_config``...), but not inside ``quantization_config``. Only those
    values change: the rest of the text (key order, spacing, other values) stays byte for byte
    when the file's layout allows, and otherwise its meaning does (re-serialized in order).

    Args:
        data: The file's bytes.
        target: The dtype code the floating weights were cast to (``F16``, ``BF16``, ``F32``).

    Returns:
        The bytes to write, and ``{file, keys, from, to}`` when anything changed (None when
        the file names no floating dtype, already names ``target``'s, or is not a JSON object).
    """
    name = dtypes.get(target).torch_name
    assert name is not None
    try:
        doc = storage.parse_json(data, what="config.json", path=None)  # nesting bounded
    except CkptError:
        return data, None
    if not isinstance(doc, dict):
        return data, None
    changed: dict[str, str] = {}

    def walk(obj: dict[str, Any], path: str) -> None:
        for key, value in obj.items():
            if key in _DTYPE_KEYS and isinstance(value, str) and value in _FLOAT_NAMES:
                if value != name:
                    obj[key] = name
                    changed[path + key] = value
            elif isinstance(value, dict) and key != "quantization_config":
                walk(value, f"{path}{key}.")

    walk(doc, "")
    if not changed:
        return data, None
    new = _DTYPE_VALUE.sub(lambda m: m.group(1) + b'"' + name.encode() + b'"', data)
    try:
        same = json.loads(new) == doc
    except ValueError:
        same = False
    if not same:  # a dtype key in quantization_config, a string holding one: write it anew
        new = (json.dumps(doc, indent=2, ensure_ascii=False) + "\n").encode()
    first = next(iter(changed.values()))
    return new, {"file": "config.json", "keys": list(changed), "from": first, "to": name}
