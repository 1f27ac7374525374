"""What the framework sources share: torch.save files read safely into lazy tensors and plain
values, and a ``torch.optim`` state dict (integer parameter ids) mapped to FQNs.

Every pickle is read by ckpt's allowlisting unpickler (no code from the file runs); tensor
bytes are read when a :class:`~ckpt_cli.ops.to_dcp.state.LazyTensor` is loaded, with
positioned reads, so a source's memory stays bounded by its largest tensor.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpt_cli import storage
from ckpt_cli.errors import CkptError, CorruptCheckpointError, UnsupportedError
from ckpt_cli.formats import containers
from ckpt_cli.formats.base import file_size
from ckpt_cli.formats.standins import Opaque, TensorRecord
from ckpt_cli.formats.torchfile import read_into
from ckpt_cli.formats.torchzip import parse_zip
from ckpt_cli.model import CheckpointIndex, TensorInfo
from ckpt_cli.ops.to_dcp.state import LazyTensor
from ckpt_cli.tensors.select import hostile_warnings
from ckpt_cli.tensors.source import TensorSource

if TYPE_CHECKING:
    import numpy as np

_MAX_PLAIN = 100_000  # values a plain copy may hold (a scheduler or RNG state is far smaller)


@dataclass(frozen=True, eq=False)
class IndexedLoad:
    """A loader reading one tensor of a checkpoint as its index describes it: which stored
    tensor a :class:`LazyTensor` is can then be told (``diff`` pairs a source's tensors with
    their names in its ``convert --to dcp`` output by it).

    Attributes:
        index: The checkpoint (one file's index, or a directory's).
        info: The tensor.
    """

    index: CheckpointIndex
    info: TensorInfo

    def __call__(self) -> np.ndarray:
        with TensorSource(self.index) as src:
            return src.read(self.info)

    def pieces(self) -> Iterator[np.ndarray]:
        """The same values as flat arrays, a bounded piece at a time."""
        with TensorSource(self.index) as src:
            yield from src.iter_pieces(self.info)


def lazy_of(index: CheckpointIndex, info: TensorInfo) -> LazyTensor:
    """A :class:`LazyTensor` reading ``info`` from ``index``'s files when loaded (whole or
    in pieces; with its storage entry's CRC-32 where the reader checks it)."""
    # TensorSource checks a storage entry's CRC-32 as it reads (and fails the read on a
    # mismatch): a tensor that is its whole entry has that CRC.
    s = info.storage
    crc = s.crc if (s is not None and s.crc is not None and not info.chunks
                    and info.stride is None and info.offset == s.start
                    and info.nbytes == s.crc_len) else None
    load = IndexedLoad(index, info)
    return LazyTensor(info.dtype, tuple(info.shape), load, load.pieces, crc)


@dataclass
class TorchTree:
    """One torch.save file: its safely unpickled tree and its tensors, readable lazily.

    Attributes:
        path: The file.
        tree: The unpickled object (tensors as :class:`TensorRecord`, unknown globals as
            :class:`Opaque` stand-ins).
        index: The file's tensors, by flattened name.
        hostile: What the file's pickles meant to run under ``torch.load`` (globals that run
            code, a TorchScript archive), one sentence each; nothing of it ran. Readers put
            these in the state's ``notes``.
    """

    path: Path
    tree: Any
    index: CheckpointIndex
    _names: dict[int, str]
    hostile: list[str]

    def lazy(self, rec: Any, what: str) -> LazyTensor:
        """The lazy tensor of a :class:`TensorRecord` found in :attr:`tree`.

        Raises:
            CorruptCheckpointError: ``rec`` is not a readable tensor of this file.
        """
        name = self._names.get(id(rec)) if isinstance(rec, TensorRecord) else None
        info = self.index.tensors.get(name) if name is not None else None
        if info is None:
            raise CorruptCheckpointError(f"{what} is not a readable tensor", path=self.path)
        return lazy_of(self.index, info)


