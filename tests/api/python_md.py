"""The "Functions" section of docs/python.md, generated from the API's signatures and
docstrings (``pytest tests/api --update-golden`` writes it; tests/api/test_surface.py checks
that the page holds it as generated)."""

from __future__ import annotations

import inspect
import re

import ckpt_cli

# The order of the page: as a user meets the commands.
ORDER = ("inspect", "validate", "diff", "stats", "convert", "consolidate", "prune", "plan",
         "resume_path", "watch_once")
# Keywords whose option is not ``--`` and the keyword with dashes.
FLAGS = {"from_path": "--from", "async_save": "--async",
         "storage_options": "--storage-option KEY=VALUE", "dry_run": "--dry-run (default here)",
         "metadata": "--metadata/--no-metadata", "manifest": "--manifest/--no-manifest",
         "with_optimizer": "--with-optimizer/--model-only"}
NOT_FLAGS = {"on_progress": "(the progress bar)", "on_event": "(the lines printed)"}
COMMAND = {"resume_path": "resume-path", "watch_once": "watch --once"}
MARKER = "## Functions\n"


def _section(doc: str, name: str, following: str) -> str:
    return doc.split(f"{name}:\n", 1)[1].split(f"\n{following}:", 1)[0]


def _args(doc: str) -> dict[str, str]:
    out: dict[str, str] = {}
    current = ""
    for line in _section(doc, "Args", "Returns").splitlines():
        m = re.match(r"    (\w+): (.*)", line)
        if m:
            current = m[1]
            out[current] = m[2]
        elif current:
            out[current] += " " + line.strip()
    return out


def _markdown(text: str) -> str:
    text = re.sub(r":(?:class|func):`~?(?:[\w.]+\.)?(\w+)`", r"`\1`", text)
    return re.sub(r"(?<!`)``(?!`)", "`", text)


def functions() -> str:
    """The section's text, from ``## Functions`` to the end of the page."""
    out = [MARKER]
    for name in ORDER:
        fn = getattr(ckpt_cli, name)
        params = inspect.signature(fn).parameters.values()
        doc = inspect.getdoc(fn) or ""
        args = _args(doc)
        shown = ", ".join([p.name for p in params if p.default is p.empty] + ["..."])
        out += [f"### `ckpt_cli.{name}({shown})`: `ckpt {COMMAND.get(name, name)}`", "",
                doc.split("\n\n", 1)[0].replace("\n", " "), "",
                "| keyword | CLI | default | what |", "|---|---|---|---|"]
        for p in params:
            if p.default is p.empty:
                cli, default = "argument", ""
            else:
                flag = FLAGS.get(p.name, "--" + p.name.replace("_", "-"))
                cli, default = NOT_FLAGS.get(p.name, f"`{flag}`"), f"`{p.default!r}`"
            out.append(f"| `{p.name}` | {cli} | {default} | "
                       f"{args[p.name].replace('|', chr(92) + '|')} |")
        returns = " ".join(x.strip() for x in _section(doc, "Returns", "Raises").splitlines())
        raises = " ".join(x.strip() for x in _section(doc, "Raises", "Example").splitlines())
        example = [x.strip().removeprefix(">>> ") for x in doc.split("Example:\n", 1)[1]
                   .splitlines() if x.strip()]
        out += ["", f"Returns {returns}", "", f"Raises {raises}", "", "```python", *example,
                "```", ""]
    return _markdown("\n".join(out))
