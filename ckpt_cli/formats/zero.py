"""Rebuilding full FP32 weights from DeepSpeed ZeRO 1/2/3 partitions, without torch.

DeepSpeed keeps the FP32 master weights flattened and partitioned across data-parallel ranks
in ``*_optim_states.pt``; ``zero_to_fp32.py`` rebuilds them by loading every rank's file.
Here every partition is located as a byte range in its file (from the pickles, read safely),
and each parameter is gathered with positioned reads of just its pieces, so memory holds one
parameter at a time and no optimizer state is loaded:

* ZeRO 1/2: per param group, the flat vector is the concatenation of the ranks'
  ``single_partition_of_fp32_groups[g]``; parameters follow ``param_shapes[g]`` in order (plus
  ``param_alignment_paddings``); the consumed count, aligned to ``2 * world``, must equal the
  available count, aligned the same way.
* ZeRO 3: each rank's groups ``fp32_flat_groups`` are concatenated; a parameter of ``n``
  elements takes ``ceil(n / world)`` at the same offset on every rank; the ranks' pieces are
  concatenated and trimmed to ``n``.

Buffers (``buffer_names``) come from the model states (floats as FP32, as zero_to_fp32 does),
frozen parameters from ``frozen_param_fragments``, and ``shared_params`` become aliases.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpt_cli import dtypes, storage
from ckpt_cli.errors import CkptError, CorruptCheckpointError, UnsupportedError
from ckpt_cli.formats import allowlist, deepspeed
from ckpt_cli.formats.base import file_size
from ckpt_cli.formats.standins import Opaque, TensorRecord
from ckpt_cli.formats.torchfile import contiguous_strides
from ckpt_cli.formats.torchzip import TorchZip, parse_zip
from ckpt_cli.storage import Handle, open_regular
from ckpt_cli.storage.reads import crc32_range

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True, slots=True)
class Piece:
    """``count`` elements at byte ``offset`` of ``file``.

    ``entry`` is the zip record holding them, ``(start, length, crc)``, when it has a CRC-32
    to check (None: the writer turned checksums off, or unknown).
    """

    file: Path
    offset: int
    count: int
    entry: tuple[int, int, int] | None = None


@dataclass(frozen=True, slots=True)
class Segment:
    """A contiguous flat tensor stored in a file (``entry``: as in :class:`Piece`)."""

    file: Path
    start: int  # byte offset of element 0
    numel: int
    entry: tuple[int, int, int] | None = None

    def whole(self) -> Piece:
        """All of the segment as one piece."""
        return Piece(self.file, self.start, self.numel, self.entry)


class FlatVector:
    """The virtual concatenation of flat segments of one dtype (a rank's or group's vector)."""

    def __init__(self, segments: list[Segment], itemsize: int):
        self.segments = segments
        self.itemsize = itemsize
        self.bounds = [0]
        for s in segments:
            self.bounds.append(self.bounds[-1] + s.numel)

    @property
    def numel(self) -> int:
        """Elements in the whole vector."""
        return self.bounds[-1]

    def pieces(self, start: int, count: int) -> list[Piece]:
        """Byte ranges that hold elements ``[start, start + count)``."""
        if start < 0 or start + count > self.numel:
            raise CorruptCheckpointError(
                f"elements [{start}, {start + count}) are outside the {self.numel}-element "
                "flat partition (the checkpoint does not match its param_shapes)",
                path=self.segments[0].file if self.segments else None)
        out: list[Piece] = []
        pos, end = start, start + count
        for seg, lo in zip(self.segments, self.bounds, strict=False):
            hi = lo + seg.numel
            if hi <= pos or lo >= end:
                continue
            a, b = max(pos, lo), min(end, hi)
            out.append(Piece(seg.file, seg.start + (a - lo) * self.itemsize, b - a, seg.entry))
        return out


@dataclass(slots=True)
class ParamPlan:
    """How to assemble one output tensor.

    Attributes:
        name: Parameter or buffer name.
        dtype: Dtype code of the stored pieces.
        shape: The tensor's shape.
        pieces: Byte ranges to concatenate (then trimmed to the shape's element count).
        kind: ``param``, ``frozen``, ``buffer`` or ``moment`` (optimizer state).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    pieces: list[Piece]
    kind: str = "param"

    @property
    def numel(self) -> int:
        """Elements of the assembled tensor."""
        return math.prod(self.shape)


@dataclass(slots=True)
class ZeroPlan:
    """The reconstruction of a ZeRO checkpoint's full weights.

    Attributes:
        stage: ZeRO stage (1, 2 or 3).
        world_size: Data-parallel world size.
        tensors: Output tensors, in the order zero_to_fp32 produces them.
        aliases: Shared parameters, ``{alias: owner}``.
        files: Every file read.
        step: ``global_steps`` from the model states, if present.
        notes: Remarks (frozen parameters found only in the module copy).
        unsafe: Files whose pickles name globals that run code under ``torch.load``, with
            those globals (nothing of them ran).
    """

    stage: int
    world_size: int
    tensors: list[ParamPlan] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)
    step: int | None = None
    notes: list[str] = field(default_factory=list)
    unsafe: dict[Path, list[str]] = field(default_factory=dict)


