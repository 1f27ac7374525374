"""Names that checkpoint writers give: the step a name encodes, "last" copies, the
temporary and trash names of saves in progress, and the name of ckpt's own manifest.

Readers and the run listing (:mod:`ckpt_cli.runs`) share these conventions.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ckpt_cli import storage
from ckpt_cli.dtypes import strict_int

FILE_EXTENSIONS = (".pt", ".pth", ".bin", ".ckpt", ".safetensors", ".tar")
_NAME_PATTERNS = (
    re.compile(r"^checkpoint-(?P<step>\d+)\Z"),
    re.compile(r"^global_step(?P<step>\d+)\Z"),
    re.compile(r"^iter_(?P<step>\d+)\Z"),
    re.compile(r"(?:^|[-_])step[=_-]?(?P<step>\d+)(?:\Z|[-_.])"),
    re.compile(r"^(?:checkpoint|ckpt|model|iter|iteration|epoch|save|state)[_-]?(?P<step>\d+)"
               r"(?:\.[a-z]+)?\Z"),
    re.compile(r"^(?P<step>\d+)(?:\.[a-z]+)?\Z"),
)
# Any name ending in a number: fine for listing, too loose to delete by (see ``strict``).
_LOOSE_FILE_PATTERN = re.compile(r"^.+?[_-](?P<step>\d+)\.(?:pt|pth|bin|ckpt|safetensors)\Z")
TEMP_MARKERS = (".tmp", "-tmp-", ".ckpt-tmp-", ".partial", ".incomplete", ".orbax-checkpoint-tmp",
                ".ckpt-trash-", "_tmp", ".ckpt-old-")
TRASH_PREFIX = ".ckpt-trash-"
"""Prefix of an entry ``ckpt prune`` renamed out of the checkpoint namespace before removing it."""


_NAME_MAX = 255
OWN_TEMP_MARKERS = (".ckpt-tmp-", ".ckpt-old-")
"""What ckpt's own temporary names hold (``storage.atomic.tmp_sibling``, swaps)."""
_PARTS_STAGING = ".ckpt-tmp-parts"  # a --part job's staging: its own lifecycle and lock
MANIFEST_NAME = "ckpt-manifest.json"
"""The integrity manifest's name inside a checkpoint directory (:mod:`ckpt_cli.manifest`)."""
MANIFEST_SUFFIX = ".ckpt-manifest.json"
"""Appended to a single-file checkpoint's name for its manifest."""


def manifest_path(checkpoint: Path) -> Path:
    """Where the manifest of a checkpoint (directory or single file) lives.

    Here rather than in :mod:`ckpt_cli.manifest` (which re-exports it) so that a writer
    dropping a stale manifest does not load the hashing module.
    """
    checkpoint = storage.locate(checkpoint)
    if checkpoint.is_dir():
        return checkpoint / MANIFEST_NAME
    return checkpoint.parent / (checkpoint.name + MANIFEST_SUFFIX)


WRAPPERS: tuple[str, ...] = ("module.", "_orig_mod.")
"""Name prefixes wrappers put before every weight: DDP and DeepSpeed (``module.``),
torch.compile (``_orig_mod.``); they nest in any order."""

CONTAINERS: tuple[str, ...] = ("model.", "state_dict.", "model_state_dict.")
"""Name prefixes of the containers a model's weights are saved under: a training dict's
``model``, Lightning's ``state_dict``, the PyTorch tutorial's ``model_state_dict``."""

def is_own_temporary(name: str) -> bool:
    """Whether a name is one of ckpt's own temporaries or trash (what a write or a prune
    killed midway leaves): the one pattern the sweeper removes. A split job's staging
    directory (``.ckpt-tmp-parts``) is not: the parts finish or clean it."""
    if _PARTS_STAGING in name:
        return False
    return name.startswith(TRASH_PREFIX) or any(m in name for m in OWN_TEMP_MARKERS)


def fit_name(name: str, suffix: str = "") -> str:
    """Shorten a name so that with ``suffix`` it fits the 255-byte limit of file names."""
    # fsencode keeps undecodable bytes of odd names (surrogateescape) instead of failing.
    raw = os.fsencode(name)
    room = _NAME_MAX - len(os.fsencode(suffix))
    if len(raw) > room:
        name = os.fsdecode(raw[:room])
    return name + suffix


def is_leftover(name: str) -> bool:
    """Whether a name is a temporary (being written) or trash entry, never a checkpoint."""
    return name.startswith(TRASH_PREFIX) or any(m in name for m in TEMP_MARKERS) or (
        name.startswith("tmp") and not name[3:4].isdigit())


def in_progress_reason(name: str) -> str | None:
    """Why a checkpoint's own name says it is unfinished (a writer's temporary name), or None.

    The markers of :func:`is_leftover`, except the bare ``tmp`` prefix, which
    ``tempfile.mkdtemp`` gives to directories anyone may save finished checkpoints in.
    """
    if name.startswith(TRASH_PREFIX) or ".ckpt-old-" in name:
        return "named like ckpt's trash: it was being deleted or replaced"
    if name.startswith("tmp-checkpoint-"):
        return "named like HF Trainer's temporary save (tmp-checkpoint-*): not renamed yet"
    marker = max((m for m in TEMP_MARKERS if m in name), key=len, default=None)
    if marker is None:
        return None
    return f"its name marks an unfinished save ({marker!r}): the writer renames it when done"


def step_from_name(name: str, *, strict: bool = False) -> int | None:
    """The step a checkpoint's name encodes, or None.

    Args:
        name: A file or directory name.
        strict: Ignore the catch-all "anything ending in ``_<number>.pt``" pattern.

    Returns:
        The step, or None.
    """
    for pat in _NAME_PATTERNS if strict else (*_NAME_PATTERNS, _LOOSE_FILE_PATTERN):
        m = pat.search(name)
        if m:
            return strict_int(m.group("step"))
    return None


def is_last_copy(name: str) -> bool:
    """Whether a name is a "last" checkpoint that training resumes from.

    Lightning's ``last.ckpt``/``last-v1.ckpt`` and NeMo's ``...-last.ckpt``, whatever step.

    Args:
        name: A file or directory name.

    Returns:
        True for such names.
    """
    stem = name.removesuffix(".ckpt")
    return name.startswith("last") or stem.endswith("-last")
