"""Benchmark: checkpoints on an S3 endpoint (moto's server on 127.0.0.1, started here).

Every request passes through a counting proxy, so the figures are what crossed the wire:

1. ``ckpt inspect --json s3://.../train.pt`` of the 4.7 GB training checkpoint: requests and
   bytes moved (targets: at most 20 requests and 2 MB). The peer a user has without ckpt
   downloads the object (``aws s3 cp``) before ``torch.load`` can say anything: it moves the
   whole object, by definition; it is timed on the smaller object of part 3.
2. ``ckpt inspect --json`` of a 100-checkpoint run directory on the bucket: LIST pages and
   per-checkpoint reads.
3. Streaming every byte of a 0.3 GB training checkpoint: ``ckpt validate`` (CRC-32 of every
   record) at ``--concurrency`` 1, 4 and 8, against boto3's parallel download to nowhere (the
   floor of reading the object at all) and the peer of part 1 (download + ``torch.load``).
4. ``ckpt convert --keep-optimizer -o s3://...`` of that checkpoint (every byte cast-free,
   written and uploaded in one pass) against boto3's ``upload_file`` of the same output.

moto answers each ranged GET by copying the whole object in memory, so on a multi-GB object
a request costs seconds there that it does not on S3: times of part 1 say more about moto than
about ckpt, and part 3 uses an object small enough for moto to keep up. Request and byte
counts do not depend on the server. Peak RSS figures include the pages a child inherits
from this process at fork (the proxy's buffers: ~200 MB once part 3 has run; compare
``--help``'s in part 5).

5. With ``CKPT_BENCH_BASELINE=/path/to/a/checkout/before/object/storage``: local paths in
   this checkout against that one (``--help``, ``inspect --json`` of the 4.7 GB checkpoint
   and of a small safetensors file), interleaved over 7 rounds: URLs must cost local paths
   nothing. ``--local`` runs only this part.

Run: ``python -m bench.bench_s3 [--local]``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid

from bench import _common as bc
from tests.helpers import s3

PEER_INSPECT = """
import sys, boto3, torch
c = boto3.client("s3")
c.download_file(sys.argv[1], sys.argv[2], sys.argv[3])
sd = torch.load(sys.argv[3], mmap=True, weights_only=True, map_location="cpu")
def count(o):
    if isinstance(o, torch.Tensor): return 1
    if isinstance(o, dict): return sum(count(v) for v in o.values())
    if isinstance(o, (list, tuple)): return sum(count(v) for v in o)
    return 0
print(count(sd))
"""

PEER_UPLOAD = """
import sys, boto3
from boto3.s3.transfer import TransferConfig
boto3.client("s3").upload_file(sys.argv[1], sys.argv[2], sys.argv[3],
                               Config=TransferConfig(max_concurrency=10))
"""

PEER_READ = """
import sys, boto3
from boto3.s3.transfer import TransferConfig
class Null:
    def write(self, b): return len(b)
boto3.client("s3").download_fileobj(sys.argv[1], sys.argv[2], Null(),
                                    Config=TransferConfig(max_concurrency=10))
