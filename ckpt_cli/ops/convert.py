"""``convert``: training -> inference, FP32 -> FP16/BF16, torch -> safetensors.

From any checkpoint the readers know, keep the model weights and buffers (found inside the
usual containers, with wrapper prefixes stripped), drop optimizer state, schedulers and RNG
state, cast floating tensors, and write safetensors (or a torch zip), sharded HF-style when
asked. Values stream one tensor at a time (a large tensor in pieces, so memory stays within a
fixed budget) through a cast that checks FP16's range across the whole tensor; the output
appears only when complete.
"""

from __future__ import annotations

import fnmatch
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from ckpt_cli.atomic import check_not_input
from ckpt_cli.cast import FP16_MAX, CastStats, cast_array, check_overflow, prefer_torch
from ckpt_cli.errors import UnsupportedError, UsageError
from ckpt_cli.formats import check_exists, read_index
from ckpt_cli.formats.base import refuse_damaged
from ckpt_cli.formats.containers import MODEL_KEYS
from ckpt_cli.model import CheckpointIndex, Finding, TensorInfo
from ckpt_cli.results import ConvertResult
from ckpt_cli.runs import follow_pointer, is_run_dir
from ckpt_cli.tensors import TensorSource
from ckpt_cli.writers import SIDE_FILES, OutTensor, output_format, write_checkpoint

if TYPE_CHECKING:
    import numpy as np

TARGETS = {"fp16": "F16", "bf16": "BF16", "fp32": "F32", "keep": None}
WRAPPERS = ("module.", "_orig_mod.")
_CASTABLE = {"F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ",
             "F8_E8M0"}


@dataclass(frozen=True, slots=True)
class Selection:
    """Which source tensors become which output names."""

    names: dict[str, str]  # output name -> source tensor name
    renamed: list[str]
    dropped: dict[str, int]
    notes: list[str]