def _parse(path: Path) -> TorchZip:
    fd = open_regular(path)
    try:
        return parse_zip(fd, 0, file_size(path), str(path))
    finally:
        storage.close(fd)


def _segment(tz: TorchZip, rec: Any, path: Path, what: str) -> Segment:
    if not isinstance(rec, TensorRecord) or rec.storage is None:
        raise CorruptCheckpointError(f"{what} is not a stored tensor", path=path)
    start = tz.storage_start(rec.storage.key)
    if start is None:
        raise CorruptCheckpointError(f"{what}: storage {rec.storage.key!r} is missing",
                                     path=path)
    if rec.stride != contiguous_strides(rec.shape):
        raise UnsupportedError(f"{what} is not contiguous", path=path)
    numel = math.prod(rec.shape)
    itemsize = dtypes.DTYPES[rec.dtype].itemsize
    entry = tz.storage_entry(rec.storage.key)
    end = start + (rec.storage_offset + numel) * itemsize
    if entry is not None and end > tz.base + entry.data_offset + entry.size:
        raise CorruptCheckpointError(f"{what} runs past its storage record (truncated?)",
                                     path=path)
    crc = tz.storage_crc(rec.storage.key)
    check = (start, entry.size, crc) if entry is not None and crc is not None else None
    return Segment(path, start + rec.storage_offset * itemsize, numel, check)


def _items(obj: Any) -> dict[str, Any]:
    """A pickled dict (or OrderedDict, or stand-in object) as a plain dict."""
    if isinstance(obj, dict):
        return {str(k): v for k, v in obj.items()}
    if isinstance(obj, Opaque):
        return {str(k): v for k, v in obj.fields().items()}
    return {}


def _shape(v: Any) -> tuple[int, ...]:
    if isinstance(v, (list, tuple)) and all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in v):
        if (why := dtypes.shape_problem(v)) is None:
            return tuple(v)
        raise CorruptCheckpointError(f"parameter shape declares {why}")
    # never the repr of what a pickle held: it may nest deeper than repr can recurse
    raise CorruptCheckpointError(f"malformed parameter shape (a {type(v).__name__})")


def _stage(opt: dict[str, Any]) -> int | None:
    v = opt.get("zero_stage")
    if isinstance(v, int):
        return v
    if isinstance(v, Opaque) and v.args and isinstance(v.args[0], int):
        return int(v.args[0])  # ZeroStageEnum(2)
    return None