"""


def local_paths() -> None:
    """Part 5: local paths before and after object storage, interleaved."""
    baseline = os.environ.get("CKPT_BENCH_BASELINE")
    if not baseline:
        print("[bench] set CKPT_BENCH_BASELINE to a checkout to compare local paths with",
              file=sys.stderr)
        return
    src = bc.train_checkpoint()
    st = str(next(bc.many_checkpoints(100).glob("*.safetensors")))
    cases = {"--help": ["--help"], "inspect --json train.pt": ["inspect", str(src), "--json"],
             "inspect --json small.safetensors": ["inspect", st, "--json"]}
    rows = []
    for label, args in cases.items():
        runs = {"now": bc.ckpt_argv(*args), "before": [bc.PY, "-P", "-m", "ckpt_cli", *args]}
        best: dict[str, bc.Run] = {}
        for _ in range(7):
            for who, argv in runs.items():
                r = bc.timed(who, argv, env={"PYTHONPATH": baseline} if who == "before" else None)
                if who not in best or r.seconds < best[who].seconds:
                    best[who] = r
        now, before = best["now"], best["before"]
        rows.append((label, f"now {now.seconds:.3f} s ({bc.human_bytes(now.peak_rss)}), before "
                            f"{before.seconds:.3f} s ({bc.human_bytes(before.peak_rss)}): "
                            f"{now.seconds / before.seconds:.2f}x"))
    bc.report("local paths, this checkout vs the baseline (best of 7, interleaved)", rows)


def main() -> None:
    if "--local" in sys.argv:
        local_paths()
        return
    src = bc.train_checkpoint()
    small = bc.train_checkpoint(n_layers=2, dim=512)
    run_dir = bc.many_checkpoints(100)
    size, small_size = src.stat().st_size, small.stat().st_size
    with s3.moto_process_endpoint() as (moto, proxy):
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        s3.client(moto).create_bucket(Bucket=bucket)
        t0 = time.perf_counter()
        s3.upload(moto, src, bucket, "train.pt")
        s3.upload(moto, small, bucket, "small.pt")
        s3.upload(moto, run_dir, bucket, "run")
        print(f"[bench] uploaded {bc.human_bytes(size + small_size)} in "
              f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
        env = s3.env_for(proxy.url)
        url = f"s3://{bucket}/train.pt"

        # 1. inspect of the training checkpoint.
        proxy.traffic.reset()
        ours = bc.timed("ckpt inspect", bc.ckpt_argv("inspect", url, "--json"), env=env)
        doc = json.loads(ours.stdout)
        t = proxy.traffic
        requests, moved = t.requests, t.bytes_out
        bc.report(f"inspect --json {url} ({bc.human_bytes(size)}, {doc['num_tensors']} tensors)", [
            ("ckpt", f"{requests} requests ({t.lists} LIST, {t.by_method.get('HEAD', 0)} HEAD, "
                     f"{requests - t.lists - t.by_method.get('HEAD', 0)} ranged GET), "
                     f"{bc.human_bytes(moved)} moved, {ours.seconds:.2f} s, peak RSS "
                     f"{bc.human_bytes(ours.peak_rss)}"),
            ("peer (download, then torch.load)", f"moves the whole object: {bc.human_bytes(size)} "
                                                 f"({size / max(moved, 1):,.0f}x ckpt's bytes)"),
            ("target", f"<= 20 requests: {'met' if requests <= 20 else 'NOT met'}; "
                       f"<= 2 MB: {'met' if moved <= 2_000_000 else 'NOT met'}"),
        ])

        # 2. a run directory of 100 checkpoints.
        proxy.traffic.reset()
        run = bc.timed("ckpt inspect run", bc.ckpt_argv("inspect", f"s3://{bucket}/run", "--json"),
                       env=env)
        listing = json.loads(run.stdout)
        t = proxy.traffic
        bc.report(f"inspect --json s3://{bucket}/run (100 checkpoints)", [
            ("ckpt", f"{run.seconds:.2f} s, {t.requests} requests: {t.lists} LIST page(s), "
                     f"{t.by_method.get('HEAD', 0)} HEAD, "
                     f"{t.requests - t.lists - t.by_method.get('HEAD', 0)} ranged GETs, "
                     f"{bc.human_bytes(t.bytes_out)} moved"),
            ("checkpoints listed", str(len(listing["checkpoints"]))),
        ])

        # 3. streaming every byte of the smaller checkpoint.
        surl = f"s3://{bucket}/small.pt"
        rows = []
        proxy.traffic.reset()
        floor = bc.timed("boto3 download", [bc.PY, "-c", PEER_READ, bucket, "small.pt"], env=env)
        rows.append(("boto3 download_fileobj (10 threads, to nowhere)",
                     f"{floor.seconds:.2f} s, {small_size / floor.seconds / 1e6:,.0f} MB/s, "
                     f"{proxy.traffic.requests} requests"))
        tmp = bc.DATA / "peer-download.pt"
        try:
            peer = bc.timed("peer", [bc.PY, "-c", PEER_INSPECT, bucket, "small.pt", str(tmp)],
                            env=env)
        finally:
            tmp.unlink(missing_ok=True)
        rows.append(("peer inspect: download + torch.load(mmap)",
                     f"{peer.seconds:.2f} s, peak RSS {bc.human_bytes(peer.peak_rss)}"))
        proxy.traffic.reset()
        mine = bc.timed("ckpt inspect small", bc.ckpt_argv("inspect", surl, "--json"), env=env)
        rows.append(("ckpt inspect --json", f"{mine.seconds:.2f} s, {proxy.traffic.requests} "
                     f"requests, {bc.human_bytes(proxy.traffic.bytes_out)} moved "
                     f"({peer.seconds / mine.seconds:.1f}x faster than the peer)"))
        for conc in (1, 4, 8):
            proxy.traffic.reset()
            r = bc.timed(f"validate c={conc}", bc.ckpt_argv("validate", surl, "--json",
                                                            "--concurrency", str(conc)), env=env)
            ok = json.loads(r.stdout)["valid"]
            rows.append((f"ckpt validate --concurrency {conc}",
                         f"{r.seconds:.2f} s, {small_size / r.seconds / 1e6:,.0f} MB/s "
                         f"({floor.seconds / r.seconds:.2f}x the download), "
                         f"{proxy.traffic.requests} requests, peak RSS "
                         f"{bc.human_bytes(r.peak_rss)}, valid={ok}"))
        local = bc.timed("validate local", bc.ckpt_argv("validate", str(small), "--json"))
        rows.append(("ckpt validate of the local file", f"{local.seconds:.2f} s"))
        bc.report(f"streaming {surl} ({bc.human_bytes(small_size)})", rows)

        # 4. writing: the whole training state of the smaller checkpoint, as safetensors.
        out = bc.DATA / "upload-peer.safetensors"
        rows = []
        try:
            conv = bc.timed("local convert", bc.ckpt_argv("convert", str(small), "--keep-optimizer",
                                                          "-o", str(out), "--force"))
            size_out = out.stat().st_size
            proxy.traffic.reset()
            peer_up = bc.timed("boto3 upload", [bc.PY, "-c", PEER_UPLOAD, str(out), bucket, "p.st"],
                               env=env)
            rows.append(("boto3 upload_file of the converted file (10 threads)",
                         f"{peer_up.seconds:.2f} s, {size_out / peer_up.seconds / 1e6:,.0f} MB/s,"
                         f" {proxy.traffic.requests} requests"))
            rows.append(("ckpt convert to a local file (for reference)", f"{conv.seconds:.2f} s"))
            proxy.traffic.reset()
            up = bc.timed("ckpt convert -o s3", bc.ckpt_argv(
                "convert", str(small), "--keep-optimizer", "-o", f"s3://{bucket}/c.safetensors",
                "--force"), env=env)
            rows.append(("ckpt convert -o s3://... (read, write, upload at once)",
                         f"{up.seconds:.2f} s, {size_out / up.seconds / 1e6:,.0f} MB/s, "
                         f"{proxy.traffic.requests} requests, peak RSS "
                         f"{bc.human_bytes(up.peak_rss)}"))
        finally:
            out.unlink(missing_ok=True)
        bc.report(f"writing {bc.human_bytes(size_out)} of safetensors to the bucket", rows)
    local_paths()


if __name__ == "__main__":
    main()