def convert(source: str | Path, output: str | Path, *, to: str = "keep",
            fmt: str | None = None, max_shard_size: int | None = None,
            keep_optimizer: bool = False, keep_prefix: bool = False,
            keep_fp32: tuple[str, ...] = (), clamp: bool = False, overwrite: bool = False,
            container: str | None = None, input_format: str | None = None,
            on_progress: Callable[[int], None] | None = None,
            on_start: Callable[[int], None] | None = None) -> ConvertResult:
    """Convert a checkpoint.

    Args:
        source: Any checkpoint the readers know, or a run directory whose ``latest`` (or
            Megatron tracker) pointer names the checkpoint to read.
        output: A ``.safetensors``/``.pt``/``.bin`` file, or a directory for
            ``model.safetensors`` or HF-style shards + index.
        to: ``fp16``, ``bf16``, ``fp32`` or ``keep``: cast of floating-point model tensors.
        fmt: ``safetensors`` or ``pt``; None infers it from ``output``'s suffix.
        max_shard_size: Largest output shard in bytes (None: one file).
        keep_optimizer: Keep every tensor (optimizer state included) under its own name: a
            pure format change. Non-tensor values go to ``__metadata__["ckpt.objects"]``.
        keep_prefix: Keep wrapper prefixes (``module.``, ``_orig_mod.``).
        keep_fp32: Globs of tensor names kept in (or cast to) FP32.
        clamp: Clamp values beyond FP16's range instead of refusing.
        overwrite: Replace an existing output.
        container: Which top-level container holds the weights when there are several.
        input_format: Force the input format.
        on_progress: Called with bytes written.
        on_start: Called once with the total bytes to write.

    Returns:
        The :class:`ConvertResult`.

    Raises:
        CkptError: Bad input, unsupported layouts, existing output, values out of FP16 range.
    """
    t0 = time.perf_counter()
    src, out = Path(source), Path(output)
    check_exists(src)
    if to not in TARGETS:
        raise UsageError(f"--to must be fp16, bf16, fp32 or keep, not {to!r}")
    fmt = output_format(out, fmt)
    followed = follow_pointer(src) if input_format is None else None
    if followed is not None:
        src = followed.path
    elif input_format is None and is_run_dir(src):
        raise UsageError(f"{src} is a run directory; name one of its checkpoints",
                         hint=f"ckpt inspect {src} lists them")
    check_not_input(out, src)
    index = read_index(src, input_format)
    check_not_input(out, src, (index.path_of(f.path) for f in index.files))
    _check_supported(index)
    try:
        sel = select_tensors(index, keep_optimizer=keep_optimizer, keep_prefix=keep_prefix,
                             container=container)
    except UsageError:
        # Damage that left nothing to select explains the empty selection better.
        refuse_damaged(index, (), also_files=(f.path for f in index.files))
        raise
    refuse_damaged(index, sel.names.values())
    target = TARGETS[to]
    stats = CastStats()
    aliases, order = _dedupe_tied(index, sel)
    casts: Counter[str] = Counter()
    outs: list[OutTensor] = []
    source_reader = TensorSource(index)
    for out_name in order:
        t = index.tensors[sel.names[out_name]]
        dst = _target_dtype(t, out_name, target, keep_fp32, keep_optimizer)
        if dst != t.dtype:
            casts[f"{t.dtype}->{dst}"] += 1
        # A cast reads every value once: map the file rather than copy it (as _loader does).
        pieces_of = partial(source_reader.iter_pieces, mapped=dst != t.dtype)
        outs.append(OutTensor(out_name, dst, t.shape,
                              _loader(source_reader, t, dst, out_name, clamp, stats),
                              piece_caster(pieces_of, t, dst, out_name, clamp, stats)))
    meta = _metadata(index, src, to, sel, keep_optimizer, fmt)
    if keep_optimizer and fmt == "safetensors" and index.objects:
        meta["ckpt.objects"] = orjson.dumps(index.objects, default=str).decode()
    notes = list(sel.notes)
    side = _side_files(index, out, notes)
    prefer_torch(sum(index.tensors[sel.names[o.name]].numel for o in outs
                     if o.dtype != index.tensors[sel.names[o.name]].dtype))
    if on_start:
        on_start(sum(o.nbytes for o in outs))
    try:
        result = write_checkpoint(out, outs, fmt=fmt, max_shard_size=max_shard_size,
                                  metadata=meta, aliases=aliases, overwrite=overwrite,
                                  side_files=side, on_progress=on_progress,
                                  before_commit=lambda _tmp: check_overflow(stats, clamp))
    finally:
        source_reader.close()
    if clamp and stats.overflow:
        notes.append(f"clamped {sum(stats.overflow.values()):,} value(s) beyond FP16's range "
                     f"to ±{FP16_MAX:g} in {len(stats.overflow)} tensor(s)")
    return ConvertResult(Path(source), index.format, out, result,
                         {o.name: (o.dtype, o.shape) for o in outs}, sel.renamed, sel.dropped,
                         dict(casts), aliases, dict(stats.overflow), clamp, meta, notes,
                         time.perf_counter() - t0, hostile_warnings(index),
                         followed)


def hostile_warnings(index: CheckpointIndex) -> list[Finding]:
    """One ``hostile-source`` warning per source file whose pickles name globals that run
    code under ``torch.load(weights_only=False)``, or that is a TorchScript archive.

    ckpt ran none of it (the tensors come from the inert pickle records), but whoever made
    the file meant it to run: the user should know, whatever the output looks like.

    Args:
        index: The source's index (its readers' findings).

    Returns:
        The warnings, by file.
    """
    named: dict[str | None, list[str]] = {}
    script: set[str | None] = set()
    for f in index.findings:
        if f.code == "unsafe-global" and f.location:
            named.setdefault(f.file, []).append(f.location)
        elif f.code == "torchscript-archive":
            script.add(f.file)
            named.setdefault(f.file, [])
    return [hostile_warning(index.path_of(rel) if rel else index.root, sorted(set(quals)),
                            torchscript=rel in script, rel=rel)
            for rel, quals in named.items()]


