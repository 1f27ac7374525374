"""Megatron-LM legacy checkpoints: ``iter_NNNNNNN/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt``.

Each rank directory holds one torch zip with ``args`` (an ``argparse.Namespace``, read as
data), ``iteration``, ``model``/``model<i>``, ``optimizer``, ``rng_state``... The newer
``torch_dist`` format is a DCP directory plus ``metadata.json`` and is read by the DCP reader.
"""

from __future__ import annotations

import re
from pathlib import Path

from ckpt_cli.errors import CkptError, UnknownFormatError
from ckpt_cli.formats import torchfile
from ckpt_cli.formats.base import DirectoryLayout
from ckpt_cli.model import CheckpointIndex, FileInfo, Finding

RANK_DIR = re.compile(r"^mp_rank_(?P<tp>\d{2})(?:_(?P<pp>\d{3}))?(?:_(?P<ep>\d{3}))?\Z")
RANK_FILES = ("model_optim_rng.pt", "distrib_optim.pt")


def rank_dirs(path: Path) -> list[tuple[Path, int, int, int]]:
    """``(dir, tp, pp, ep)`` for every ``mp_rank_*`` directory, sorted."""
    out = []
    for p in path.iterdir():
        m = RANK_DIR.match(p.name)
        if m and p.is_dir():
            out.append((p, int(m.group("tp")), int(m.group("pp") or 0), int(m.group("ep") or 0)))
    return sorted(out, key=lambda r: (r[3], r[2], r[1]))


class MegatronReader(DirectoryLayout):
    """Reads a Megatron-LM legacy iteration directory."""

    name = "megatron"
    missing = "no mp_rank_XX directories"

    def recognises(self, path: Path) -> bool:
        """``mp_rank_XX`` directories."""
        return bool(rank_dirs(path))

    def read_index(self, path: Path) -> CheckpointIndex:
        """See :meth:`ckpt_cli.formats.base.Reader.read_index`."""
        ranks = rank_dirs(path)
        if not ranks:
            raise UnknownFormatError("no mp_rank_XX directories", path=path)
        index = CheckpointIndex(format=self.name, root=path, base=path, flavor="megatron")
        single = len(ranks) == 1
        for d, *_ in ranks:
            files = [d / f for f in RANK_FILES if (d / f).is_file()]
            if not files:
                index.add(Finding("error", "missing-file",
                                  "rank directory has no model_optim_rng.pt", d.name))
            for f in files:
                role = "optimizer" if f.name == "distrib_optim.pt" else "weights"
                prefix = "" if single and role == "weights" else (
                    f"{d.name}." if role == "weights" else f"{d.name}.distrib_optim.")
                try:
                    torchfile.read_into(index, f, role=role, prefix=prefix)
                except CkptError as e:
                    index.add(Finding("error", "bad-file", e.message, f"{d.name}/{f.name}"))
                    index.files.append(FileInfo(f"{d.name}/{f.name}", f.stat().st_size, role,
                                                None))
        _layout(index, ranks)
        return index


def _layout(index: CheckpointIndex, ranks: list[tuple[Path, int, int, int]]) -> None:
    tps = {r[1] for r in ranks}
    pps = {r[2] for r in ranks}
    eps = {r[3] for r in ranks}
    index.layout.update({"tp": len(tps), "pp": len(pps), "ep": len(eps),
                         "world_size": len(ranks)})
    args = index.metadata.get("args")
    if not isinstance(args, dict):
        return
    for key, found, label in (("tensor_model_parallel_size", len(tps), "tensor"),
                              ("pipeline_model_parallel_size", len(pps), "pipeline")):
        want = args.get(key)
        if isinstance(want, int) and want != found:
            index.add(Finding("error", "world-size",
                              f"args say {label}-parallel size {want} but there are {found} "
                              f"{label}-parallel rank director{'y' if found == 1 else 'ies'}"))
    expected = {(t, p) for t in range(len(tps)) for p in range(len(pps))}
    present = {(r[1], r[2]) for r in ranks}
    missing = sorted(expected - present)
    if missing:
        index.add(Finding("error", "missing-rank",
                          f"rank directories missing for (tp, pp) = {missing[:8]}"))