#: Reader findings that leave a file's tensors unreadable or wrong: refused. (Globals that
#: would run code are not among them: nothing runs here, and convert warns of them too.)
_REFUSED = frozenset({"bad-tensor", "big-endian", "compressed-entry", "missing-storage",
                      "short-storage", "unsupported-format", "view-out-of-bounds"})


def read_torch(path: Path) -> TorchTree:
    """Read a torch.save file's pickle (safely) and locate its tensors.

    Raises:
        CkptError: The file is not a readable torch checkpoint, or its tensors are damaged
            (the reader's first such finding).
    """

    index = CheckpointIndex(format="torch", root=path, base=path.parent)
    read_into(index, path, role="other", prefix="")
    bad = [f for f in index.findings if f.severity == "error" and f.code in _REFUSED]
    if bad:
        where = f" ({bad[0].location})" if bad[0].location else ""
        raise CorruptCheckpointError(f"{bad[0].message}{where}", path=path)

    fd = storage.open_regular(path)
    try:
        tree = parse_zip(fd, 0, file_size(path), str(path)).pickle.obj
    except (CkptError, pickle.UnpicklingError, ValueError) as e:
        raise CorruptCheckpointError(f"not a readable torch.save zip ({e})", path=path) from None
    finally:
        storage.close(fd)
    names: dict[int, str] = {}
    try:
        for p, leaf in containers.walk(tree):
            if isinstance(leaf, TensorRecord):
                names.setdefault(id(leaf), ".".join(p))
    except ValueError as e:
        raise CorruptCheckpointError(str(e), path=path) from None
    return TorchTree(path, tree, index, names,
                     [f"{path.name}: {f.message}" for f in hostile_warnings(index)])


def items(obj: Any) -> dict[Any, Any] | None:
    """A pickled dict (or an :class:`Opaque` object's fields), or None."""
    if isinstance(obj, dict):
        return obj
    if isinstance(obj, Opaque) and obj.fields():
        return obj.fields()
    return None


def ndarray_of(obj: Any) -> np.ndarray | None:
    """A pickled numpy array (``numpy.core.multiarray._reconstruct`` + its BUILD state),
    decoded from its bytes with ``numpy.frombuffer`` (nothing of the pickle runs), or None."""
    if not isinstance(obj, Opaque) or not obj.qualname.endswith("multiarray._reconstruct"):
        return None
    st = obj.state
    if not (isinstance(st, tuple) and len(st) == 5 and isinstance(st[4], (bytes, bytearray))):
        return None
    shape, dt, fortran, raw = st[1], st[2], st[3], st[4]
    if not isinstance(dt, Opaque) or not dt.args or not isinstance(dt.args[0], str):
        return None
    code = dt.args[0]
    order = dt.state[1] if isinstance(dt.state, tuple) and len(dt.state) > 1 else "<"
    import numpy as np  # heavy: numpy

    try:
        kind = np.dtype((order if order in "<>" else "") + code)
        if kind.kind not in "biuf" or not isinstance(shape, tuple):
            return None
        arr = np.frombuffer(bytes(raw), dtype=kind)
        return arr.reshape(shape, order="F" if fortran else "C").copy()
    except (TypeError, ValueError):
        return None


_MAX_DEPTH = 64  # nesting a plain value may have (a scheduler's state has 3 or 4)
_KEYS = (bool, int, float, str, type(None))


