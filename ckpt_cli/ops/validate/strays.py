"""Pickles inside a checkpoint directory that its format does not read.

A ``pytorch_model.bin`` beside ``model.safetensors``, DeepSpeed's pipeline ``layer_*`` files,
a DeepSpeed tag directory inside an HF Trainer checkpoint: ckpt describes the checkpoint by
the files its format names, but other tools ``torch.load`` these (DeepSpeed's resume does, with
``weights_only=False``). Their pickles are judged like every other (issue #23).
"""

from __future__ import annotations

import re
from pathlib import Path

from ckpt_cli import storage
from ckpt_cli.errors import CkptError
from ckpt_cli.formats import allowlist, torchfile
from ckpt_cli.formats.base import rel_to
from ckpt_cli.formats.unpickler import scan_stream
from ckpt_cli.model import CheckpointIndex, Finding
from ckpt_cli.storage import open_regular

PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".pkl", ".pickle", ".tar")
_CODES = ("unsafe-global", "unknown-global", "unscanned-pickle", "torchscript-archive",
          "pickle-after-stop")
_MAX_FILES = 4096
_RUN_CHECKPOINT = re.compile(r"checkpoint-\d+")
_MAX_DEPTH = 3
_SCAN_BYTES = 256 << 20


def stray_pickle_findings(index: CheckpointIndex, path: Path) -> list[Finding]:
    """The pickle-safety findings of the pickle files under a checkpoint directory that the
    checkpoint's reader did not read.

    Args:
        index: The checkpoint's index (its files are skipped).
        path: The checkpoint (nothing is done for a file).

    Returns:
        ``unsafe-global``/``unknown-global``/``unscanned-pickle`` findings (and an error for a
        pickle file that cannot be read at all), named by the file.
    """
    if not path.is_dir():
        return []
    read = {f.path for f in index.files}
    out: list[Finding] = []
    seen = 0
    for d, dirs, files in storage.walk(path):
        depth = len(Path(d).relative_to(path).parts)
        # HF Trainer's checkpoint-N beside a final model are the run's own checkpoints,
        # validated as such; anything else below is part of this checkpoint.
        dirs[:] = sorted(n for n in dirs if not n.startswith(".") and depth < _MAX_DEPTH
                         and not _RUN_CHECKPOINT.fullmatch(n))
        for name in sorted(files):
            if not name.lower().endswith(PICKLE_SUFFIXES):
                continue
            p = Path(d) / name
            rel = rel_to(p, index.base)
            if rel in read or seen >= _MAX_FILES:
                continue
            seen += 1
            scratch = CheckpointIndex(format="torch", root=p, base=index.base)
            try:
                torchfile.read_into(scratch, p, role=torchfile.role_of(name), prefix="")
            except CkptError as e:
                # Unreadable as a checkpoint: still refused if its pickles name anything
                # outside the allowlist (what torch.load would have run before failing).
                if _names_refused_globals(p):
                    out.append(Finding("error", "unsafe-global", e.message, rel))
                continue  # not a pickle torch would run: other checks say what it is
            out.extend(f for f in scratch.findings if f.code in _CODES)
    return out


def _names_refused_globals(path: Path) -> bool:
    """Whether a file's pickles (a zip's ``.pkl`` records by their local headers, or the
    pickles of a plain stream) name a global no allowlist accepts, or modify one."""

    fd = open_regular(path)
    try:
        size = storage.size_of(fd)
        if storage.pread(fd, 4, 0) == torchfile.ZIP_MAGIC:
            seen = torchfile.pickle_records_seen(fd, 0, size)
        else:
            seen = scan_stream(storage.pread(fd, min(size, _SCAN_BYTES), 0))
    finally:
        storage.close(fd)
    return bool(allowlist.refused_names(seen.globals) or seen.builds)
