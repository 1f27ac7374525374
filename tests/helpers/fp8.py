"""FP8 checkpoints made by ``ckpt convert --to fp8``, one per layout, for the fp8 tests."""

from __future__ import annotations

from pathlib import Path

LAYOUTS = ("block", "channel", "tensor")


def convert_each_layout(src: Path, base: Path, *args: str) -> dict[str, Path]:
    """``ckpt convert SRC --to fp8 --fp8-layout L -o BASE/L ARGS`` for each layout; layout ->
    output directory. Each conversion must succeed."""
    from tests.conftest import run_cli

    outs = {}
    for layout in LAYOUTS:
        r = run_cli("convert", src, "--to", "fp8", "--fp8-layout", layout, "-o",
                    base / layout, *args)
        assert r.exit_code == 0, r.output
        outs[layout] = base / layout
    return outs