def resolve_tag(path: Path) -> Path:
    """A DeepSpeed tag directory, resolving a save directory through its ``latest`` file.

    Raises:
        CkptError: If neither ``path`` nor the tag ``latest`` names holds model states.
    """
    if deepspeed.has_model_states(path):
        return path
    latest = path / "latest"
    if latest.is_file():
        tag = deepspeed.latest_tag(path)
        if tag is not None and (path / tag).is_dir() and deepspeed.has_model_states(path / tag):
            return path / tag
        named = (storage.read_side(latest, "pointer") or b"").decode(errors="replace").strip()
        raise CorruptCheckpointError(f"'latest' names {named!r}, which is not a checkpoint "
                                     "directory here", path=latest)
    raise CkptError("not a DeepSpeed checkpoint (no *_model_states.pt, no latest)", path=path)


MOMENTS = ("exp_avg", "exp_avg_sq")


def plan_zero(path: Path, *, include_frozen: bool = True, moments: bool = False) -> ZeroPlan:
    """Plan the reconstruction of full FP32 weights from a ZeRO checkpoint.

    Args:
        path: A tag directory (``global_stepN``) or a save directory with ``latest``.
        include_frozen: Include frozen (non-trainable) parameters.
        moments: Also gather Adam's moments per parameter, as
            ``optimizer.state.<param>.exp_avg`` / ``.exp_avg_sq`` (they are partitioned
            exactly like the FP32 weights).

    Returns:
        The :class:`ZeroPlan`; nothing but the pickles has been read.

    Raises:
        CorruptCheckpointError: Missing rank files, sizes that do not add up.
        UnsupportedError: Model parallelism > 1, unknown stages, MoE expert files.
    """
    tag = resolve_tag(path)
    model_files, optim_files, expert = deepspeed.rank_files(tag)
    if expert:
        raise UnsupportedError("MoE expert checkpoints are not supported yet", path=tag)
    mps = {m.group("mp") for p in optim_files if (m := deepspeed.OPTIM_STATES.match(p.name))}
    if len(mps) > 1 or any(not p.name.endswith("mp_rank_00_model_states.pt")
                           for p in model_files):
        raise UnsupportedError("model-parallel (mp_rank > 0) DeepSpeed checkpoints are not "
                               "supported; zero_to_fp32 does not merge them either", path=tag)
    if not optim_files:
        raise CorruptCheckpointError("no *_optim_states.pt files: the FP32 weights are missing",
                                     path=tag)
    models = [(p, _parse(p)) for p in model_files]
    first = _items(models[0][1].pickle.obj)
    if "param_shapes" not in first or "buffer_names" not in first:
        raise CorruptCheckpointError("not a DeepSpeed model-states file (no param_shapes)",
                                     path=models[0][0])
    optims = [(p, _parse(p)) for p in optim_files]
    osd0 = _items(_items(optims[0][1].pickle.obj).get("optimizer_state_dict"))
    stage = _stage(osd0)
    if stage is None or stage not in (0, 1, 2, 3):
        raise UnsupportedError("optimizer states without a ZeRO stage "
                               f"({osd0.get('zero_stage')!r})", path=optims[0][0])
    pc = osd0.get("partition_count")
    world = max(pc) if isinstance(pc, list) else pc
    if not isinstance(world, int) or world < 1:
        raise CorruptCheckpointError(f"bad partition_count {pc!r}", path=optims[0][0])
    ranks = sorted(int(m.group("dp")) for p in optim_files
                   if (m := deepspeed.OPTIM_STATES.match(p.name)))
    if len(optim_files) != world or ranks != list(range(world)):
        missing = sorted(set(range(world)) - set(ranks))
        raise CorruptCheckpointError(
            f"partition_count is {world} but found {len(optim_files)} optimizer rank file(s)"
            + (f"; missing rank(s) {missing}" if missing else ""), path=tag)
    plan = ZeroPlan(stage=max(stage, 1), world_size=world,
                    files=[p for p, _ in models] + [p for p, _ in optims])
    for p, tz in (*models, *optims):
        bad = sorted({*allowlist.refused_names(tz.pickle.globals), *tz.pickle.builds})
        if bad:
            plan.unsafe[p] = bad
    steps = first.get("global_steps")
    plan.step = steps if isinstance(steps, int) else None
    _plan_buffers(plan, models[0])
    if include_frozen:
        _plan_frozen(plan, models, world)
    sources = {"": _flat_groups(optims, "single_partition_of_fp32_groups" if stage <= 2
                                else "fp32_flat_groups")}
    if moments:
        for moment in MOMENTS:
            sources[moment] = _moment_groups(optims, stage, moment)
    if stage <= 2:
        _plan_zero12(plan, first, optims, osd0, sources)
    else:
        _plan_zero3(plan, first, optims, sources)
    if include_frozen and stage <= 2:
        _plan_module_leftovers(plan, models[0], first)
    shared = _items(first.get("shared_params"))
    names = {t.name for t in plan.tensors if t.kind != "moment"}
    plan.aliases = {a: o for a, o in shared.items() if isinstance(o, str) and o in names}
    return plan


