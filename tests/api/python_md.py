"""The "Functions" section of docs/python.md (an index) and a page per function under
docs/python/, generated from the API's signatures and docstrings (``pytest tests/api
--update-golden`` writes them; tests/api/test_surface.py checks that the pages hold them as
generated). One page per function keeps every docs page short (tests/test_docs.py)."""

from __future__ import annotations

import inspect
import re

import ckpt_cli

# The order of the page: as a user meets the commands.
ORDER = ("inspect", "validate", "diff", "stats", "convert", "consolidate", "prune", "plan",
         "resume_path", "watch_once")
# Keywords whose option is not ``--`` and the keyword with dashes.
FLAGS = {"storage_options": "--storage-option KEY=VALUE", "dry_run": "--dry-run (default here)",
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


def _title(name: str) -> str:
    params = inspect.signature(getattr(ckpt_cli, name)).parameters.values()
    shown = ", ".join([p.name for p in params if p.default is p.empty] + ["..."])
    return f"`ckpt_cli.{name}({shown})`: `ckpt {COMMAND.get(name, name)}`"


def _summary(name: str) -> str:
    return (inspect.getdoc(getattr(ckpt_cli, name)) or "").split("\n\n", 1)[0].replace("\n", " ")


def functions() -> str:
    """The section's text, from ``## Functions`` to the end of docs/python.md: an index."""
    out = [MARKER, "One page per function, generated from its signature and docstring: every "
           "keyword, the option of the CLI it is, its default, what it returns and raises, "
           "and an example (run by the tests, in this order, after the examples above).", ""]
    out += [f"- [{_title(name)}](python/{name}.md): {_summary(name)}" for name in ORDER]
    return _markdown("\n".join(out) + "\n")


def pages() -> dict[str, str]:
    """Each function's page: ``{file name under docs/python/: text}``."""
    return {f"{name}.md": _page(name) for name in ORDER}


def _page(name: str) -> str:
    fn = getattr(ckpt_cli, name)
    params = inspect.signature(fn).parameters.values()
    doc = inspect.getdoc(fn) or ""
    args = _args(doc)
    out = [f"# {_title(name)}", "",
           "<!-- Generated from the docstring by `pytest tests/api --update-golden`. -->", "",
           f"Part of the [Python API](../python.md). {_summary(name)}", "",
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