def hostile_warning(path: Path, qualnames: list[str], *, torchscript: bool = False,
                    rel: str | None = None) -> Finding:
    """The ``hostile-source`` warning for one source file.

    Args:
        path: The file, as shown to the user.
        qualnames: The dangerous globals its pickles name.
        torchscript: Whether it is a TorchScript archive.
        rel: The file as the index names it.

    Returns:
        The warning.
    """
    what = " and ".join(x for x in (
        "is a TorchScript archive (torch.load would run its code)" if torchscript else "",
        f"references {', '.join(qualnames)}" if qualnames else "") if x)
    return Finding("warning", "hostile-source",
                   f"{path} {what}; its tensors were extracted without running it; treat the "
                   "source as hostile", rel, ", ".join(qualnames) or None)


def _check_supported(index: CheckpointIndex) -> None:
    if index.format == "deepspeed":
        raise UnsupportedError(
            "DeepSpeed ZeRO checkpoints keep the full-precision weights partitioned in the "
            "optimizer files", path=index.root,
            hint=f"ckpt consolidate {index.root} -o OUT rebuilds them")
    if index.format == "megatron" and index.layout.get("world_size", 1) > 1:
        raise UnsupportedError(
            f"Megatron checkpoint split over {index.layout['world_size']} model-parallel "
            "ranks; merging tensor/pipeline-parallel shards is not supported", path=index.root)


def select_tensors(index: CheckpointIndex, *, keep_optimizer: bool = False,
                   keep_prefix: bool = False, container: str | None = None) -> Selection:
    """Choose the tensors to write and their output names.

    The model's weights are found inside the usual containers (``model``, ``state_dict``,
    ``module``...) and that container prefix is removed; then wrapper prefixes that every name
    carries (``module.`` from DDP, ``_orig_mod.`` from torch.compile) are removed unless
    ``keep_prefix``. Optimizer state, schedulers and RNG state are dropped.

    Args:
        index: The source checkpoint.
        keep_optimizer: Keep everything under the original names.
        keep_prefix: Keep wrapper prefixes.
        container: The container to take weights from, when there are several.

    Returns:
        The :class:`Selection`.

    Raises:
        UsageError: No model weights, an unknown ``container``, or names that collide.
    """
    if keep_optimizer:
        _refuse_other_kinds(index.tensors.values())
        names = {n: n for n in index.tensors}
        _refuse_duplicate_names(index, names)
        return Selection(names, [], _count_dropped(index, set(names.values())), [])
    model = [t for t in index.tensors.values() if t.group in ("model", "buffer")]
    if not model:
        raise UsageError(f"{index.root}: no model weights found (groups: "
                         f"{_group_summary(index)})")
    notes: list[str] = []
    renamed: list[str] = []
    prefixes = [c for c, g in index.containers.items() if g == "model"]
    # Weights outside every container ({"encoder": {...}, "head.weight": ...}) mean the
    # containers are parts of one model, not alternatives: keep every name whole. Scalars
    # beside a state dict ({"model_state_dict": ..., "loss": tensor(0.3)}, a tensor `step`)
    # are bookkeeping, not weights.
    inside = set(prefixes)
    loose = [] if container or not prefixes else [
        t.name for t in model if t.shape and not _in_container(t.name, inside)]
    chosen = "" if loose else _choose_container(prefixes, container, notes)
    if loose:
        notes.append(f"weights both inside {', '.join(p.rstrip('.') for p in prefixes)} and "
                     f"outside (e.g. {loose[0]!r}); kept every name whole (--container takes "
                     "one container)")
    if chosen:
        model = [t for t in model if t.name.startswith(chosen)]
        renamed.append(f"removed container prefix {chosen!r}")
    names = {t.name: t.name.removeprefix(chosen) if chosen else t.name for t in model}
    if not keep_prefix:
        # Wrappers nest in any order (torch.compile of DDP: "_orig_mod.module.").
        stripped = True
        while stripped and names:
            stripped = False
            for wrapper in WRAPPERS:
                if all(v.startswith(wrapper) for v in names.values()):
                    names = {k: v.removeprefix(wrapper) for k, v in names.items()}
                    renamed.append(f"removed wrapper prefix {wrapper!r}")
                    stripped = True
    _refuse_duplicate_names(index, names)
    _refuse_other_kinds(index.tensors[n] for n in names)
    out: dict[str, str] = {}
    for src_name, out_name in names.items():
        if out_name in out:
            raise UsageError(f"{out[out_name]!r} and {src_name!r} both become {out_name!r}; "
                             "use --keep-prefix or --container")
        out[out_name] = src_name
    return Selection(out, renamed, _count_dropped(index, set(out.values())), notes)