def plain(obj: Any, what: str, path: Path, budget: list[int] | None = None,
          depth: int = 0) -> Any:
    """A pickled value as plain Python (dicts, lists, tuples, numbers, strings, None).

    numpy scalars and arrays become numbers and arrays; anything else (a tensor, an object
    of an unknown class) is refused, naming where it is. Size and nesting are bounded.

    Raises:
        UnsupportedError: A value that is not plain data, or too large or deep.
    """
    budget = budget if budget is not None else [_MAX_PLAIN]
    budget[0] -= 1
    if budget[0] < 0:
        raise UnsupportedError(f"{what} holds more than {_MAX_PLAIN:,} values", path=path)
    if depth > _MAX_DEPTH:
        raise UnsupportedError(f"{what} nests deeper than {_MAX_DEPTH} levels", path=path)
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return obj
    if isinstance(obj, (list, tuple)):
        out = [plain(v, f"{what}[{i}]", path, budget, depth + 1) for i, v in enumerate(obj)]
        return out if isinstance(obj, list) else tuple(out)
    if isinstance(obj, dict):
        bad = next((k for k in obj if not isinstance(k, _KEYS)), None)
        if bad is not None:
            raise UnsupportedError(f"{what} has a key of type {type(bad).__name__}, not plain "
                                   "data", path=path)
        return {k: plain(v, f"{what}.{k}", path, budget, depth + 1) for k, v in obj.items()}
    if isinstance(obj, Opaque):
        num = containers.numpy_scalar(obj)
        if num is not None:
            return num
        arr = ndarray_of(obj)
        if arr is not None:
            return arr
        raise UnsupportedError(f"{what} is an object of class {obj.qualname}, which ckpt does "
                               "not rebuild (it would run the class's code)", path=path)
    raise UnsupportedError(f"{what} is a {type(obj).__name__}, not plain data", path=path)


ADAM_STATE = frozenset({"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"})
SGD_STATE = frozenset({"momentum_buffer"})
_SHAPED = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer")


def optimizer_kind(groups: list[dict[Any, Any]], states: list[dict[Any, Any]], adam: str,
                   path: Path) -> str:
    """The ``torch.optim`` class a state dict belongs to: ``Adam``/``AdamW`` or ``SGD``.

    Args:
        groups: The param groups.
        states: The per-parameter states.
        adam: The Adam-family name to use when the groups do not say
            (``decoupled_weight_decay``, torch >= 2.6).
        path: The file, for errors.

    Raises:
        UnsupportedError: State or hyperparameters of an optimizer ckpt cannot map.
    """
    keys = {str(k) for st in states for k in st}
    gkeys = {str(k) for g in groups for k in g}
    if keys <= ADAM_STATE and ("betas" in gkeys or keys & {"exp_avg"}):
        flags = {g.get("decoupled_weight_decay") for g in groups}
        if flags == {True}:
            return "AdamW"
        if flags == {False}:
            return "Adam"
        return adam
    if keys <= SGD_STATE and "momentum" in gkeys and "betas" not in gkeys:
        return "SGD"
    raise UnsupportedError(
        f"the optimizer state ({', '.join(sorted(keys)) or 'empty'}; groups with "
        f"{', '.join(sorted(gkeys - {'params'}))}) is not Adam/AdamW or SGD: ckpt cannot map "
        "it, and dropping it would silently restart the optimizer", path=path)


def group_ids(groups: list[dict[Any, Any]], where: str, path: Path) -> list[list[int]]:
    """Each param group's parameter ids, checked to be distinct integers.

    Raises:
        CorruptCheckpointError: A group without a ``params`` list, an id that is not an
            integer, or one listed twice.
    """
    out: list[list[int]] = []
    seen: set[int] = set()
    for g, group in enumerate(groups):
        ids = group.get("params")
        if not isinstance(ids, list):
            raise CorruptCheckpointError(f"{where}: param group {g} has no params list",
                                         path=path)
        for pid in ids:
            if not isinstance(pid, int) or isinstance(pid, bool):
                raise CorruptCheckpointError(f"{where}: param group {g} lists a "
                                             f"{type(pid).__name__} as a parameter id",
                                             path=path)
            if pid in seen:
                raise CorruptCheckpointError(f"{where}: parameter id {pid} is listed twice",
                                             path=path)
            seen.add(pid)
        out.append(list(ids))
    return out