def _plan_buffers(plan: ZeroPlan, model: tuple[Path, TorchZip]) -> None:
    path, tz = model
    top = _items(tz.pickle.obj)
    names = top.get("buffer_names") or []
    module = _items(top.get("module"))
    for name in names:
        rec = module.get(name)
        if isinstance(rec, TensorRecord):
            seg = _segment(tz, rec, path, f"buffer {name}")
            plan.tensors.append(ParamPlan(name, rec.dtype, tuple(rec.shape),
                                          [seg.whole()], "buffer"))


def _plan_frozen(plan: ZeroPlan, models: list[tuple[Path, TorchZip]], world: int) -> None:
    tops = [_items(tz.pickle.obj) for _, tz in models]
    shapes = _items(tops[0].get("frozen_param_shapes"))
    if not shapes:
        return
    for name, raw_shape in shapes.items():
        shape = _shape(raw_shape)
        pieces: list[Piece] = []
        dtype = None
        sources = models if plan.stage == 3 else models[:1]
        for (path, tz), top in zip(sources, tops, strict=False):
            rec = _items(top.get("frozen_param_fragments")).get(name)
            seg = _segment(tz, rec, path, f"frozen parameter {name}")
            dtype = rec.dtype if isinstance(rec, TensorRecord) else None
            pieces.append(seg.whole())
        if plan.stage == 3 and len(models) != world:
            raise CorruptCheckpointError(f"ZeRO-3 needs {world} model-states files for frozen "
                                         f"parameters, found {len(models)}")
        assert dtype is not None
        plan.tensors.append(ParamPlan(name, dtype, shape, pieces, "frozen"))


def _plan_module_leftovers(plan: ZeroPlan, model: tuple[Path, TorchZip],
                           first: dict[str, Any]) -> None:
    """Frozen parameters DeepSpeed recorded nowhere but in ``module`` (ZeRO-1 saves no
    ``frozen_param_shapes``; zero_to_fp32 then drops them): taken from that copy, as stored."""
    path, tz = model
    known = {t.name for t in plan.tensors}
    known |= set(_items(first.get("shared_params")))
    for name, rec in _items(first.get("module")).items():
        if name in known or not isinstance(rec, TensorRecord) or rec.storage is None:
            continue
        seg = _segment(tz, rec, path, f"module entry {name}")
        plan.tensors.append(ParamPlan(name, rec.dtype, tuple(rec.shape),
                                      [seg.whole()], "frozen"))
        plan.notes.append(f"{name}: not in param_shapes (a frozen parameter); taken from the "
                          f"model states' {rec.dtype} copy")