def _in_container(name: str, prefixes: set[str]) -> bool:
    """Whether ``name`` starts with one of ``prefixes`` (each ends in a dot)."""
    return any(name[:i + 1] in prefixes for i, ch in enumerate(name) if ch == ".")


def _refuse_other_kinds(tensors: Iterable[TensorInfo]) -> None:
    """Refuse rather than drop tensors ckpt cannot write: meta (no data), quantized, sparse,
    nested and subclass tensors. A model missing them would load with holes."""
    other = [t for t in tensors if t.kind != "dense"]
    if other:
        listed = ", ".join(f"{t.name} ({t.kind})" for t in other[:5])
        more = f" and {len(other) - 5} more" if len(other) > 5 else ""
        raise UnsupportedError(f"{len(other)} tensor(s) ckpt cannot convert: {listed}{more}; "
                               "nothing written (ckpt converts dense tensors only)")


def _refuse_duplicate_names(index: CheckpointIndex, names: dict[str, str]) -> None:
    """Refuse tensors the reader had to rename (``l2.w#2``): two tensors share a name."""
    clash = [n for n in names if n in index.duplicates]
    if clash:
        several = len(index.files) > 1
        raise UsageError(f"{len(clash)} tensor name(s) occur twice in {index.root} (first: "
                         f"{index.duplicates[clash[0]]!r}); ckpt will not make up output names",
                         hint="convert its files one at a time" if several else None)


def _choose_container(prefixes: list[str], wanted: str | None, notes: list[str]) -> str:
    if wanted:
        want = wanted.rstrip(".") + "."
        if want not in prefixes:
            raise UsageError(f"--container {wanted!r} not found; model containers here: "
                             f"{', '.join(p.rstrip('.') for p in prefixes) or 'none'}")
        return want
    if len(prefixes) <= 1:
        return prefixes[0] if prefixes else ""
    rank = {k + ".": i for i, k in enumerate(MODEL_KEYS)}
    known = [p for p in prefixes if p in rank]
    if not known:
        # {"encoder": {...}, "decoder": {...}}, or a pickled module's submodules: parts of one
        # model. Nothing is left out; names keep their container.
        notes.append(f"several model containers ({', '.join(p.rstrip('.') for p in prefixes)})"
                     "; kept them all under their full names (--container takes one)")
        return ""
    best = min(known, key=lambda p: rank[p])
    others = ", ".join(p.rstrip(".") for p in prefixes if p != best)
    notes.append(f"several model containers; took {best.rstrip('.')!r}, left out {others} "
                 "(choose with --container)")
    return best


def _count_dropped(index: CheckpointIndex, kept: set[str]) -> dict[str, int]:
    dropped: Counter[str] = Counter(t.group for n, t in index.tensors.items() if n not in kept)
    return dict(dropped)


def _group_summary(index: CheckpointIndex) -> str:
    c = Counter(t.group for t in index.tensors.values())
    return ", ".join(f"{g} {n}" for g, n in sorted(c.items())) or "no tensors"


