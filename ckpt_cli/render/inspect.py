"""Output of ``ckpt inspect``: the JSON document or the human summary."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckpt_cli.model import Finding
from ckpt_cli.render import json as rj

if TYPE_CHECKING:
    from ckpt_cli.ops.inspect import InspectResult
    from ckpt_cli.render.human import FitTable


def show(result: InspectResult, *, json: bool, all_rows: bool = False) -> None:
    """Print the result: the JSON document, or the tables."""
    if json:
        _emit_json(result)
    else:
        _render(result, all_rows)


def _emit_json(result: InspectResult) -> None:
    rj.emit_result(result)


def _render(result: InspectResult, all_rows: bool = False) -> None:
    from rich.text import Text  # heavy: rich

    from ckpt_cli.render import human  # lazy: pulls rich; --json output never does
    from ckpt_cli.render import inspect_tables as tables  # lazy: pulls rich, unlike --json

    out = human.stdout()
    if result.run is not None:
        run = result.run
        out.print(human.Folded(f"{result.path}  run directory, {len(run.entries):,} "
                               "checkpoint(s)", style="bold"))
        out.print(tables.run_table(run, limit=None if all_rows else tables.RUN_ROWS))
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
        out.print(human.Folded(f"{result.path} (final model)" if result.final_model
                               else f"{result.described} (latest complete checkpoint)",
                               style="bold"))
    index = result.index
    if index is None:  # a plain checkpoint always has one
        return
    if result.run is None:
        out.print(human.Folded(str(result.path), style="bold"))
    out.print(tables.summary_table(index))
    out.print()
    out.print(tables.group_table(index))
    if result.quantization is not None:
        out.print()
        out.print(Text("Quantization", style="bold"))
        out.print(quantization_grid(result.quantization))
    if len(index.files) > 1:
        out.print()
        out.print(tables.files_table(index))
    if result.tree is not None:
        out.print()
        out.print(tables.module_tree(result.tree))
    if result.tensors is not None:
        out.print()
        out.print(tables.tensors_table(result.tensors,
                                       limit=None if all_rows else tables.TENSOR_ROWS))
    human.print_findings(index.findings)
    if result.quantization is not None:
        human.print_findings(_problems(result.quantization))


def _problems(q: dict[str, Any]) -> list[Finding]:
    return [Finding(p["severity"], p["code"], p["message"], p["file"], p["location"])
            for p in q["problems"]]


def quantization_grid(q: dict[str, Any]) -> FitTable:
    """The quantization scheme of :func:`ckpt_cli.fp8.scheme.describe` as a grid."""
    from ckpt_cli.render import human  # lazy: pulls rich; --json output never does

    g = human.grid()
    layout = q["layout"]
    if layout is None:
        text = "none recognised (no FP8 weight paired with a scale)"
    elif layout == "mixed":
        text = "mixed: " + ", ".join(f"{n:,} per {k}" for k, n in sorted(q["layouts"].items()))
    elif layout == "block":
        bs = q["block_size"] or []
        text = "block, " + "x".join(str(x) for x in bs) + " (one scale per block)"
    else:
        text = f"{layout} (one scale per {'output row' if layout == 'channel' else 'tensor'})"
    g.add_row("Layout", text)
    if q["scale_convention"]:
        dts = ", ".join(f"{k} {n:,}" for k, n in sorted(q["scale_dtypes"].items()))
        g.add_row("Scales", f"{q['scale_convention']}; {dts}")
    fp8 = ", ".join(f"{k} {n:,}" for k, n in sorted(q["weight_dtypes"].items())) or "none"
    line = (f"{q['quantized']:,} weight(s) quantized ({fp8}), each paired with its scale; "
            f"{q['unquantized_weights']:,} 2-D weight(s) left unquantized "
            f"({q['unquantized_ignored']:,} in the ignore list)")
    if q["activation_scales"]:
        line += f"; {q['activation_scales']:,} activation scale(s)"
    g.add_row("Tensors", line)
    if q["ignore"]:
        shown = ", ".join(q["ignore"][:5]) + (f" and {len(q['ignore']) - 5} more"
                                              if len(q["ignore"]) > 5 else "")
        g.add_row("Ignore list", f"{len(q['ignore']):,} module(s): {shown}")
    if q["fp8_tensors"]:
        g.add_row("Bytes", f"{human.size(q['fp8_bytes'])} FP8 + {human.size(q['scale_bytes'])} "
                           f"scales vs {human.size(q['bf16_bytes'])} in BF16: "
                           f"{human.size(q['bytes_saved'])} saved (the checkpoint would be "
                           f"{human.size(q['bf16_total_bytes'])} in BF16)")
    c = q["config"]
    if c is None:
        g.add_row("Config", "no quantization_config (config.json or ckpt metadata)")
    else:
        facts = [f"quant_method {c['quant_method']}"]
        facts += [f"{k} {c[k]}" for k in ("format", "strategy", "activation_scheme")
                  if c[k] is not None]
        if c["weight_block_size"] is not None:
            facts.append(f"weight_block_size {c['weight_block_size']}")
        if c["targets"]:
            facts.append(f"targets {', '.join(c['targets'])}")
        g.add_row("Config", f"{', '.join(facts)} (from {c['source']})")
    return g
