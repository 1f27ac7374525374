"""``inspect``: what is in a checkpoint file, shard set, checkpoint directory or run directory."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpt_cli import documents, storage
from ckpt_cli.errors import CkptError, UsageError
from ckpt_cli.formats import allowlist, check_exists, read_index
from ckpt_cli.formats.directory import NESTED_CHECKPOINTS
from ckpt_cli.fp8 import scheme
from ckpt_cli.model import GROUPS, CheckpointIndex, RunListing, TensorInfo, parameters_of
from ckpt_cli.ops.options.inspect import InspectOptions as InspectOptions
from ckpt_cli.resolve import resolve
from ckpt_cli.runs import list_run

# -- the result ------------------------------------------------------------------------------------

@dataclass(slots=True)
class TreeNode:
    """A module prefix with the totals of the tensors below it.

    The totals follow the summary's rules, so that the root's add up to it: a tied copy
    (a second name for one storage, or a copy found by value) is a tensor but adds no
    parameters or bytes, and only model weights are parameters.

    Attributes:
        name: This level's name component (the full prefix is the path from the root).
        tensors: Number of tensor names below (tied copies included, as ``num_tensors``).
        parameters: Parameters below: elements of model weights, tied copies once
            (as ``num_parameters``).
        bytes: Bytes below, tied copies once (as ``total_bytes``).
        bytes_by_group: Those bytes per group (``model``, ``buffer``, ``optimizer``,
            ``other``), as the summary's ``bytes_by_group``.
        tied: Of the tensors below, the tied copies (counted once, under the name they
            repeat).
        children: Sub-prefixes by name, in first-seen order.
    """

    name: str
    tensors: int = 0
    parameters: int = 0
    bytes: int = 0
    bytes_by_group: dict[str, int] = field(default_factory=dict)
    tied: int = 0
    children: dict[str, TreeNode] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"name": self.name, "tensors": self.tensors, "parameters": self.parameters,
                "bytes": self.bytes, "bytes_by_group": self.bytes_by_group, "tied": self.tied,
                "children": [c.to_dict() for c in self.children.values()]}


@dataclass(slots=True)
class InspectResult(documents.Documented):
    """What ``inspect`` found.

    Attributes:
        path: The path inspected.
        kind: ``checkpoint`` or ``run``.
        index: The checkpoint described (for a run directory: its latest complete one).
        run: The run listing, for a run directory.
        described: For a run directory, the name of the checkpoint ``index`` describes.
        tensors: Selected tensors (``--tensors``), filtered and sorted.
        tree: Module tree (``--tree``).
        describe_error: Why the run's latest checkpoint could not be read, if it could not.
        final_model: Whether ``index`` is the final model at the top of the run directory
            (an HF Trainer ``output_dir``) rather than one of its checkpoints.
        quantization: The quantization scheme (:func:`ckpt_cli.fp8.scheme.describe`), when
            ``index`` holds FP8 weights, scales or a ``quantization_config``.
    """

    path: Path
    kind: str
    index: CheckpointIndex | None
    run: RunListing | None = None
    described: str | None = None
    tensors: list[TensorInfo] | None = None
    tree: TreeNode | None = None
    describe_error: str | None = None
    final_model: bool = False
    quantization: dict[str, Any] | None = None

    command = "inspect"

    def json_body(self) -> dict[str, Any]:
        """The ``inspect --json`` document without ``schema_version`` and ``command``."""
        doc: dict[str, Any] = {"path": str(self.path), "kind": self.kind}
        if self.index is not None:
            doc.update(documents.index_summary(self.index))
        else:
            doc.update({"format": None, "flavor": None, "files": [], "num_files": 0,
                        "file_bytes": 0, "num_tensors": 0, "num_parameters": 0,
                        "tied_tensors": [], "total_bytes": 0, "bytes_by_group": {},
                        "params_by_dtype": {}, "bytes_by_dtype": {}, "metadata": {},
                        "step": None, "step_source": None, "layout": {}, "warnings": []})
        if self.run is not None:
            doc.update(documents.run_dict(self.run))
            doc["described"] = self.described
            doc["describe_error"] = self.describe_error
            doc["final_model"] = self.final_model
        if self.tensors is not None:
            doc["tensors"] = [documents.tensor_dict(t) for t in self.tensors]
        if self.tree is not None:
            doc["tree"] = self.tree.to_dict()
        if self.quantization is not None:
            doc["quantization"] = self.quantization
        return doc


# -- the op ----------------------------------------------------------------------------------------

def inspect(path: str | Path, options: InspectOptions | None = None, *,
            progress: object = None) -> InspectResult:
    """Describe a checkpoint or a run directory, reading metadata only.

    Args:
        path: A checkpoint file or directory, or a run directory.
        options: What to show (:class:`InspectOptions`; default: the summary).
        progress: Unused (inspect reads headers only); the ops' common signature.

    Returns:
        The :class:`InspectResult`.

    Raises:
        CkptError: Missing path, unknown format, corrupt input.
        UsageError: Bad ``sort`` or ``depth``.
    """
    o = options if options is not None else InspectOptions()
    fmt, tensors, filter_glob, sort = o.input_format, o.tensors, o.name_glob, o.sort
    tree, depth, pattern, allow_globals = o.tree, o.depth, o.pattern, o.allow_global
    p = storage.locate(path)
    check_exists(p)
    if sort not in ("name", "size", "name-alpha"):
        raise UsageError(f"sort must be name or size, not {sort!r}", param="sort")
    if depth < 1:
        raise UsageError("depth must be at least 1", param="depth")
    allowed = allowlist.parse_names(allow_globals)
    target = resolve(p, input_format=fmt)
    if target.final_model:
        result = _inspect_final(p, pattern)
    elif target.is_run:
        result = _inspect_run(p, pattern)
    else:
        result = InspectResult(p, "checkpoint", read_index(p, fmt))
    if result.index is not None:
        result.index.findings = allowlist.allow(result.index.findings, allowed)
        if tensors or filter_glob:
            result.tensors = select_tensors(result.index, filter_glob, sort)
        if tree:
            result.tree = module_tree(result.index, depth, filter_glob)
        result.quantization = scheme.describe(result.index)
    return result


def _inspect_run(p: Path, pattern: str | None) -> InspectResult:
    run = list_run(p, pattern)
    result = InspectResult(p, "run", None, run)
    target = next((e for e in run.entries if e.name == run.latest and e.complete), None)
    if target is None:
        target = next((e for e in reversed(run.entries) if e.complete), None)
    if target is not None:
        result.described = target.name
        try:
            result.index = read_index(target.path)
        except CkptError as e:
            result.describe_error = str(e)
    return result


def _inspect_final(p: Path, pattern: str | None) -> InspectResult:
    """An HF Trainer output directory: the table of its checkpoints and the final model."""
    index = read_index(p)
    # The checkpoints are listed with the run, so the hint to name them is moot here.
    index.findings = [f for f in index.findings if f.code != NESTED_CHECKPOINTS]
    return InspectResult(p, "run", index, list_run(p, pattern), described=p.name,
                         final_model=True)


def select_tensors(index: CheckpointIndex, filter_glob: str | None,
                   sort: str = "name") -> list[TensorInfo]:
    """Tensors of ``index`` matching a glob, sorted.

    Args:
        index: The checkpoint.
        filter_glob: Shell-style pattern on the tensor name (``*`` crosses dots), or None.
        sort: ``name`` (file order), ``name-alpha`` or ``size`` (largest first).

    Returns:
        The selected tensors.
    """
    out = [t for t in index.tensors.values()
           if filter_glob is None or fnmatch.fnmatchcase(t.name, filter_glob)]
    if sort == "size":
        out.sort(key=lambda t: (-t.nbytes, t.name))
    elif sort == "name-alpha":
        out.sort(key=lambda t: t.name)
    return out


def module_tree(index: CheckpointIndex, depth: int, filter_glob: str | None = None) -> TreeNode:
    """Group tensors by dotted name prefix, up to ``depth`` levels.

    Each node counts as the summary does (:attr:`CheckpointIndex.num_parameters`,
    :attr:`~CheckpointIndex.total_bytes`, :attr:`~CheckpointIndex.bytes_by_group`): tied
    copies add no parameters or bytes, and only model weights are parameters. Without a
    filter, the root's totals are the summary's.

    Args:
        index: The checkpoint.
        depth: How many name components form the tree's levels.
        filter_glob: Only tensors matching this glob.

    Returns:
        The root :class:`TreeNode` (its name is the checkpoint's name).
    """
    counted = {t.name for t in index.distinct_tensors()}
    root = _tree_node(index.root.name)
    for t in select_tensors(index, filter_glob):
        once = t.name in counted
        node = root
        _add(node, t, once)
        # Leaves (the last component) are not tree levels; they are what the counts count.
        for part in t.name.split(".")[:-1][:depth]:
            if part not in node.children:
                node.children[part] = _tree_node(part)
            node = node.children[part]
            _add(node, t, once)
    return root


def _tree_node(name: str) -> TreeNode:
    return TreeNode(name, bytes_by_group=dict.fromkeys(GROUPS, 0))


def _add(node: TreeNode, t: TensorInfo, once: bool) -> None:
    """Count ``t`` in ``node``: a tied copy (``once`` False) as a tensor only."""
    node.tensors += 1
    if not once:
        node.tied += 1
        return
    node.parameters += parameters_of(t)
    node.bytes += t.nbytes
    node.bytes_by_group[t.group] = node.bytes_by_group.get(t.group, 0) + t.nbytes
