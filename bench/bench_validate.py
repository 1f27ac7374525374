"""Benchmark: ``ckpt validate`` against what a user would otherwise run to check a checkpoint.

On the ~4.7 GB torch training checkpoint (warm page cache, fresh processes, fastest of N):

* full default validation (structure + CRC-32 of every record) against
  ``python -c "import zipfile; zipfile.ZipFile(p).testzip()"`` (CRC only) and ``sha256sum``;
* manifest hashing throughput (``--write-manifest``, then verification) against
  ``cat FILE > /dev/null`` (reading the file from page cache), target >= 70%;
* ``--values`` (every floating tensor read and checked), for its time and peak memory.

With ``--parts``: ``validate --write-manifest`` of a 256-rank-file DCP checkpoint as two
concurrent processes (``--part 1/2`` and ``--part 2/2``, the last one merging the report and
writing the manifest) against one process, target >= 1.6x on a 2-core machine; and the same
for 1,024 rank files, to show the cost is linear in bytes and files. The merged manifest must
equal the single run's.

Run: python -m bench.bench_validate [--quick] [--parts]
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from bench import _common as bc

TESTZIP = "import sys, zipfile; bad = zipfile.ZipFile(sys.argv[1]).testzip(); print(bad)"


def _manifest_rate(path: Path, args: list[str], repeat: int) -> tuple[float, float, bc.Run | None]:
    """Best hashing throughput (bytes/s, from ckpt's own measurement), its wall time and
    that run (with its per-stage report)."""
    best, wall, best_run = 0.0, 0.0, None
    for _ in range(repeat):
        run = bc.timed("ckpt validate " + " ".join(args),
                       bc.ckpt_argv("validate", str(path), *args))
        doc = json.loads(run.stdout)
        rate = doc["checkpoints"][0]["manifest"]["bytes_per_second"]
        if rate > best:
            best, wall, best_run = rate, run.seconds, run
    return best, wall, best_run


def write_rank_dcp(out: str, n_files: int, file_kib: int) -> None:
    """A DCP checkpoint of ``n_files`` rank files of ``file_kib`` KiB each (child process).

    One item per file, as ``FileSystemWriter(single_file_per_rank=False)`` writes them: the
    file layout (and the per-file work of validate) of a checkpoint of that many ranks.
    """
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    g = torch.Generator().manual_seed(0)
    rows = max(1, file_kib * 1024 // (256 * 4))
    sd = {f"layers.{i}.weight": torch.randn(rows, 256, generator=g) for i in range(n_files)}
    tmp = Path(out).with_name(Path(out).name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(sd, storage_writer=FileSystemWriter(str(tmp), single_file_per_rank=False),
                 no_dist=True)
    tmp.rename(out)


def rank_dcp(n_files: int, file_kib: int) -> Path:
    """The DCP checkpoint of :func:`write_rank_dcp`, made once and cached."""
    out = bc.DATA / f"dcp_ranks_{n_files}x{file_kib}k"
    if not (out / ".metadata").exists():
        bc.DATA.mkdir(parents=True, exist_ok=True)
        print(f"[bench] writing {out} ...", file=sys.stderr)
        bc.in_subprocess("bench.bench_validate.write_rank_dcp", out, n_files, file_kib)
    return out


_ENV = {"NO_COLOR": "1"}


def _manifest_files(d: Path) -> list[object]:
    files: list[object] = json.loads((d / "ckpt-manifest.json").read_text())["files"]
    return files


def bench_parts(quick: bool) -> None:
    """One process against two concurrent parts, for 256 and 1,024 rank files."""
    repeat = 1 if quick else 3
    file_kib = 256 if quick else 4096
    rows: list[tuple[str, str]] = []
    per: dict[int, tuple[float, int]] = {}
    for n in (256, 1024):
        d = rank_dcp(n, file_kib)
        size = sum(p.stat().st_size for p in d.iterdir() if p.is_file())
        bc.warm(d)
        args = ["validate", str(d), "--write-manifest", "--json"]
        one, two = float("inf"), float("inf")
        reference: list[object] = []
        for _ in range(repeat):  # interleaved: both see the same machine
            (d / "ckpt-manifest.json").unlink(missing_ok=True)
            one = min(one, bc.timed_together("1 process", [bc.ckpt_argv(*args)], env=_ENV).seconds)
            reference = _manifest_files(d)
            (d / "ckpt-manifest.json").unlink(missing_ok=True)
            two = min(two, bc.timed_together("2 parts", [bc.ckpt_argv(*args, "--part", f"{k}/2")
                                                         for k in (1, 2)], env=_ENV).seconds)
            assert _manifest_files(d) == reference, "the merged manifest differs"
        (d / "ckpt-manifest.json").unlink(missing_ok=True)
        per[n] = (one, size)
        rows += [(f"{n:,} rank files, {bc.human_bytes(size)}: 1 process",
                  f"{one:.2f} s, {bc.human_bytes(size / one)}/s"),
                 (f"{n:,} rank files: 2 parts at once", f"{two:.2f} s, {bc.human_bytes(size / two)}"
                                                        f"/s = {one / two:.2f}x"
                                                        + ("  (target >= 1.6x)"
                                                           if n == 256 else ""))]
    (t256, b256), (t1024, b1024) = per[256], per[1024]
    rows.append(("linearity (1,024 vs 256 files, 1 process)",
                 f"{t1024 / t256:.2f}x the time for {b1024 / b256:.2f}x the bytes and 4x the "
                 "files (linear: about the same)"))
    bc.report("validate --write-manifest of a DCP checkpoint: 2 parts (--part K/2) vs 1 process"
              + (" [--quick: small files, smoke only]" if quick else ""), rows)


def main() -> None:
    if "--parts" in sys.argv:
        bench_parts("--quick" in sys.argv)
        return
    quick = "--quick" in sys.argv
    repeat = 1 if quick else 3
    path = bc.train_checkpoint(**({"n_layers": 2, "dim": 512} if quick else {}))
    manifest = path.with_name(path.name + ".ckpt-manifest.json")
    manifest.unlink(missing_ok=True)
    size = path.stat().st_size
    bc.warm(path)

    ours = bc.timed("ckpt validate", bc.ckpt_argv("validate", str(path), "--json"), repeat=repeat)
    doc = json.loads(ours.stdout)
    assert doc["valid"], doc
    crc = next(c for c in doc["checkpoints"][0]["checks"] if c["id"] == "crc32")
    testzip = bc.timed("testzip", [bc.PY, "-c", TESTZIP, str(path)], repeat=repeat)
    assert testzip.stdout.strip() == "None", testzip.stdout
    sha = bc.timed("sha256sum", ["sha256sum", str(path)], repeat=1) if shutil.which(
        "sha256sum") else None
    rows = [
        ("ckpt validate (structure + CRC)", f"{ours.seconds:.2f} s, "
                                            f"{bc.human_bytes(size / ours.seconds)}/s, peak RSS "
                                            f"{bc.human_bytes(ours.peak_rss)}  [{crc['summary']}]"),
        ("zipfile testzip() (CRC only)", f"{testzip.seconds:.2f} s, peak RSS "
                                         f"{bc.human_bytes(testzip.peak_rss)}"),
        ("speed-up vs testzip", f"{testzip.seconds / ours.seconds:.1f}x  (target >= 1x)"),
    ]
    if sha is not None:
        rows += [("sha256sum", f"{sha.seconds:.2f} s"),
                 ("speed-up vs sha256sum", f"{sha.seconds / ours.seconds:.1f}x")]
    rows += [("where ckpt's time goes", ""), *bc.stage_rows(ours)]
    bc.report(f"validate a {bc.human_bytes(size)} torch training checkpoint (warm cache)", rows)

    cat = bc.timed("cat", ["sh", "-c", 'cat "$1" > /dev/null', "sh", str(path)], repeat=repeat)
    cat_rate = size / cat.seconds
    write_rate, write_wall, write_run = _manifest_rate(
        path, ["--write-manifest", "--json"], repeat)  # the full check: --quick refuses it
    verify_rate, verify_wall, _ = _manifest_rate(path, ["--quick", "--json"], repeat)
    manifest.unlink(missing_ok=True)
    bc.report("integrity manifest (xxh3_128) vs reading the file from page cache", [
        ("cat FILE > /dev/null", f"{cat.seconds:.2f} s, {bc.human_bytes(cat_rate)}/s"),
        ("hashing (--write-manifest)", f"{bc.human_bytes(write_rate)}/s = "
                                       f"{100 * write_rate / cat_rate:.0f}% of cat "
                                       f"(target >= 70%); whole command {write_wall:.2f} s"),
        ("hashing (verify)", f"{bc.human_bytes(verify_rate)}/s = "
                             f"{100 * verify_rate / cat_rate:.0f}% of cat; whole command "
                             f"{verify_wall:.2f} s"),
        *(bc.stage_rows(write_run) if write_run is not None else []),
    ])

    values = bc.timed("ckpt validate --values", bc.ckpt_argv("validate", str(path), "--quick",
                                                             "--values", "--json"))
    vdoc = json.loads(values.stdout)
    summary = next(c for c in vdoc["checkpoints"][0]["checks"] if c["id"] == "values")
    bc.report("--values (every floating tensor, one at a time)", [
        ("ckpt validate --quick --values", f"{values.seconds:.2f} s, peak RSS "
                                           f"{bc.human_bytes(values.peak_rss)}"),
        ("checked", summary["summary"]),
        *bc.stage_rows(values),
    ])


if __name__ == "__main__":
    main()
