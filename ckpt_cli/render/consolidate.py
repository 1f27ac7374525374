"""Output of ``ckpt consolidate``: the JSON document or the human summary."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckpt_cli.optionspec import word
from ckpt_cli.render import json as rj
from ckpt_cli.tensors.cast import kept_summary

if TYPE_CHECKING:
    from ckpt_cli.ops.consolidate import ConsolidateResult


def show(r: ConsolidateResult, *, json: bool, quiet: bool) -> None:
    """Print the result: warnings and notes on stderr, the summary or JSON on stdout."""
    from ckpt_cli.render.human import show_written  # lazy: pulls rich; --json output never does

    show_written(r, json=json, quiet=quiet, emit=_emit_json, summary=_render)


def _emit_json(r: ConsolidateResult) -> None:
    rj.emit_result(r)


def _render(r: ConsolidateResult, quiet: bool) -> None:
    from ckpt_cli.render import human  # lazy: pulls rich; --json output never does

    out = human.stdout()
    after = len(r.write.files)
    out.print(f"{r.files_before:,} files ({human.size(r.bytes_before)}) -> {after} file"
              f"{'s' if after != 1 else ''} ({human.size(sum(b for _, b in r.write.files))})")
    facts = ", ".join(f"{k} {v}" for k, v in r.details.items() if v is not None)
    out.print(f"Wrote {r.output}: {r.tensors:,} tensors, {human.size(r.write.tensor_bytes)} "
              f"from a {r.kind} checkpoint" + (f" ({facts})" if facts else "")
              + f" in {human.duration(r.seconds, short=True)}", soft_wrap=True)
    out.print(kept_line(r))
    if r.kept or r.kept_scales:
        out.print("Kept as is: " + kept_summary(r.kept, r.kept_scales))
    dropped = {g: n for g, n in r.dropped.items() if n}
    if dropped:
        out.print("Left out: " + ", ".join(
            f"{n:,} {g} tensor{'s' if n != 1 else ''}"
            + (" (--with-optimizer keeps them)" if g == "optimizer" else "")
            for g, n in sorted(dropped.items())))
    if r.aliases:
        out.print("Shared (written once): " + ", ".join(f"{a} -> {k}" for a, k in
                                                       sorted(r.aliases.items())))
    if r.verified is not None:
        out.print(f"Verified: {r.verified:,} tensors equal their sources")
    if not quiet:
        for note in r.notes:
            human.stderr().print(f"note: {word(note, 'cli')}", soft_wrap=True)


def kept_line(r: ConsolidateResult) -> str:
    """What the output holds of the tensors selected: all their elements, or how many are
    missing (the tensors left out on purpose are counted on the ``Left out`` line)."""
    kept = f"Kept: {r.tensors:,} tensor{'s' if r.tensors != 1 else ''}"
    if not r.lost_elements:
        return f"{kept}, all {r.elements_out:,} of their elements"
    return (f"{kept}, {r.elements_out:,} of their {r.elements_in:,} elements "
            f"({r.lost_elements:,} missing)")
