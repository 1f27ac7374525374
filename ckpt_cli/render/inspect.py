"""Output of ``ckpt inspect``: the JSON document or the human summary."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ckpt_cli.results import InspectResult


def show(result: InspectResult, *, json: bool, all_rows: bool = False) -> None:
    """Print the result: the JSON document, or the tables."""
    if json:
        _emit_json(result)
    else:
        _render(result, all_rows)


def _emit_json(result: InspectResult) -> None:
    from ckpt_cli.render import json as rj

    doc: dict[str, Any] = {"path": str(result.path), "kind": result.kind}
    if result.index is not None:
        doc.update(rj.index_summary(result.index))
    else:
        doc.update({"format": None, "flavor": None, "files": [], "num_files": 0,
                    "file_bytes": 0, "num_tensors": 0, "num_parameters": 0, "tied_tensors": [],
                    "total_bytes": 0,
                    "bytes_by_group": {}, "params_by_dtype": {}, "bytes_by_dtype": {},
                    "metadata": {}, "step": None, "step_source": None, "layout": {},
                    "warnings": []})
    if result.run is not None:
        doc.update(rj.run_dict(result.run))
        doc["described"] = result.described
        doc["describe_error"] = result.describe_error
        doc["final_model"] = result.final_model
    if result.tensors is not None:
        doc["tensors"] = [rj.tensor_dict(t) for t in result.tensors]
    if result.tree is not None:
        doc["tree"] = result.tree.to_dict()
    rj.emit("inspect", doc)


def _render(result: InspectResult, all_rows: bool = False) -> None:
    from rich.text import Text

    from ckpt_cli.render import human

    out = human.stdout()
    if result.run is not None:
        run = result.run
        out.print(Text(f"{result.path}  run directory, {len(run.entries):,} checkpoint(s)",
                       style="bold"))
        out.print(human.run_table(run, limit=None if all_rows else human.RUN_ROWS))
        if run.leftovers:
            out.print(Text(f"Leftovers (temporary or trash): {', '.join(run.leftovers)}",
                           style="yellow"))
        human.print_findings(run.findings)
        if result.describe_error:
            human.stderr().print(f"warning: cannot describe {result.described}: "
                                 f"{result.describe_error}")
        if result.index is None:
            return
        out.print()
        out.print(Text(f"{result.path} (final model)" if result.final_model
                       else f"{result.described} (latest complete checkpoint)", style="bold"))
    index = result.index
    if index is None:  # a plain checkpoint always has one
        return
    if result.run is None:
        out.print(Text(str(result.path), style="bold"))
    out.print(human.summary_table(index))
    out.print()
    out.print(human.group_table(index))
    if len(index.files) > 1:
        out.print()
        out.print(human.files_table(index))
    if result.tree is not None:
        out.print()
        out.print(human.module_tree(result.tree))
    if result.tensors is not None:
        out.print()
        out.print(human.tensors_table(result.tensors))
    human.print_findings(index.findings)
