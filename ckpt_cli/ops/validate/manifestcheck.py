"""The integrity manifest check: verify ``ckpt-manifest.json`` against the files when there is
one, and write (or refresh) it when asked and the checkpoint is valid; with ``--part``, hash
this part's files only and leave the writing to the finalizer."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ckpt_cli.errors import CkptError
from ckpt_cli.manifest import (
    Verification,
    compute_manifest,
    manifest_path,
    read_manifest,
    verify_manifest,
    write_manifest,
)
from ckpt_cli.model import Finding
from ckpt_cli.ops.validate.builder import RATE_MIN, Builder, rel_path
from ckpt_cli.ops.validate.result import ManifestResult

if TYPE_CHECKING:
    from ckpt_cli.ops.validate.options import Options

def check_manifest(b: Builder, path: Path, opts: Options, *,
                   has_errors: bool) -> ManifestResult | None:
    """Verify the manifest if there is one; write one if asked and the checkpoint is valid."""
    mpath = manifest_path(path)
    try:
        existing = read_manifest(path)
    except CkptError as e:
        b.add("manifest", [Finding("error", "bad-manifest", e.message, mpath.name)],
              "the manifest is unreadable")
        return ManifestResult(mpath, "unreadable")
    result = ManifestResult(mpath, "absent")
    verification: Verification | None = None
    share = opts.share
    partial = share is not None and not share.final  # one part: its own files only
    if existing is not None:
        try:
            verification = verify_manifest(
                path, jobs=opts.jobs, on_progress=opts.on_progress, manifest=existing,
                hasher=share.hasher(existing.algorithm, jobs=opts.jobs,
                                    on_progress=opts.on_progress) if share else None)
        except CkptError as e:
            b.add("manifest", [Finding("error", "manifest-unverifiable", e.message,
                                       rel_path(e.path, path))], "could not hash the files")
            return ManifestResult(mpath, "unreadable", existing.algorithm)
        assert verification is not None
        result = ManifestResult(mpath, "verified", existing.algorithm)
        result.add_stats(verification.stats)
        result.changed = sorted([*verification.changed, *verification.missing,
                                 *(r for r, _, _ in verification.resized)])
        result.extra = verification.extra
        bad = len(result.changed)
        rate = f", {result.throughput / 1e9:.2f} GB/s" if result.bytes > RATE_MIN else ""
        listed = len(existing.files)
        if partial:  # of this part's files: the others are compared by their parts
            listed = len(set(existing.files) & set(verification.actual)) + bad
        b.add("manifest", verification.findings(mpath.name),
              f"{listed - bad} of {listed} file(s) {'of this part ' if partial else ''}match "
              f"({existing.algorithm}{rate})")
    if not opts.write_manifest:
        if existing is None:
            b.skip("manifest", "none (--write-manifest records one)")
        return result
    damaged = verification is not None and bool(
        verification.changed or verification.resized or verification.missing)
    if has_errors or damaged:
        why = ("the checkpoint has errors" if has_errors else
               "the existing manifest disagrees with the files")
        b.add("manifest", [Finding("error", "manifest-not-written",
                                   f"manifest not written: {why}", mpath.name)])
        result.action = "not-written"
        return result
    if (verification is not None and verification.ok and existing is not None
            and existing.algorithm == opts.manifest_algorithm):
        manifest = existing  # unchanged files, same checksum: keep the original record
        written, stats = mpath, None
    else:
        try:
            manifest, stats = compute_manifest(
                path, algorithm=opts.manifest_algorithm, jobs=opts.jobs,
                on_progress=opts.on_progress,
                hasher=share.hasher(opts.manifest_algorithm, jobs=opts.jobs,
                                    on_progress=opts.on_progress) if share else None)
            if partial:
                result.action, result.algorithm = "pending", manifest.algorithm
                result.add_stats(stats)
                b.add("manifest", [], f"hashed {len(manifest.files)} file(s) of this part "
                      f"({manifest.algorithm}); {mpath.name} is written when every part is "
                      "done")
                return result
            written, manifest, _ = write_manifest(path, manifest=manifest)
        except CkptError as e:  # one unwritable checkpoint must not end a run's validation
            b.add("manifest", [Finding("error", "manifest-not-written",
                                       f"manifest not written: {e.message}", mpath.name)])
            result.action = "not-written"
            return result
    result.action = "written" if stats is not None else "verified"
    result.algorithm = manifest.algorithm
    result.add_stats(stats)
    rate = f", {stats.throughput / 1e9:.2f} GB/s" if stats and stats.bytes > RATE_MIN else ""
    b.add("manifest", [], f"{'wrote' if stats else 'kept'} {written.name}: "
          f"{len(manifest.files)} file(s), {manifest.algorithm}{rate}")
    return result
