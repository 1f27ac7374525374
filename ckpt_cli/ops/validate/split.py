"""``validate --part K/N``: the in-depth checks of one checkpoint, split by file over N processes.

Every part reads the checkpoint's metadata and runs the structure checks (headers, index, DCP
metadata and tiling, pickle safety): they are cheap and the same everywhere. The work that
reads data, the zip structure and CRC-32 of torch files, decoding DCP items and their CRC-32,
``--values`` and manifest hashing, is done for each file by the one part the plan deals it to
(:func:`ckpt_cli.parts.assign` by size). The plan is the checkpoint's files (path and size) and
the options that change the result; every part computes the same one.

A part records what its files gave, check by check and file by file, in a receipt
(:meth:`Share.receipt`). The finalizer (the last part to finish, or ``--finalize``) runs the
structure checks again and takes each file's in-depth results from the receipt of the part
that checked it, in the order a single process would have produced them, so the merged report
and manifest are those of a single run. :class:`Share` is both sides: the files this process
checks and what they gave, and (when finalizing) what the other parts' receipts say.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpt_cli.errors import CkptError
from ckpt_cli.manifest import FileDigest, HashFn, HashStats, checkpoint_files, hash_files
from ckpt_cli.model import CheckpointIndex, Finding, TensorInfo
from ckpt_cli.ops.validate.dcpcheck import DcpReport
from ckpt_cli.ops.validate.valuecheck import TensorValues, value_file
from ckpt_cli.ops.validate.zipcheck import CrcTask
from ckpt_cli.parts import assign, source_identity
from ckpt_cli.progress import Progress

RECEIPT_VERSION = 1


def plan_files(path: Path) -> list[tuple[str, int]]:
    """The files of a checkpoint the plan deals out: those its manifest covers, with sizes.

    Relative to the checkpoint directory (for a file: its name), sorted.

    Raises:
        CkptError: The directory cannot be listed.
    """
    base = path if path.is_dir() else path.parent
    sized = ((rel, _size(base / rel)) for rel in checkpoint_files(path))
    return [(rel, size) for rel, size in sized if size is not None]


def _size(path: Path) -> int | None:
    try:
        return os.stat(path).st_size
    except OSError:
        return None  # vanished while listing: not part of the plan


def make_plan(path: Path, files: list[tuple[str, int]], options: Mapping[str, Any]
              ) -> dict[str, Any]:
    """The plan every part of a split validation computes (its fingerprint names it).

    The files' mtimes are in it too: parts of a checkpoint rewritten in place between them
    (same sizes, new bytes) refuse to merge.
    """
    base = path if path.is_dir() else path.parent
    return {"command": "validate", "checkpoint": path.name,
            "files": [list(f) for f in source_identity(base, [rel for rel, _ in files])],
            "options": dict(options)}


def _findings(items: Iterable[Any]) -> list[Finding]:
    return [Finding(d["severity"], d["code"], d["message"], d.get("file"), d.get("location"))
            for d in items]


def _dicts(findings: Iterable[Finding]) -> list[dict[str, Any]]:
    return [f.to_dict() for f in findings]


@dataclass(slots=True)
class FileWork:
    """What the in-depth checks found in one file (a torch zip, or the DCP items it holds).

    Attributes:
        zips: Zip-structure findings (of the file, or of the DCP items in it).
        crc_disabled: A torch zip written with CRC-32 turned off.
        records: CRC-32 records checked.
        crc_bytes: Their bytes.
        crc: CRC-32 mismatches.
        items: DCP items decoded (or skipped as compressed).
        undecoded: DCP items not decoded (storage transforms).
        chunks: DCP items that do not decode to what ``.metadata`` says.
        pickles: Pickle globals inside DCP items.
    """

    zips: list[Finding] = field(default_factory=list)
    crc_disabled: bool = False
    records: int = 0
    crc_bytes: int = 0
    crc: list[Finding] = field(default_factory=list)
    items: int = 0
    undecoded: int = 0
    chunks: list[Finding] = field(default_factory=list)
    pickles: list[Finding] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The receipt's form."""
        return {"zips": _dicts(self.zips), "crc_disabled": self.crc_disabled,
                "records": self.records, "crc_bytes": self.crc_bytes, "crc": _dicts(self.crc),
                "items": self.items, "undecoded": self.undecoded,
                "chunks": _dicts(self.chunks), "pickles": _dicts(self.pickles)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> FileWork:
        """Back from :meth:`to_json`."""
        return cls(_findings(d["zips"]), bool(d["crc_disabled"]), int(d["records"]),
                   int(d["crc_bytes"]), _findings(d["crc"]), int(d["items"]),
                   int(d["undecoded"]), _findings(d["chunks"]), _findings(d["pickles"]))


def _by_file(findings: Iterable[Finding]) -> dict[str | None, list[Finding]]:
    out: dict[str | None, list[Finding]] = {}
    for f in findings:
        out.setdefault(f.file, []).append(f)
    return out


class Share:
    """This process's share of a split validation, and (finalizing) the others' results.

    Args:
        owners: Each planned file's part (from 1); files outside the plan belong to part 1.
        me: This process's part, or 0 for a finalizer (which checks no file itself).
        staging: The staging directory's name (not reported as a leftover while parts run).
        receipts: When finalizing: every part's receipt, by part.
        index: The checkpoint's metadata, when this process read it already (the last part,
            finalizing, reads it once); else the validation reads it and keeps it here.
    """

    def __init__(self, owners: Mapping[str, int], me: int, *, staging: str | None = None,
                 receipts: Mapping[int, Mapping[str, Any]] | None = None,
                 index: CheckpointIndex | None = None):
        self.owners, self.me, self.staging = owners, me, staging
        self.index = index
        self.final = receipts is not None
        self.mine: dict[str, FileWork] = {}
        self.values: dict[str, TensorValues] = {}
        self.digests: dict[str, dict[str, FileDigest]] = {}
        self.hash_seconds: dict[str, float] = {}
        self.crc_seconds = 0.0
        self.aborted: Finding | None = None
        self.external: dict[str, FileWork] = {}
        self.external_values: dict[str, TensorValues] = {}
        self.external_digests: dict[str, dict[str, FileDigest]] = {}
        self.external_hash_seconds: dict[str, float] = {}
        self.external_crc_seconds = 0.0
        self.aborted_parts: dict[int, Finding] = {}
        for k, r in sorted((receipts or {}).items()):
            self._load(k, r)

    # -- ownership -----------------------------------------------------------------------------

    def owner(self, rel: str | None) -> int:
        """The part that checks ``rel`` in depth."""
        return self.owners.get(rel, 1) if rel is not None else 1

    def owns(self, rel: str) -> bool:
        """Whether this process checks ``rel`` in depth."""
        return self.owner(rel) == self.me

    def owns_tensor(self, t: TensorInfo) -> bool:
        """Whether this process scans ``t``'s values (``--values``)."""
        return self.owner(value_file(t)) == self.me

    def work(self, rel: str) -> FileWork:
        """The record of one of this process's files (created on first use)."""
        return self.mine.setdefault(rel, FileWork())

    def elsewhere(self, rel: str) -> FileWork | None:
        """What another part found in ``rel`` (None while not finalizing)."""
        return self.external.get(rel)

    def check_aborted(self) -> None:
        """Finalizing: a part whose files could not be read ends the in-depth checks, as in a
        single run.

        Raises:
            CkptError: With the first such part's read error.
        """
        for f in self.aborted_parts.values():
            raise CkptError(f.message, path=f.file)

    # -- merging, check by check ---------------------------------------------------------------

    def merge_dcp(self, rep: DcpReport) -> None:
        """Record this process's DCP files and splice the other parts' in, in file order."""
        chunks, zips, pickles = _by_file(rep.chunks), _by_file(rep.zips), _by_file(rep.pickles)
        out_chunks: list[Finding] = []
        out_zips: list[Finding] = []
        out_pickles: list[Finding] = []
        items = undecoded = 0
        for rel in rep.item_files:
            w: FileWork | None
            if self.owns(rel):
                w = self.work(rel)
                w.chunks, w.zips = chunks.get(rel, []), zips.get(rel, [])
                w.pickles = pickles.get(rel, [])
                w.items, w.undecoded = rep.decoded.get(rel, (0, 0))
            else:
                w = self.elsewhere(rel)
                if w is None:
                    continue
            out_chunks += w.chunks
            out_zips += w.zips
            out_pickles += w.pickles
            items += w.items
            undecoded += w.undecoded
        rep.chunks, rep.zips, rep.pickles = out_chunks, out_zips, out_pickles
        rep.items, rep.undecoded = items, undecoded

    def external_records(self, files: Iterable[str]) -> int:
        """CRC-32 records the other parts checked in ``files``."""
        return sum(w.records for rel in dict.fromkeys(files) if not self.owns(rel)
                   and (w := self.elsewhere(rel)) is not None)

    def merge_crc(self, files: list[str], tasks: list[CrcTask], found: list[Finding],
                  seconds: float) -> tuple[list[Finding], int, float]:
        """Record this process's CRC-32 results by file; all parts' findings in check order.

        Args:
            files: Files holding CRC records, in the order a single run checks them.
            tasks: This process's CRC tasks.
            found: Their mismatches.
            seconds: Time this process spent.

        Returns:
            ``(findings, bytes checked, seconds)``.
        """
        self.crc_seconds += seconds
        mine = _by_file(found)
        for t in tasks:
            w = self.work(t.rel)
            w.records += t.records
            w.crc_bytes += t.size
        out: list[Finding] = []
        total = 0
        for rel in dict.fromkeys(files):
            if self.owns(rel):
                w = self.work(rel)
                w.crc = mine.get(rel, [])
            elif (ext := self.elsewhere(rel)) is not None:
                w = ext
            else:
                continue
            out += w.crc
            total += w.crc_bytes
        return out, total, max(seconds, self.external_crc_seconds)

    def hasher(self, algorithm: str, *, jobs: int, on_progress: Progress | None) -> HashFn:
        """Hash this process's files (once per checksum); take the others' from receipts."""
        def run(base: Path, rels: list[str]) -> tuple[dict[str, FileDigest], HashStats]:
            have = self.digests.setdefault(algorithm, {})
            todo = [r for r in rels if self.owns(r) and r not in have]
            elsewhere = self.external_digests.get(algorithm, {})
            # A finalizer hashes what no receipt holds (a file outside the plan).
            todo += [r for r in rels if not self.owns(r) and r not in elsewhere
                     and self.final]
            got, stats = hash_files(base, todo, algorithm=algorithm, jobs=jobs,
                                    on_progress=on_progress)
            have.update(got)
            self.hash_seconds[algorithm] = self.hash_seconds.get(algorithm, 0.0) + stats.seconds
            out = {r: d for r in rels if (d := have.get(r) or elsewhere.get(r)) is not None}
            seconds = max(stats.seconds, self.external_hash_seconds.get(algorithm, 0.0))
            return out, HashStats(len(out), sum(d.size for d in out.values()), seconds,
                                  stats.threads)
        return run

    # -- receipts ------------------------------------------------------------------------------

    def receipt(self, files: list[str], report: Any) -> dict[str, Any]:
        """This part's receipt: its files and what they gave, check by check.

        Args:
            files: The files the plan gave this part.
            report: Its :class:`~ckpt_cli.ops.validate.result.CheckpointReport` (for the summary).
        """
        return {"receipt": RECEIPT_VERSION, "files": files,
                "work": {rel: w.to_json() for rel, w in sorted(self.mine.items())},
                "values": {name: [_dicts(fs), bad] for name, (fs, bad) in self.values.items()},
                "digests": {algo: {rel: [d.size, d.digest] for rel, d in sorted(ds.items())}
                            for algo, ds in self.digests.items()},
                "hash_seconds": self.hash_seconds, "crc_seconds": self.crc_seconds,
                "aborted": self.aborted.to_dict() if self.aborted else None,
                "valid": report.valid, "errors": report.errors, "warnings": report.warnings,
                "bytes_read": report.bytes_read, "seconds": round(report.seconds, 6)}

    def _load(self, k: int, r: Mapping[str, Any]) -> None:
        def ours(rel: str | None) -> bool:
            return self.owner(rel) == k

        for rel, w in r.get("work", {}).items():
            if ours(rel):
                self.external[rel] = FileWork.from_json(w)
        for name, (fs, bad) in r.get("values", {}).items():
            self.external_values[name] = (_findings(fs), bool(bad))
        for algo, ds in r.get("digests", {}).items():
            into = self.external_digests.setdefault(algo, {})
            into.update({rel: FileDigest(rel, int(size), str(digest))
                         for rel, (size, digest) in ds.items() if ours(rel)})
        for algo, s in r.get("hash_seconds", {}).items():
            self.external_hash_seconds[algo] = max(self.external_hash_seconds.get(algo, 0.0),
                                                   float(s))
        self.external_crc_seconds = max(self.external_crc_seconds,
                                        float(r.get("crc_seconds", 0.0)))
        if r.get("aborted"):
            self.aborted_parts[k] = _findings([r["aborted"]])[0]

    @property
    def values_elsewhere(self) -> Mapping[str, TensorValues]:
        """Finalizing: the other parts' ``--values`` results, by tensor."""
        return self.external_values


def owner_map(files: list[tuple[str, int]], count: int) -> dict[str, int]:
    """Each planned file's part (dealt by size, see :func:`ckpt_cli.parts.assign`)."""
    return dict(zip((rel for rel, _ in files), assign([s for _, s in files], count),
                    strict=True))
