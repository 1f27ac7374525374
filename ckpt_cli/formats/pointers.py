"""Pointer files: what ``latest`` (DeepSpeed, ckpt sample), ``latest_checkpointed_iteration.txt``
(Megatron), ``latest_universal`` and ``last*.ckpt`` symlinks (Lightning) name in a run directory.

The one parser of pointer files (:func:`read_pointer`), shared by the run listing (prune,
inspect), validate and the commands that follow a resume pointer
(:func:`ckpt_cli.runs.follow_pointer`). Reads only the pointers, never a checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path

from ckpt_cli import storage
from ckpt_cli.dtypes import strict_int
from ckpt_cli.errors import CkptError
from ckpt_cli.model import POINTER_UNREADABLE, Finding

POINTER_FILES = ("latest", "latest_checkpointed_iteration.txt", "latest_universal")


class PointerError(Exception):
    """A pointer file exists but what it names cannot be told."""


def read_pointer(root: Path, name: str) -> str | None:
    """What a pointer file names: None when there is no such file.

    The one parser of pointer files, shared by the run listing (prune, inspect) and validate.

    Raises:
        PointerError: The file exists but cannot be read or parsed.
    """
    p = root / name
    try:
        if p.is_symlink():
            return _pointer_target(root, os.readlink(p))
        if not p.exists():
            return None
        if not p.is_file():
            raise PointerError("not a regular file")
        data = storage.read_side(p, "pointer")  # regular files only, at most 4 KiB
    except OSError as e:
        raise PointerError(e.strerror or str(e)) from None
    except CkptError as e:
        raise PointerError(e.message) from None
    if data is None:
        return None
    text = data.decode(errors="replace").strip()
    if not text or not text.replace("\n", "").replace("\r", "").isprintable():
        # Empty, or zero-filled after a crash, or binary: what it named is unknown.
        raise PointerError("empty or unreadable (being rewritten, or damaged?)")
    if name == "latest_checkpointed_iteration.txt":
        if text == "release":
            return "release"
        iteration = strict_int(text)
        if iteration is None:
            raise PointerError(f"{text[:40]!r} is not an iteration number")
        return f"iter_{iteration:07d}"
    target = _pointer_target(root, text.splitlines()[0].strip())
    if not target:
        raise PointerError(f"{text[:40]!r} names no checkpoint")
    return target


def _pointer_target(root: Path, raw: str) -> str:
    """The entry of ``root`` a pointer names: the first component of its path below ``root``.

    ``step_200``, ``./step_200``, ``step_200/model.pt`` and ``/abs/run/step_200/x`` all name
    ``step_200``. A path outside ``root`` (``..``, another directory) names nothing here and
    comes back as is, so it is reported as dangling.
    """
    p = Path(os.path.normpath(raw))  # run/step_6/../step_2 names step_2
    if p.is_absolute():
        try:
            p = p.relative_to(root.resolve())
        except ValueError:
            try:
                p = p.relative_to(root.absolute())
            except ValueError:
                # Through a symlinked directory (/runs/link/step_2 with /runs/link -> run):
                # the first ancestor that resolves to the run directory.
                real, above = root.resolve(), p.parts
                at = next((i for i in range(2, len(above))
                           if Path(os.path.realpath(Path(*above[:i]))) == real), None)
                if at is None:
                    return raw
                p = Path(*above[at:])
    parts = [q for q in p.parts if q != "."]
    if not parts or parts[0] == "..":
        return raw
    return parts[0]


def read_pointers(root: Path, links: list[str] | None = None,
                  ) -> tuple[dict[str, str], list[Finding]]:
    """The pointer files of a run directory and what each names.

    Pointers are ``latest`` (DeepSpeed, ckpt sample), ``latest_checkpointed_iteration.txt``
    (Megatron), ``latest_universal`` and ``last*.ckpt`` symlinks (Lightning ``save_last="link"``).

    Args:
        root: The run directory.
        links: The ``last*.ckpt`` names to check, when already known (re-reading pointers once
            per checkpoint must not list a directory of thousands each time); by default the
            directory is searched for them.

    Returns:
        ``({pointer file: entry name}, findings)``; a pointer that exists but cannot be read or
        parsed gives a ``pointer-unreadable`` warning instead of an entry.
    """
    pointers: dict[str, str] = {}
    findings: list[Finding] = []
    for name in POINTER_FILES:
        try:
            target = read_pointer(root, name)
        except PointerError as e:
            findings.append(Finding("warning", POINTER_UNREADABLE,
                                    f"cannot tell what {name} names: {e}", name))
            continue
        if target:
            pointers[name] = target
    for link in (sorted(root.glob("last*.ckpt")) if links is None
                 else [root / name for name in links]):
        if link.is_symlink():
            try:
                pointers[link.name] = Path(os.readlink(link)).name
            except OSError as e:
                findings.append(Finding("warning", POINTER_UNREADABLE,
                                        f"cannot read the link {link.name}: {e.strerror}",
                                        link.name))
    return pointers, findings
