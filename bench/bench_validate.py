"""Benchmark: ``ckpt validate`` against what a user would otherwise run to check a checkpoint.

On the ~4.7 GB torch training checkpoint (warm page cache, fresh processes, fastest of N):

* full default validation (structure + CRC-32 of every record) against
  ``python -c "import zipfile; zipfile.ZipFile(p).testzip()"`` (CRC only) and ``sha256sum``;
* manifest hashing throughput (``--write-manifest``, then verification) against
  ``cat FILE > /dev/null`` (reading the file from page cache), target >= 70%;
* ``--values`` (every floating tensor read and checked), for its time and peak memory.

Run: python -m bench.bench_validate [--quick]
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from bench._common import PY, ckpt_argv, human_bytes, report, timed, train_checkpoint, warm

TESTZIP = "import sys, zipfile; bad = zipfile.ZipFile(sys.argv[1]).testzip(); print(bad)"


def _manifest_rate(path: Path, args: list[str], repeat: int) -> tuple[float, float]:
    """Best hashing throughput (bytes/s, from ckpt's own measurement) and its wall time."""
    best, wall = 0.0, 0.0
    for _ in range(repeat):
        run = timed("ckpt validate " + " ".join(args), ckpt_argv("validate", str(path), *args))
        doc = json.loads(run.stdout)
        rate = doc["checkpoints"][0]["manifest"]["bytes_per_second"]
        if rate > best:
            best, wall = rate, run.seconds
    return best, wall


def main() -> None:
    quick = "--quick" in sys.argv
    repeat = 1 if quick else 3
    path = train_checkpoint(**({"n_layers": 2, "dim": 512} if quick else {}))
    manifest = path.with_name(path.name + ".ckpt-manifest.json")
    manifest.unlink(missing_ok=True)
    size = path.stat().st_size
    warm(path)

    ours = timed("ckpt validate", ckpt_argv("validate", str(path), "--json"), repeat=repeat)
    doc = json.loads(ours.stdout)
    assert doc["valid"], doc
    crc = next(c for c in doc["checkpoints"][0]["checks"] if c["id"] == "crc32")
    testzip = timed("testzip", [PY, "-c", TESTZIP, str(path)], repeat=repeat)
    assert testzip.stdout.strip() == "None", testzip.stdout
    sha = timed("sha256sum", ["sha256sum", str(path)], repeat=1) if shutil.which(
        "sha256sum") else None
    rows = [
        ("ckpt validate (structure + CRC)", f"{ours.seconds:.2f} s, "
                                            f"{human_bytes(size / ours.seconds)}/s, peak RSS "
                                            f"{human_bytes(ours.peak_rss)}  [{crc['summary']}]"),
        ("zipfile testzip() (CRC only)", f"{testzip.seconds:.2f} s, peak RSS "
                                         f"{human_bytes(testzip.peak_rss)}"),
        ("speed-up vs testzip", f"{testzip.seconds / ours.seconds:.1f}x  (target >= 1x)"),
    ]
    if sha is not None:
        rows += [("sha256sum", f"{sha.seconds:.2f} s"),
                 ("speed-up vs sha256sum", f"{sha.seconds / ours.seconds:.1f}x")]
    report(f"validate a {human_bytes(size)} torch training checkpoint (warm cache)", rows)

    cat = timed("cat", ["sh", "-c", 'cat "$1" > /dev/null', "sh", str(path)], repeat=repeat)
    cat_rate = size / cat.seconds
    write_rate, write_wall = _manifest_rate(
        path, ["--quick", "--write-manifest", "--json"], repeat)
    verify_rate, verify_wall = _manifest_rate(path, ["--quick", "--json"], repeat)
    manifest.unlink(missing_ok=True)
    report("integrity manifest (xxh3_128) vs reading the file from page cache", [
        ("cat FILE > /dev/null", f"{cat.seconds:.2f} s, {human_bytes(cat_rate)}/s"),
        ("hashing (--write-manifest)", f"{human_bytes(write_rate)}/s = "
                                       f"{100 * write_rate / cat_rate:.0f}% of cat "
                                       f"(target >= 70%); whole command {write_wall:.2f} s"),
        ("hashing (verify)", f"{human_bytes(verify_rate)}/s = "
                             f"{100 * verify_rate / cat_rate:.0f}% of cat; whole command "
                             f"{verify_wall:.2f} s"),
    ])

    values = timed("ckpt validate --values", ckpt_argv("validate", str(path), "--quick",
                                                       "--values", "--json"))
    vdoc = json.loads(values.stdout)
    summary = next(c for c in vdoc["checkpoints"][0]["checks"] if c["id"] == "values")
    report("--values (every floating tensor, one at a time)", [
        ("ckpt validate --quick --values", f"{values.seconds:.2f} s, peak RSS "
                                           f"{human_bytes(values.peak_rss)}"),
        ("checked", summary["summary"]),
    ])


if __name__ == "__main__":
    main()
