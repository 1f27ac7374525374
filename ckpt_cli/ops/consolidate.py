"""``consolidate``: many rank files -> few files.

Sources:

* torch.distributed.checkpoint directories (FSDP/FSDP2/DTensor): every tensor assembled from
  its chunks into its global shape, one tensor at a time;
* DeepSpeed ZeRO 1/2/3 tag (or save) directories: full FP32 weights gathered from the flat
  per-rank partitions with positioned reads (:mod:`ckpt_cli.formats.zero`);
* a directory of per-rank torch/safetensors files holding disjoint keys: merged by key.

Output goes through the shared streaming writer (safetensors or torch zip, HF-style shards).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from ckpt_cli import storage
from ckpt_cli.documents import Documented
from ckpt_cli.errors import CkptError, CorruptCheckpointError, UnsupportedError, UsageError
from ckpt_cli.formats import check_exists, dcp, deepspeed, hf_index, read_index
from ckpt_cli.formats.base import refuse_damaged
from ckpt_cli.formats.directory import checkpoint_files
from ckpt_cli.formats.megatron import MegatronReader
from ckpt_cli.formats.provenance import source_label
from ckpt_cli.formats.zero import resolve_tag
from ckpt_cli.manifest import Manifest, hash_files, manifest_path, write_manifest
from ckpt_cli.manifest import checkpoint_files as manifest_files
from ckpt_cli.model import CheckpointIndex, Finding, WrittenFile
from ckpt_cli.ops import options_of

# Declared in a light module (``ckpt consolidate --help`` builds its flags from it); re-exported.
from ckpt_cli.ops.options.consolidate import DEFAULT_MAX_SHARD as DEFAULT_MAX_SHARD
from ckpt_cli.ops.options.consolidate import ConsolidateOptions as ConsolidateOptions
from ckpt_cli.optionspec import Caller, word
from ckpt_cli.parts import Part, source_identity
from ckpt_cli.progress import Progress, Tally
from ckpt_cli.resolve import resolve
from ckpt_cli.runs import (
    PointerError,
    read_pointer,
    tree_stats,
)
from ckpt_cli.storage.atomic import check_not_input
from ckpt_cli.storage.reads import memory_budget
from ckpt_cli.tensors.cast import (
    CASTABLE,
    TARGETS,
    CastPlan,
    CastStats,
    check_overflow,
    choice,
    piece_caster,
    prefer_torch,
    target_name,
    torch_speeds_up,
)
from ckpt_cli.tensors.gather import cast_loader, zero_metadata, zero_outputs
from ckpt_cli.tensors.select import Selection, hostile_warning, hostile_warnings, select_tensors
from ckpt_cli.tensors.source import TensorSource, split_pieces
from ckpt_cli.units import natural_key
from ckpt_cli.writers import (
    FILE_SUFFIXES,
    OutTensor,
    check_output,
    names_directory,
    output_format,
    write_checkpoint,
)
from ckpt_cli.writers.parts import PartJob

if TYPE_CHECKING:
    import numpy as np

    from ckpt_cli.runs import Followed
    from ckpt_cli.writers import WriteResult

# -- the result ------------------------------------------------------------------------------------

@dataclass(slots=True)
class ConsolidateResult(Documented):
    """What ``consolidate`` did.

    Attributes:
        source: The input path.
        kind: ``dcp``, ``deepspeed``, ``hf-index`` or ``rank-files``.
        output: The output file or directory.
        write: Files written.
        files_before: Number of input files.
        bytes_before: Bytes of the input on disk.
        elements_in: Elements of the selected source tensors (padding excluded).
        elements_out: Elements written.
        tensors: Number of tensors written.
        aliases: Tied/shared tensors written once.
        dropped: Source tensors left out, per group.
        details: Facts about the source (world size, ZeRO stage, step...).
        verified: Tensors re-read from the output and compared with the source (``--verify``).
        notes: Remarks.
        seconds: Wall time.
        warnings: Source files whose pickles would run code under ``torch.load``.
        followed: The run directory's pointer followed to the checkpoint merged, if
            ``source`` was a run directory.
        kept: Quantized tensors (FP8...) ``--to`` left as they are, by dtype.
        kept_scales: Their scales, left as they are too, by dtype.
        caller: Whom ``to_dict()`` names options for in ``notes`` (kept neutral, between
            backticks): ``python`` (``with_optimizer``) or ``cli`` (``--with-optimizer``, set
            by ``ckpt consolidate``); see :func:`ckpt_cli.optionspec.word`.
    """

    source: Path
    kind: str
    output: Path
    write: WriteResult
    files_before: int
    bytes_before: int
    elements_in: int
    elements_out: int
    tensors: int
    aliases: dict[str, str]
    dropped: dict[str, int]
    details: dict[str, Any] = field(default_factory=dict)
    verified: int | None = None
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    warnings: list[Finding] = field(default_factory=list)
    followed: Followed | None = None
    kept: dict[str, int] = field(default_factory=dict)
    kept_scales: dict[str, int] = field(default_factory=dict)
    caller: Caller = "python"

    command = "consolidate"

    @property
    def lost_elements(self) -> int:
        """Selected source elements that did not reach the output (0 when all is well)."""
        return self.elements_in - self.elements_out

    def json_body(self) -> dict[str, Any]:
        """The ``consolidate --json`` document without ``schema_version`` and ``command``."""
        return {
            "source": str(self.source), "kind": self.kind, "output": str(self.output),
            "files_before": self.files_before, "bytes_before": self.bytes_before,
            "files_after": len(self.write.files),
            "bytes_after": sum(b for _, b in self.write.files),
            "num_tensors": self.tensors, "elements_in": self.elements_in,
            "elements_out": self.elements_out, "lost_elements": self.lost_elements,
            "aliases": self.aliases, "dropped": self.dropped, "details": self.details,
            "verified": self.verified, "kept": self.kept, "kept_scales": self.kept_scales,
            "notes": [word(n, self.caller) for n in self.notes],
            "seconds": round(self.seconds, 3),
            "warnings": [w.to_dict() for w in self.warnings],
            "followed": self.followed.to_dict() if self.followed else None,
            **self.write.document()}


# -- the op ----------------------------------------------------------------------------------------

@dataclass(slots=True)
class _Job:
    kind: str
    outs: list[OutTensor]
    expected: dict[str, Callable[[], np.ndarray]]
    elements_in: int
    aliases: dict[str, str]
    dropped: dict[str, int]
    metadata: dict[str, str]
    details: dict[str, Any]
    close: list[Callable[[], None]]
    notes: list[str]
    stats: CastStats = field(default_factory=CastStats)
    cast_elements: int = 0
    warnings: list[Finding] = field(default_factory=list)
    kept: Counter[str] = field(default_factory=Counter)
    kept_scales: Counter[str] = field(default_factory=Counter)


def detect_kind(path: Path) -> str:
    """``dcp``, ``deepspeed``, ``hf-index`` or ``rank-files``; raises when there is nothing
    to merge."""
    check_exists(path)
    if path.is_dir():
        if dcp.DCPReader().sniff(path) is None:
            return "dcp"
        has_index = hf_index.find_index(path) is not None
        pointer_error: CkptError | None = None
        if deepspeed.DeepSpeedReader().sniff(path) is None or (path / "latest").is_file():
            try:
                tag = resolve_tag(path)
                # HF Trainer + DeepSpeed saves ZeRO shards (FP32 master weights) beside a
                # 16-bit HF export with an index: the shards win when they hold the FP32
                # weights (optimizer partitions); otherwise (stage 0, partitions deleted) the
                # export is what there is.
                if not has_index or any(deepspeed.OPTIM_STATES.match(p.name)
                                        for p in tag.iterdir()):
                    return "deepspeed"
            except CkptError as e:
                with contextlib.suppress(PointerError):
                    named = read_pointer(path, "latest")
                    if named is not None and not (path / named).exists():
                        pointer_error = e  # `latest` names a tag that is gone
        if has_index:
            return "hf-index"  # shards of one state dict: the index says what belongs where
        if len(checkpoint_files(path)) > 1:
            return "rank-files"
        if pointer_error is not None:
            raise pointer_error
    rank_tag = deepspeed.zero3_rank_file(path) if path.is_file() else None
    if path.is_dir() and MegatronReader().sniff(path) is None:
        ranks = read_index(path).layout.get("world_size", 1)
        if isinstance(ranks, int) and ranks > 1:
            raise UnsupportedError(
                f"{path}: a Megatron checkpoint split over {ranks} tensor/pipeline-parallel "
                "ranks; neither consolidate nor convert merges such shards yet")
    raise UsageError(f"{path}: nothing to consolidate (expected a DCP directory, a DeepSpeed "
                     "checkpoint or a directory of per-rank files)",
                     hint=f"this is one rank's ZeRO-3 partition: ckpt consolidate {rank_tag} "
                          "-o OUT" if rank_tag is not None else
                     f"for a single checkpoint use: ckpt convert {path} -o OUT")


def consolidate(source: str | Path, output: str | Path,
                options: ConsolidateOptions | None = None, *,
                progress: Progress | None = None, **fields: Any) -> ConsolidateResult:
    """Merge a rank-sharded checkpoint into few large files.

    Args:
        source: DCP directory, DeepSpeed tag/save directory, or directory of per-rank files.
        output: Output file or directory (see :func:`ckpt_cli.writers.write_checkpoint`).
        options: What to do (:class:`ConsolidateOptions`; default: its defaults).
        progress: Called as bytes are written: ``("writing", bytes_done, bytes_total)``
            (:class:`ckpt_cli.progress.Progress`).
        **fields: :class:`ConsolidateOptions` fields, instead of ``options`` (see
            :func:`ckpt_cli.ops.options_of`).
    Returns:
        The :class:`ConsolidateResult`.

    Raises:
        CkptError: Bad or incomplete input (missing rank files, truncated chunks, mismatched
            world sizes), existing output, values outside FP16's range.
    """
    opts = options_of(ConsolidateOptions, options, fields)
    # The canonical name of a value given in any case or by dtype name; refused below if no
    # target.
    opts = dataclasses.replace(opts, to=target_name(opts.to))  # type: ignore[arg-type]
    fmt: str | None = opts.output_format
    t0 = time.perf_counter()
    src, out = storage.locate(source), storage.locate(output)
    if opts.to not in TARGETS:
        raise UsageError(f"to must be fp16, bf16, fp32 or keep, not {opts.to!r}", param="to")
    budget = memory_budget(opts.max_memory)  # a bad budget is a usage error before any work
    check_exists(src)
    # A run directory's resume pointer names the checkpoint (DeepSpeed's `latest` is also
    # followed by detect_kind for a save directory of one tag; Megatron's tracker only here).
    given = resolve(src)
    followed, src = given.followed, given.checkpoint()
    if opts.verify and not storage.can_rename_atomically(out):
        raise UsageError("verify re-reads the output before it is put in place, which an "
                         "object store's output cannot be yet", param="verify",
                         hint=f"compare afterwards instead: ckpt diff {src} {out}")
    kind = detect_kind(src)
    check_not_input(out, src)
    fmt = output_format(out, fmt, directory=names_directory(output))
    check_output(out, overwrite=opts.overwrite,
                 finishing=opts.part is not None or opts.finalize)
    target = TARGETS[opts.to]
    stats = CastStats()
    if kind == "deepspeed":
        job = _deepspeed_job(src, target, opts.with_optimizer, stats, opts.clamp)
    elif kind in ("dcp", "hf-index"):
        job = _index_job(kind, read_index(src, kind), target, opts.with_optimizer, fmt, stats,
                         opts.clamp)
    else:
        job = _rank_files_job(src, target, opts.with_optimizer, fmt, stats, opts.clamp)
    prefer_torch(job.cast_elements)
    files_before, bytes_before = _input_size(src, kind)
    checked: list[int] = []

    def check(tmp: Path) -> None:
        # Checked in place before the rename: a problem leaves no output behind.
        check_overflow(stats, opts.clamp)
        if opts.verify and split is None:
            checked.append(_verify(tmp, job))
        if (opts.manifest and tmp.is_dir() and split is None
                and storage.can_rename_atomically(tmp)):
            write_manifest(tmp)  # inside the directory, so it arrives with it

    split = None
    if opts.part is not None or opts.finalize:
        split = _part_job(opts.part, opts.finalize, src, kind, out, job, opts.verify,
                          opts.manifest, checked)
    tally = Tally.of(progress, "writing")
    try:
        write = write_checkpoint(out, job.outs, fmt=fmt, max_shard_size=opts.max_shard_size,
                                 metadata=job.metadata, aliases=job.aliases,
                                 overwrite=opts.overwrite,
                                 on_progress=tally.advance if tally else None,
                                 before_commit=check, on_start=tally.start if tally else None,
                                 part=split,
                                 max_memory=budget)
        complete = write.part is None or write.part.finalized_here
        if opts.manifest and complete and (out.is_file()
                                           or not storage.can_rename_atomically(out)):
            # A single file's manifest sits beside it. On object storage a directory's comes
            # after its index (the commit marker, written last of the set), so it covers it.
            write_manifest(out)
    finally:
        for close in job.close:
            close()
    if opts.manifest and complete:
        mpath = manifest_path(out)
        write.files.append(WrittenFile(mpath.name, mpath.stat().st_size))
    elements_out = sum(t.numel for t in job.outs)
    return ConsolidateResult(storage.locate(source), kind, out, write, files_before, bytes_before,
                             job.elements_in,
                             elements_out, len(job.outs), job.aliases, job.dropped, job.details,
                             sum(checked) if checked else None, job.notes,
                             time.perf_counter() - t0, job.warnings, followed, dict(job.kept),
                             dict(job.kept_scales))


def _part_job(part: Part | None, finalize: bool, src: Path, kind: str, out: Path, job: _Job,
              verify: bool, manifest: bool, checked: list[int]) -> PartJob:
    """Split the write: each part verifies and hashes the shards it wrote (the digests go
    into its receipt), and the finalizer builds the manifest from every receipt."""
    base = resolve_tag(src) if kind == "deepspeed" else src
    rels = manifest_files(base) if base.is_dir() else [base.name]
    source = source_identity(base if base.is_dir() else base.parent, rels)
    in_dir = out.suffix not in FILE_SUFFIXES  # a file's manifest sits beside it, made after

    def check_shard(path: Path, members: Sequence[int]) -> dict[str, Any]:
        info: dict[str, Any] = {}
        if verify:
            checked.append(_verify(path, job, [job.outs[i].name for i in members]))
            info["verified"] = checked[-1]
        if manifest and in_dir:
            info["digest"] = hash_files(path.parent, [path.name])[0][path.name].digest
        return info

    def on_finalize(staged: Path, receipts: dict[int, dict[str, Any]]) -> None:
        if verify:  # the whole output's count: every part verified its own shards
            checked[:] = [sum(info.get("verified", 0) for r in receipts.values()
                              for _, _, info in r["files"])]
        if not (manifest and in_dir):
            return
        m = Manifest()
        for receipt in receipts.values():
            for name, size, info in receipt["files"]:
                m.add(name, size, info["digest"])
        rest = [r for r in manifest_files(staged) if r not in m.files]
        for d in hash_files(staged, rest)[0].values():
            m.add(d.path, d.size, d.digest)
        write_manifest(staged, manifest=m)

    return PartJob(part, finalize, source, check_shard, on_finalize)


def _input_size(src: Path, kind: str) -> tuple[int, int]:
    path = resolve_tag(src) if kind == "deepspeed" else src
    size, files, _ = tree_stats(path)
    return files, size


def _cast_to(dst: str | None, dtype: str, floating: bool) -> str:
    return dst if dst and floating and dtype in CASTABLE else dtype


def _deepspeed_job(src: Path, target: str | None, with_optimizer: bool, stats: CastStats,
                   clamp: bool) -> _Job:
    zero = zero_outputs(src, lambda t, base: _cast_to(target, base, t.kind != "moment"),
                        stats, clamp, moments=with_optimizer)
    plan = zero.plan
    details = {"zero_stage": plan.stage, "world_size": plan.world_size, "step": plan.step,
               "tag": resolve_tag(src).name}
    meta = zero_metadata(plan, src, choice(target))
    notes = list(plan.notes) + ([] if with_optimizer else [
        "optimizer moments are not part of the output (`with_optimizer` keeps them)"])
    return _Job("deepspeed", zero.outs, zero.loads, sum(t.numel for t in plan.tensors),
                plan.aliases, {}, meta, details, [zero.reader.close], notes, stats,
                zero.cast_elements,
                [hostile_warning(p, quals) for p, quals in plan.unsafe.items()])


def _index_job(kind: str, index: CheckpointIndex, target: str | None, with_optimizer: bool,
               fmt: str, stats: CastStats, clamp: bool) -> _Job:
    sel: Selection = select_tensors(index, keep_optimizer=with_optimizer)
    _check_complete(index, list(sel.names.values()))
    src = TensorSource(index)
    outs: list[OutTensor] = []
    expected: dict[str, Callable[[], np.ndarray]] = {}
    casting = 0
    plan = CastPlan(target, _model_side(index, sel))
    for out_name, src_name in sel.names.items():
        t = index.tensors[src_name]
        model_side = t.group in ("model", "buffer")
        dst = plan.dtype(t.name, t.dtype) if model_side else t.dtype
        casting += t.numel if torch_speeds_up(t.dtype, dst) else 0
        load = cast_loader(src.read, t, dst, stats, clamp)
        outs.append(OutTensor(out_name, dst, t.shape, load,
                              piece_caster(src.iter_pieces, t, dst, t.name, clamp, stats)))
        expected[out_name] = load
    meta = {"ckpt.source": source_label(index.root), "ckpt.source_format": index.format,
            "ckpt.conversion": "; ".join([f"to={choice(target)}", *sel.renamed])}
    for key in ("step", "epoch"):
        if key in index.metadata:
            meta[f"ckpt.{key}"] = str(index.metadata[key])
    if with_optimizer and fmt == "safetensors" and index.objects:
        meta["ckpt.objects"] = orjson.dumps(index.objects, default=str).decode()
    details = {k: index.layout.get(k) for k in ("world_size", "files_per_rank")
               if index.layout.get(k) is not None}
    details["step"] = index.metadata.get("step")
    return _Job(kind, outs, expected, sum(index.tensors[s].numel for s in sel.names.values()),
                {}, sel.dropped, meta, details, [src.close], list(sel.notes), stats, casting,
                hostile_warnings(index), plan.kept, plan.kept_scales)


def _model_side(index: CheckpointIndex, sel: Selection) -> list[tuple[str, str]]:
    """``(name, dtype)`` of the selected model tensors and buffers (what ``--to`` casts)."""
    tensors = (index.tensors[n] for n in sel.names.values())
    return [(t.name, t.dtype) for t in tensors if t.group in ("model", "buffer")]


def _check_complete(index: CheckpointIndex, names: list[str]) -> None:
    """Refuse inputs whose chunks or files are missing, or whose chunks do not tile their
    tensors (the readers' findings): the output would silently lack data or hold garbage."""
    refuse_damaged(index, names)


def _rank_files_job(src: Path, target: str | None, with_optimizer: bool, fmt: str,
                    stats: CastStats, clamp: bool) -> _Job:
    files = sorted(checkpoint_files(src), key=lambda p: natural_key(p.name))
    outs: list[OutTensor] = []
    expected: dict[str, Callable[[], np.ndarray]] = {}
    owner: dict[str, Path] = {}
    dropped: dict[str, int] = {}
    closers: list[Callable[[], None]] = []
    elements = casting = 0
    warnings: list[Finding] = []
    kept: Counter[str] = Counter()
    kept_scales: Counter[str] = Counter()
    for f in files:
        index = read_index(f)
        warnings += hostile_warnings(index)
        sel = select_tensors(index, keep_optimizer=with_optimizer)
        _check_complete(index, list(sel.names.values()))
        for g, n in sel.dropped.items():
            dropped[g] = dropped.get(g, 0) + n
        reader = TensorSource(index)
        closers.append(reader.close)
        plan = CastPlan(target, _model_side(index, sel))
        for out_name, src_name in sel.names.items():
            if out_name in owner:
                raise CorruptCheckpointError(
                    f"{out_name!r} is in both {owner[out_name].name} and {f.name}: the rank files "
                    "do not hold disjoint pieces of one state dict", path=src)
            owner[out_name] = f
            t = index.tensors[src_name]
            dst = plan.dtype(t.name, t.dtype) if t.group in ("model", "buffer") else t.dtype
            casting += t.numel if torch_speeds_up(t.dtype, dst) else 0
            load = cast_loader(reader.read, t, dst, stats, clamp)
            outs.append(OutTensor(out_name, dst, t.shape, load,
                                  piece_caster(reader.iter_pieces, t, dst, t.name, clamp, stats)))
            expected[out_name] = load
            elements += t.numel
        kept += plan.kept
        kept_scales += plan.kept_scales
    meta = {"ckpt.source": source_label(src), "ckpt.source_format": "rank-files",
            "ckpt.conversion": f"merged {len(files)} files by key; to={choice(target)}"}
    return _Job("rank-files", outs, expected, elements, {}, dropped, meta,
                {"rank_files": len(files)}, closers, [], stats, casting, warnings, kept,
                kept_scales)


def _verify(out: Path, job: _Job, names: Sequence[str] | None = None) -> int:
    """Compare every written tensor (or those ``names``, the tensors of one shard ``out``),
    re-read from the output, with its source values (both piece by piece, so a tensor larger
    than memory can be verified)."""
    index = read_index(out)
    checked = 0
    wanted = None if names is None else set(names)
    with TensorSource(index) as reader:
        for o in job.outs:
            if wanted is not None and o.name not in wanted:
                continue
            t = index.tensors[o.name]
            want = o.pieces() if o.pieces is not None else split_pieces(job.expected[o.name]())
            if (t.shape != o.shape or t.dtype != o.dtype
                    or not _same_bytes(reader.iter_pieces(t), want)):
                raise CorruptCheckpointError(f"verification failed: {o.name} in the output "
                                             "differs from its source", path=out)
            checked += 1
    return checked


def _same_bytes(a: Iterator[np.ndarray], b: Iterator[np.ndarray]) -> bool:
    """Whether two streams of pieces hold the same bytes (piece boundaries may differ)."""
    import numpy as np  # heavy: numpy

    def stream(pieces: Iterator[np.ndarray]) -> Iterator[np.ndarray]:
        for p in pieces:
            yield np.ascontiguousarray(p).reshape(-1).view(np.uint8)

    sa, sb = stream(a), stream(b)
    x = y = np.empty(0, dtype=np.uint8)
    while True:
        if not x.size:
            x = next(sa, None)  # type: ignore[arg-type]
        if not y.size:
            y = next(sb, None)  # type: ignore[arg-type]
        if x is None or y is None:
            return x is None and y is None
        n = min(x.size, y.size)
        if n and not np.array_equal(x[:n], y[:n]):
            return False
        x, y = x[n:], y[n:]
