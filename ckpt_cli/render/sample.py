"""Output of ``ckpt sample``."""

from __future__ import annotations

from pathlib import Path

from ckpt_cli.render import json as rj


def show(dest: Path, written: list[Path], *, json: bool) -> None:
    """Print what was written: the JSON document, or two lines."""
    if json:
        rj.emit("sample", {"path": str(dest), "checkpoints": [str(p) for p in written],
                           "export": str(dest / "export"), "latest": written[-1].name})
    else:
        from ckpt_cli.render import human  # lazy: pulls rich; --json output never does

        out = human.stdout()
        out.print(f"Wrote {dest}: {len(written)} checkpoints, an HF export in "
                  f"{dest / 'export'}, latest -> {written[-1].name}")
        out.print(f"Next: ckpt inspect {dest}")
