"""Which source tensors an output keeps, and the warnings about hostile sources.

Shared by the commands that write a checkpoint from another (``convert``, ``consolidate``):
the model's weights are chosen and renamed the same way whatever the command, and a source
whose pickles would run code under a full ``torch.load`` is called out the same way.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ckpt_cli.errors import UnsupportedError, UsageError
from ckpt_cli.formats import names
from ckpt_cli.formats.containers import MODEL_KEYS
from ckpt_cli.model import CheckpointIndex, Finding, TensorInfo

WRAPPERS = names.WRAPPERS
"""Wrapper prefixes (DDP, torch.compile) that :func:`select_tensors` strips."""


@dataclass(frozen=True, slots=True)
class Selection:
    """Which source tensors become which output names."""

    names: dict[str, str]  # output name -> source tensor name
    renamed: list[str]
    dropped: dict[str, int]
    notes: list[str]


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
        unsafe = sorted({f.location for f in index.findings if f.location and f.code in (
            "unsafe-global", "unknown-global")})
        raise UsageError(f"{index.root}: no model weights found (groups: "
                         f"{_group_summary(index)})"
                         + (f"; its pickles name {', '.join(unsafe)}, outside ckpt's "
                            "allowlist" if unsafe else ""))
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
                             "use keep_prefix or container", param=("keep_prefix", "container"))
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
            raise UsageError(f"container {wanted!r} not found; model containers here: "
                             f"{', '.join(p.rstrip('.') for p in prefixes) or 'none'}",
                             param="container")
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


def hostile_warnings(index: CheckpointIndex) -> list[Finding]:
    """One ``hostile-source`` warning per source file whose pickles name globals that run
    code under ``torch.load(weights_only=False)``, or that is a TorchScript archive; and the
    readers' findings of a hidden or unscannable pickle or a duplicate header key, as warnings.

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
        if f.code in ("unsafe-global", "unknown-global") and f.location:
            named.setdefault(f.file, []).append(f.location)
        elif f.code == "torchscript-archive":
            script.add(f.file)
            named.setdefault(f.file, [])
    out = [hostile_warning(index.path_of(rel) if rel else index.root, sorted(set(quals)),
                           torchscript=rel in script, rel=rel)
           for rel, quals in named.items()]
    # What the globals do not say: a pickle hidden after data.pkl's STOP, one ckpt could not
    # scan, a header key spelt twice. The output is clean; the source should not be loaded.
    return out + [dataclasses.replace(f, severity="warning", message=(
        f"{index.path_of(f.file) if f.file else index.root}: {f.message}"))
        for f in index.findings if f.code in _HIDDEN]


_HIDDEN = ("pickle-after-stop", "unscanned-pickle", "duplicate-key")


def hostile_warning(path: Path, qualnames: list[str], *, torchscript: bool = False,
                    rel: str | None = None) -> Finding:
    """The ``hostile-source`` warning for one source file.

    Args:
        path: The file, as shown to the user.
        qualnames: The globals its pickles name that no allowlist accepts.
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
