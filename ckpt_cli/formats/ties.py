"""Tied weights in formats that do not record storage sharing (DCP, safetensors, HF shards).

A torch pickle says when two names view one storage (an embedding and the output head that
reuses it), so :meth:`CheckpointIndex.distinct_tensors` counts them once. torch DCP writes such
a pair as two tensors and safetensors files hold clones, so one model's parameter count would
depend on the format. Here the same tie is found by value, cheaply:

* Candidates are model weights whose names are ones that tie (embeddings and output heads,
  as in transformers' ``_tied_weights_keys``: ``wte``, ``embed_tokens``, ``shared``,
  ``lm_head``, ``output``...), grouped by dtype and shape. Arbitrary same-shape pairs (every
  layer's projections) are never compared, so the cost does not grow with the model.
* Each candidate's bytes are sampled: three windows of :data:`WINDOW` bytes (start, middle,
  end; the whole tensor when smaller), read with positioned reads. For DCP tensors the windows
  are taken from the first, middle and last chunk (each an embedded torch.save zip whose small
  header is parsed to find the data). Equal samples and equal chunk layouts mean a tie.

Cost per candidate: at most 3 windows (12 KiB) and, for DCP, 3 embedded-zip headers; a GPT-style
checkpoint has one pair. A tie found this way is ``values``; one whose bytes could not be
sampled (compressed chunks, a strided view, a missing file) is ``unverified`` and counted twice,
and said so.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING

from ckpt_cli.errors import CkptError
from ckpt_cli.formats.dcp import locate_chunk
from ckpt_cli.model import CheckpointIndex, TensorInfo
from ckpt_cli.storage import Handle, read_full

if TYPE_CHECKING:
    import hashlib

WINDOW = 4096
"""Bytes sampled at each of a tensor's start, middle and end."""

_TIE_NAME = re.compile(
    r"(?:^|\.)(?:wte|embed_tokens|word_embeddings|tok_embeddings|token_embedding|tok_emb|"
    r"embed_in|embedding|embeddings|shared|lm_head|output|embed_out|output_layer|head|"
    r"decoder)\.weight$")
# Output heads are the tied copies (transformers lists them in _tied_weights_keys); the input
# embedding is the tensor they repeat, whatever order the file stores them in.
_HEAD_NAME = re.compile(r"(?:^|\.)(?:lm_head|output|embed_out|output_layer|head|decoder)"
                        r"\.weight$")
_MAX_CANDIDATES = 8  # per dtype and shape: names that tie are few


def find_ties(index: CheckpointIndex) -> None:
    """Record tied model weights that no storage sharing says are tied.

    Fills ``index.aliases`` (a tied copy -> the tensor it repeats, counted once) and
    ``index.possible_aliases`` (same tie-like name, dtype and shape, but the bytes could not be
    sampled: counted twice).

    Args:
        index: The checkpoint, as its reader left it.
    """
    by_sig: dict[tuple[str, tuple[int, ...]], list[TensorInfo]] = {}
    # Names one storage already ties are counted once; a clone (two storages) is compared.
    for t in index.distinct_tensors():
        if (t.group == "model" and t.kind == "dense" and t.nbytes
                and _TIE_NAME.search(t.name)):
            by_sig.setdefault((t.dtype, t.shape), []).append(t)
    groups = [sorted(g, key=lambda t: _HEAD_NAME.search(t.name) is not None)[:_MAX_CANDIDATES]
              for g in by_sig.values() if len(g) > 1]
    if not groups:
        return
    # Most checkpoints have no candidate pair: the read machinery loads only when one does.
    from ckpt_cli.storage.reads import OpenFiles  # lazy: read pools only for tie candidates

    with OpenFiles() as files:
        def fd_of(rel: str) -> Handle:
            return files.open(index.path_of(rel))

        for group in groups:
            prints = [(t, _fingerprint(index, fd_of, t)) for t in group]
            kept: dict[bytes, str] = {}
            owner = group[0].name
            for t, fp in prints:
                if fp is None:
                    if t.name != owner:
                        index.possible_aliases[t.name] = owner
                elif fp in kept:
                    index.aliases[t.name] = kept[fp]
                else:
                    kept[fp] = t.name


def _fingerprint(index: CheckpointIndex, fd_of: Callable[[str], Handle],
                 t: TensorInfo) -> bytes | None:
    """A digest of a tensor's sampled bytes (and chunk layout), or None if unreadable."""
    import hashlib  # lazy: only for tie candidates

    h = hashlib.blake2b(digest_size=16)
    try:
        if t.chunks:
            chunks = sorted(t.chunks, key=lambda c: c.offsets)
            picks = sorted({0, len(chunks) // 2, len(chunks) - 1})
            h.update(repr([(c.offsets, c.sizes) for c in chunks]).encode())
            for i in picks:
                sub = locate_chunk(index, fd_of, t, chunks[i])
                if not _sample(fd_of, sub, h):
                    return None
        elif not _sample(fd_of, t, h):
            return None
    except (CkptError, OSError):
        return None
    return h.digest()


def _sample(fd_of: Callable[[str], Handle], t: TensorInfo, h: hashlib.blake2b) -> bool:
    """Add a single-range tensor's sampled bytes to ``h``; False if it is not one (or a file
    ends too soon)."""
    if t.file is None or t.offset is None or t.stride is not None:
        return False
    n = t.nbytes
    spans = [(0, n)] if n <= 3 * WINDOW else [
        (0, WINDOW), ((n - WINDOW) // 2, WINDOW), (n - WINDOW, WINDOW)]
    for start, length in spans:
        buf = bytearray(length)
        if read_full(fd_of(t.file), t.offset + start, memoryview(buf)) < length:
            return False
        h.update(buf)
    return True
