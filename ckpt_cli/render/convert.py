"""Output of ``ckpt convert``: the JSON document or the human summary."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckpt_cli.optionspec import word
from ckpt_cli.render import json as rj
from ckpt_cli.tensors.cast import kept_summary

if TYPE_CHECKING:
    from ckpt_cli.ops.convert.result import ConvertResult


def show(r: ConvertResult, *, json: bool, quiet: bool) -> None:
    """Print the result: warnings and notes on stderr, the summary or JSON on stdout."""
    from ckpt_cli.render.human import show_written  # lazy: pulls rich; --json output never does

    show_written(r, json=json, quiet=quiet, emit=_emit_json, summary=_render)


def _emit_json(r: ConvertResult) -> None:
    rj.emit_result(r)


def _render(r: ConvertResult, quiet: bool) -> None:
    from ckpt_cli.render import human  # lazy: pulls rich; --json output never does

    out = human.stdout()
    files = len(r.write.files)
    took = human.duration(r.seconds, short=True)
    out.print(f"Wrote {r.output}: {len(r.tensors):,} tensors, {human.size(r.write.tensor_bytes)} "
              f"in {files} file{'s' if files != 1 else ''} ({took})")
    if r.casts:
        out.print("Cast: " + ", ".join(f"{k} x{v}" for k, v in sorted(r.casts.items())))
    if r.kept or r.kept_scales:
        out.print("Kept: " + kept_summary(r.kept, r.kept_scales))
    if any(r.kept_fp32.values()):
        out.print("Kept in FP32: " + "; ".join(
            f"{len(names)} matching {g!r}" + (f" ({', '.join(names[:3])}"
                                              f"{', ...' if len(names) > 3 else ''})"
                                              if names else "")
            for g, names in r.kept_fp32.items()))
    if r.config_dtype:
        c = r.config_dtype
        out.print(f"Config: {c['file']} {', '.join(c['keys'])} {c['from']} -> {c['to']}")
    dropped = {g: n for g, n in r.dropped.items() if n}
    if dropped:
        out.print("Dropped: " + ", ".join(f"{g} {n}" for g, n in sorted(dropped.items())))
    if r.renamed:
        out.print("Names: " + "; ".join(r.renamed))
    if r.aliases:
        out.print("Tied (written once): " + ", ".join(f"{a} -> {k}" for a, k in
                                                     sorted(r.aliases.items())))
    if not quiet:
        err = human.stderr()
        for note in r.notes:
            err.print(f"note: {word(note, 'cli')}", soft_wrap=True)