def map_torch_optimizer(tt: TorchTree, osd: Any, names: list[list[str]],
                        shapes: dict[str, tuple[int, ...]], *, where: str, adam: str = "Adam",
                        ) -> tuple[str, dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """Map a ``torch.optim`` state dict (integer parameter ids) to FQNs.

    ``torch.optim.Optimizer.state_dict`` numbers the parameters 0, 1, ... across the param
    groups in order, so group ``g``'s ids map, in order, to ``names[g]``.

    Args:
        tt: The file holding ``osd``.
        osd: The state dict (``{"state": {id: {...}}, "param_groups": [...]}``).
        names: Per param group, the FQNs of its parameters in the optimizer's order.
        shapes: FQN -> parameter shape, to check every moment against.
        where: Where ``osd`` is in the file (for messages).
        adam: See :func:`optimizer_kind`.

    Returns:
        ``(class name, FQN -> state, param groups with FQNs)``.

    Raises:
        CkptError: Groups or ids that do not match ``names``; moments of the wrong shape.
        UnsupportedError: An optimizer ckpt cannot map.
    """
    d = items(osd)
    if d is None or not isinstance(d.get("param_groups"), list):
        raise CorruptCheckpointError(f"{where} is not a torch optimizer state dict",
                                     path=tt.path)
    raw_groups = [items(g) for g in d["param_groups"]]
    state = items(d.get("state")) if d.get("state") is not None else {}
    if state is None or any(g is None or not isinstance(g.get("params"), list)
                            for g in raw_groups):
        raise CorruptCheckpointError(f"{where}: malformed state or param_groups", path=tt.path)
    groups: list[dict[Any, Any]] = [g for g in raw_groups if g is not None]
    if len(groups) != len(names):
        raise CkptError(f"{where} has {len(groups)} param group(s), the model gives "
                        f"{len(names)}: the parameters cannot be named", path=tt.path)
    group_ids(groups, where, tt.path)
    fqn: dict[Any, str] = {}
    for g, (group, group_names) in enumerate(zip(groups, names, strict=True)):
        ids = group["params"]
        if len(ids) != len(group_names):
            raise CkptError(f"{where}: param group {g} holds {len(ids)} parameter(s), the model "
                            f"gives {len(group_names)} for it: the parameters cannot be named",
                            path=tt.path)
        fqn.update(zip(ids, group_names, strict=True))
    states = [items(v) or {} for v in state.values()]
    kind = optimizer_kind(groups, states, adam, tt.path)
    out: dict[str, dict[str, Any]] = {}
    for pid, st in state.items():
        name = fqn.get(pid)
        if name is None:
            raise CorruptCheckpointError(f"{where}: state for parameter id {pid!r}, which no "
                                         "param group holds", path=tt.path)
        out[name] = {}
        for k, v in (items(st) or {}).items():
            if isinstance(v, TensorRecord):
                lt = tt.lazy(v, f"{where}.state.{pid}.{k}")
                if k in _SHAPED and name in shapes and lt.shape != shapes[name]:
                    raise CkptError(
                        f"{where}: {k} of parameter id {pid} has shape {list(lt.shape)}, but "
                        f"{name} is {list(shapes[name])}: the id order does not match the "
                        "model", path=tt.path)
                out[name][str(k)] = lt
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                out[name][str(k)] = v
            else:
                raise UnsupportedError(f"{where}: state {k!r} of parameter id {pid} is not a "
                                       "tensor or a number", path=tt.path)
    pgs = []
    for group, group_names in zip(groups, names, strict=True):
        pg = {str(k): plain(v, f"{where}.param_groups.{k}", tt.path)
              for k, v in group.items() if k != "params"}
        pg["params"] = list(group_names)
        pgs.append(pg)
    return kind, out, pgs


def rng_value(obj: Any, tt: TorchTree, what: str) -> Any:
    """An RNG state as saved: tensors lazy, the rest plain (numpy arrays decoded)."""
    if isinstance(obj, TensorRecord):
        return tt.lazy(obj, what)
    d = obj if isinstance(obj, dict) else None
    if d is not None:
        return {str(k): rng_value(v, tt, f"{what}.{k}") for k, v in d.items()}
    if isinstance(obj, (list, tuple)) and any(isinstance(v, TensorRecord) for v in obj):
        return [rng_value(v, tt, f"{what}[{i}]") for i, v in enumerate(obj)]
    return plain(obj, what, tt.path)
