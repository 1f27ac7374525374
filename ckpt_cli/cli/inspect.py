"""``ckpt inspect``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from ckpt_cli.cli.errors import EXIT_OK, handled
from ckpt_cli.cli.options import InputFormatOpt, JsonOpt


def inspect_cmd(
    path: Annotated[Path, typer.Argument(help="Checkpoint file, shard set, checkpoint "
                                              "directory or run directory.", show_default=False)],
    tensors: Annotated[bool, typer.Option("--tensors", "-t", help="List every tensor.")] = False,
    filter_glob: Annotated[str | None, typer.Option(
        "--filter", metavar="GLOB", help="Only tensors whose name matches GLOB "
                                         "(e.g. '*.attn.*'); implies --tensors.")] = None,
    sort: Annotated[str, typer.Option("--sort", metavar="size|name",
                                      help="Order of --tensors rows.")] = "name",
    tree: Annotated[bool, typer.Option("--tree", help="Parameters grouped by module "
                                                      "prefix.")] = False,
    depth: Annotated[int, typer.Option("--depth", min=1, help="Levels of --tree.")] = 3,
    pattern: Annotated[str | None, typer.Option(
        "--pattern", metavar="REGEX", help="Run directories: which entries are checkpoints "
                                           "(a 'step' group gives the step).")] = None,
    all_rows: Annotated[bool, typer.Option(
        "--all", help="Run directories: a row for every checkpoint (by default a long run "
                      "shows its oldest and newest few).")] = False,
    input_format: InputFormatOpt = None,
    json: JsonOpt = False,
) -> None:
    """Show what is in a checkpoint: format, tensors, parameters, dtypes, bytes, step.

    Reads headers and pickles only (never tensor data, never torch), so it is fast on
    checkpoints of any size. A run directory gets a table of its checkpoints (and an HF
    Trainer output directory its final model too).

    Examples:
      ckpt inspect model.safetensors
      ckpt inspect run/step_1000 --tree --depth 2
      ckpt inspect train.pt --tensors --filter '*.attn.*' --sort size
      ckpt inspect run/ --json
      ckpt inspect run/ --all
    """
    from ckpt_cli.ops.inspect import inspect

    with handled() as outcome:
        result = inspect(path, fmt=input_format, tensors=tensors, filter_glob=filter_glob,
                         sort=sort, tree=tree, depth=depth, pattern=pattern)
        outcome.exit_code = EXIT_OK
        if json:
            _emit_json(result)
        else:
            _render(result, all_rows)


def _emit_json(result: Any) -> None:
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


def _render(result: Any, all_rows: bool = False) -> None:
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