def _flat_groups(optims: list[tuple[Path, TorchZip]], key: str) -> list[list[Segment]]:
    """Per rank, the segments of its flat FP32 groups."""
    out: list[list[Segment]] = []
    for path, tz in optims:
        osd = _items(_items(tz.pickle.obj).get("optimizer_state_dict"))
        groups = osd.get(key)
        if not isinstance(groups, list) or not groups:
            raise CorruptCheckpointError(f"optimizer states lack {key}", path=path)
        out.append([_segment(tz, g, path, f"{key}[{i}]") for i, g in enumerate(groups)])
        dts = {g.dtype for g in groups if isinstance(g, TensorRecord)}
        if dts != {"F32"}:
            raise UnsupportedError(f"{key} holds {sorted(dts)}, expected FP32", path=path)
    return out


def _moment_groups(optims: list[tuple[Path, TorchZip]], stage: int,
                   moment: str) -> list[list[Segment]]:
    """Per rank, the flat segments of one optimizer moment (laid out like the FP32 groups)."""
    out: list[list[Segment]] = []
    for path, tz in optims:
        osd = _items(_items(tz.pickle.obj).get("optimizer_state_dict"))
        inner = _items(osd.get("base_optimizer_state" if stage <= 2 else "optimizer_state_dict"))
        state = inner.get("state")
        groups = [state[k] for k in sorted(state)] if isinstance(state, dict) else state
        if not isinstance(groups, list) or not groups:
            raise UnsupportedError(f"no optimizer state to keep (looked for {moment})", path=path)
        segs = []
        for g, st in enumerate(groups):
            rec = _items(st).get(moment)
            if rec is None:
                raise UnsupportedError(f"optimizer state has no {moment!r} (not Adam?)",
                                       path=path)
            segs.append(_segment(tz, rec, path, f"{moment}[{g}]"))
        out.append(segs)
    return out


def _name(prefix: str, name: str) -> str:
    return f"optimizer.state.{name}.{prefix}" if prefix else name


def _plan_zero12(plan: ZeroPlan, first: dict[str, Any], optims: list[tuple[Path, TorchZip]],
                 osd0: dict[str, Any], sources: dict[str, list[list[Segment]]]) -> None:
    per_rank = sources[""]
    shapes = first.get("param_shapes")
    if not isinstance(shapes, list) or len(shapes) != len(per_rank[0]):
        raise CorruptCheckpointError(f"param_shapes has {len(shapes or [])} group(s) but the "
                                     f"optimizer has {len(per_rank[0])}", path=optims[0][0])
    paddings = osd0.get("param_alignment_paddings")
    align = 2 * plan.world_size
    for g, group_shapes in enumerate(shapes):
        vecs = {k: FlatVector([rank[g] for rank in src], 4) for k, src in sources.items()}
        vec = vecs[""]
        pads = paddings[g] if isinstance(paddings, list) and g < len(paddings) else None
        if isinstance(pads, list) and len(pads) != len(_items(group_shapes)):
            raise CorruptCheckpointError(
                f"param group {g}: {len(pads)} alignment paddings for "
                f"{len(_items(group_shapes))} parameters", path=optims[0][0])
        offset = 0
        for i, (name, raw_shape) in enumerate(_items(group_shapes).items()):
            shape = _shape(raw_shape)
            n = math.prod(shape)
            for k, v in vecs.items():
                plan.tensors.append(ParamPlan(_name(k, name), "F32", shape, v.pieces(offset, n),
                                              "param" if not k else "moment"))
            offset += n
            if isinstance(pads, list) and i < len(pads) and isinstance(pads[i], int):
                offset += pads[i]
        if math.ceil(offset / align) != math.ceil(vec.numel / align):
            raise CorruptCheckpointError(
                f"param group {g}: consumed {offset} of {vec.numel} elements; the partitions "
                "do not match param_shapes", path=optims[0][0])