def _dedupe_tied(index: CheckpointIndex, sel: Selection) -> tuple[dict[str, str], list[str]]:
    """Tied tensors (one storage, identical view) are written once; the rest become aliases.

    The first name in checkpoint order is kept (the embedding, typically, whose output head
    alias transformers re-ties on load) and ``{alias: kept}`` recorded.
    """
    first: dict[tuple[Any, ...], str] = {}
    aliases: dict[str, str] = {}
    order: list[str] = []
    for out_name, src_name in sel.names.items():
        t = index.tensors[src_name]
        if t.storage is not None:
            key = (t.storage.file, t.storage.key, t.storage_offset, t.shape, t.stride, t.dtype)
            if key in first:
                aliases[out_name] = first[key]
                continue
            first[key] = out_name
        order.append(out_name)
    return aliases, order


def _target_dtype(t: TensorInfo, name: str, target: str | None, keep_fp32: tuple[str, ...],
                  keep_optimizer: bool) -> str:
    if t.dtype not in _CASTABLE or (keep_optimizer and t.group not in ("model", "buffer")):
        return t.dtype
    if any(fnmatch.fnmatchcase(name, g) for g in keep_fp32):
        return "F32"
    return target or t.dtype


def _loader(src: TensorSource, t: TensorInfo, dst: str, name: str, clamp: bool,
            stats: CastStats) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        if dst == t.dtype:
            return src.read(t)
        # The cast reads every value once: map the file instead of copying it first.
        return cast_array(src.read(t, mapped=True), dst, name=name, clamp=clamp, stats=stats)
    return load


def piece_caster(pieces_of: Callable[[Any], Iterator[np.ndarray]], t: Any, dst: str,
                 name: str, clamp: bool, stats: CastStats) -> Callable[[], Iterator[np.ndarray]]:
    """Like :func:`_loader`, piece by piece: a tensor of several GB never sits in memory whole
    (it holds the source piece, or the one buffer a whole-read layout needs, and one cast
    piece). Overflow counts add up in ``stats`` across the pieces; the refusal comes before
    the output is renamed into place.

    Args:
        pieces_of: Yields the source pieces of a tensor (``TensorSource.iter_pieces``...).
        t: The source tensor (its ``dtype`` says whether to cast).
        dst: The dtype to write.
        name: The tensor's name in messages.
        clamp: Clamp FP16 overflow instead of refusing it.
        stats: Where overflow is counted.

    Returns:
        A function yielding the pieces to write.
    """
    def pieces() -> Iterator[np.ndarray]:
        for piece in pieces_of(t):
            yield piece if dst == t.dtype else cast_array(piece, dst, name=name, clamp=clamp,
                                                          stats=stats)
            del piece
    return pieces


def _metadata(index: CheckpointIndex, src: Path, to: str, sel: Selection,
              keep_optimizer: bool, fmt: str) -> dict[str, str]:
    steps = [f"to={to}"]
    if not keep_optimizer:
        dropped = ", ".join(f"{g} {n}" for g, n in sorted(sel.dropped.items()) if n)
        steps.append(f"dropped: {dropped or 'nothing'}")
    steps.extend(sel.renamed)
    meta = {"ckpt.source": str(src.resolve()), "ckpt.source_format": index.format,
            "ckpt.conversion": "; ".join(steps)}
    for key in ("step", "epoch"):
        if key in index.metadata:
            meta[f"ckpt.{key}"] = str(index.metadata[key])
    return meta


def _side_files(index: CheckpointIndex, out: Path, notes: list[str]) -> dict[str, bytes]:
    if out.suffix in (".safetensors", ".pt", ".pth", ".bin") or not index.base.is_dir():
        return {}
    found: dict[str, bytes] = {}
    for name in SIDE_FILES:
        p = index.base / name
        if p.is_file() and p.stat().st_size < 64 << 20:
            found[name] = p.read_bytes()
    if found:
        notes.append(f"copied {', '.join(sorted(found))}")
    return found