def _plan_zero3(plan: ZeroPlan, first: dict[str, Any], optims: list[tuple[Path, TorchZip]],
                sources: dict[str, list[list[Segment]]]) -> None:
    by_source = {k: [FlatVector(segs, 4) for segs in src] for k, src in sources.items()}
    vecs = by_source[""]
    shapes: dict[str, Any] = {}
    for group in first.get("param_shapes") or []:
        shapes.update(_items(group))
    world = plan.world_size
    offset = 0
    for name, raw_shape in shapes.items():
        shape = _shape(raw_shape)
        n = math.prod(shape)
        part = math.ceil(n / world)
        for k, vs in by_source.items():
            pieces = [p for v in vs for p in v.pieces(offset, part)]
            plan.tensors.append(ParamPlan(_name(k, name), "F32", shape, pieces,
                                          "param" if not k else "moment"))
        offset += part
    if offset != vecs[0].numel:
        raise CorruptCheckpointError(f"consumed {offset * world} of {vecs[0].numel * world} "
                                     "elements; the partitions do not match param_shapes",
                                     path=optims[0][0])


class PieceReader:
    """Reads and assembles planned tensors with positioned reads (a cache of open files)."""

    def __init__(self) -> None:
        self._fds: dict[Path, Handle] = {}
        # Zip records whose CRC-32 was checked: (file, start) -> the CRC their bytes give.
        self._checked: dict[tuple[Path, int], int] = {}

    def close(self) -> None:
        """Close the files."""
        for fd in self._fds.values():
            storage.close(fd)
        self._fds.clear()

    def read(self, t: ParamPlan) -> np.ndarray:
        """Assemble ``t``: concatenate its pieces, trim to its element count, reshape.

        Raises:
            CorruptCheckpointError: A piece runs past the end of its file.
        """
        import numpy as np  # heavy: numpy

        dt = dtypes.numpy_dtype(t.dtype)
        total = sum(p.count for p in t.pieces)
        flat = np.empty(max(total, t.numel), dtype=dt)
        view = flat.view(np.uint8)
        pos = 0
        for p in t.pieces:
            fd = self._fds.get(p.file)
            if fd is None:
                fd = self._fds[p.file] = open_regular(p.file)
            if p.entry is not None:
                self._check_entry(fd, p.file, p.entry, t.name)
            want = p.count * dt.itemsize
            mv = view[pos:pos + want].data
            got = 0
            while got < want:
                n = storage.readinto(fd, mv[got:], p.offset + got)
                if n <= 0:
                    raise CorruptCheckpointError(
                        f"{t.name}: file ends before byte {p.offset + want:,} (truncated)",
                        path=p.file)
                got += n
            pos += want
        if total < t.numel:
            raise CorruptCheckpointError(f"{t.name}: {total} elements found, {t.numel} needed")
        return flat[: t.numel].reshape(t.shape)

    def _check_entry(self, fd: Handle, path: Path, entry: tuple[int, int, int], name: str) -> None:
        """Check a zip record's CRC-32 once, before the first piece of it is used.

        A parameter's pieces are slices of flat partitions that hold many parameters, so the
        whole record is read once more (in 16 MiB pieces, from the page cache when it was just
        read): damaged bytes must not be laundered into a clean-looking output.
        """
        start, length, crc = entry
        got = self._checked.get((path, start))
        if got is None:
            got = crc32_range(fd, start, length)
            if got is None:
                raise CorruptCheckpointError(f"file ends inside the record of {name} "
                                             "(truncated)", path=path)
            self._checked[(path, start)] = got
        if got != crc:
            raise CorruptCheckpointError(
                f"{name}: the record holding it fails the CRC-32 check (recorded {crc:#010x}, "
                f"read {got:#010x}): the file is damaged", path=path)


def loader(reader: PieceReader, t: ParamPlan,
           post: Callable[[np.ndarray], np.ndarray] | None = None) -> Callable[[], np.ndarray]:
    """A zero-argument function producing ``t``'s values (optionally transformed)."""
    def load() -> np.ndarray:
        arr = reader.read(t)
        return post(arr) if post else arr
    return load
