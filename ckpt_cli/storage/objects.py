"""Object stores: one fsspec filesystem per scheme, its listings, block cache and traffic, the
uploads that write objects, and every S3-specific call.

An object store has no directories, only keys. The first question about a prefix lists it
once, recursively (a LIST call per 1,000 keys), and every later ``stat``, ``is_file`` or
``iterdir`` below it is answered from that listing: inspecting a run directory of 100
checkpoints costs a few LIST pages plus the metadata reads, not a HEAD per file. Only URLs
import fsspec.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from ckpt_cli.errors import CkptError, StorageError, UsageError
from ckpt_cli.storage.config import (
    _describe,
    _import_fsspec,
    _lock,
    _not_found,
    _options,
    _reraise,
    _short,
    _stores,
    concurrency,
    install_hint,
    redact,
)

if TYPE_CHECKING:  # imported when a URL is used: local paths and --help never pay for them
    from concurrent.futures import Future, ThreadPoolExecutor

    from ckpt_cli.storage.objectpath import ObjectPath

BLOCK = 256 << 10
"""Bytes fetched per small read: a safetensors header, a zip's end records and central
directory, a ``data.pkl`` usually fit one or two blocks."""

CACHE_BLOCKS = 256
"""Blocks a store keeps (64 MiB): enough for every structure readers revisit."""

LARGE_READ = 4 << 20
"""Reads at least this large (tensor data) bypass the cache."""

RANGE_BYTES = 8 << 20
"""Bytes per ranged GET of a large read; a large read's ranges are fetched concurrently."""

_READER_STALE = 256
"""Streamed reads of an object after which a reader that made none is taken to have left."""

STREAM_AFTER = 2 * BLOCK
"""Contiguous bytes a reader must have read before its reads are served ahead in
:data:`RANGE_BYTES` chunks (a CRC or hash pass over a whole object), rather than in blocks."""

UPLOAD_IDLE = 3600.0
"""Seconds without a new part after which prune takes a multipart upload for a killed
write's (whatever ``--grace`` says: an upload's progress shows only in its parts)."""

UPLOAD_PART = 16 << 20
"""The smallest part of a multipart upload; an upload of a known size uses parts large
enough that it needs at most 9,000 (S3 allows 10,000)."""

UPLOAD_IN_FLIGHT = 4
"""Parts of one upload sent at once: S3 takes parts in parallel, and each holds a part's
bytes in memory until it is acknowledged."""


def store_for(scheme: str) -> ObjectStore:
    """The store of ``scheme``, opened at first use with the configured options."""
    with _lock:
        st = _stores.get(scheme)
        if st is None:
            st = _stores[scheme] = ObjectStore(scheme, dict(_options))
        return st


class Entry(NamedTuple):
    """What a listing says of one key."""

    is_dir: bool
    size: int
    mtime: float
    tag: str = ""
    """What the store says changes with every write of the object: its version id where the
    bucket keeps versions, else its ETag (GCS: generation); empty where the listing has none."""


def _mtime(info: Mapping[str, Any]) -> float:
    for k in ("LastModified", "mtime", "last_modified", "updated", "created", "timeCreated"):
        v = info.get(k)
        if isinstance(v, datetime):
            return v.timestamp()
        if isinstance(v, int | float):
            return float(v)
        if isinstance(v, str):
            try:
                return datetime.fromisoformat(v.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return 0.0


def _tag(info: Mapping[str, Any]) -> str:
    for k in ("VersionId", "version_id", "generation", "ETag", "etag", "md5Hash"):
        v = info.get(k)
        if v not in (None, "", "null"):
            return f"{k}={v}"
    return ""


def _parent(key: str) -> str:
    return key.rsplit("/", 1)[0] if "/" in key else ""


class ObjectStore:
    """One fsspec filesystem, the listings made of it and the traffic it carried.

    Args:
        scheme: The URL scheme (``s3``, ``gs``, ``memory``...).
        options: fsspec keyword arguments.

    Raises:
        UsageError: If fsspec or the scheme's implementation is not installed.
    """

    def __init__(self, scheme: str, options: dict[str, Any]):
        fsspec = _import_fsspec(scheme)
        self.scheme = scheme
        try:
            # Our own registry holds stores (configure() resets it); fsspec's instance cache
            # would hand back a client made with earlier credentials or endpoint.
            self.fs = fsspec.filesystem(scheme, skip_instance_cache=True, **options)
        except ImportError as e:
            raise UsageError(f"{scheme}:// URLs need a client library ({redact(str(e))}): "
                             f"{install_hint(scheme, fsspec=False)}") from None
        except (ValueError, TypeError) as e:
            raise UsageError(f"{scheme}://: bad storage options ({redact(str(e))})") from None
        self._entries: dict[str, Entry] = {}
        self._children: dict[str, set[str]] = {}
        self._deep: set[str] = set()
        self._blocks: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self._pending: dict[tuple[str, int], Future[None]] = {}  # blocks being fetched
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.RLock()
        self.requests = 0
        self.bytes = 0

    def url(self, key: str) -> str:
        """The URL of ``key``."""
        return f"{self.scheme}://{key}"

    def call(self, key: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run one fsspec call about ``key``, as a :class:`StorageError` when it fails.

        The client library retries what it retries (throttling, resets); what is left is
        reported in one line naming the URL, with credentials redacted.
        """
        with self._lock:
            self.requests += 1
        try:
            return fn(*args, **kwargs)
        except CkptError:
            raise
        except FileNotFoundError as e:
            raise StorageError(_not_found(e), path=self.url(key)) from None
        except PermissionError as e:
            raise StorageError(f"access denied ({_short(e)})", path=self.url(key)) from None
        except Exception as e:  # the client's own exception types vary by protocol
            raise StorageError(_describe(e), path=self.url(key)) from None

    def _record(self, name: str, info: Mapping[str, Any]) -> None:
        key = name.strip("/")
        # A zero-byte "folder" object (key/: what S3 consoles, rclone and S3A make) marks a
        # directory; it must not stand in for one as an empty file.
        is_dir = (info.get("type") == "directory" or name.endswith("/")
                  or str(info.get("Key", "")).endswith("/"))
        if is_dir and key in self._entries and self._entries[key].is_dir:
            return
        self._entries[key] = Entry(is_dir, 0 if is_dir else int(info.get("size") or 0),
                                   _mtime(info), "" if is_dir else _tag(info))
        child = key
        while "/" in child:
            parent = _parent(child)
            self._children.setdefault(parent, set()).add(child.rsplit("/", 1)[1])
            if parent not in self._entries:
                self._entries[parent] = Entry(True, 0, 0.0)
            elif not self._entries[parent].is_dir:
                break
            child = parent

    def _covered(self, key: str) -> bool:
        """Whether a recursive listing already answers every question about ``key``."""
        k = key
        while True:
            if k in self._deep:
                return True
            if "/" not in k:
                return False
            k = _parent(k)

    def _list(self, key: str) -> None:
        found = self.call(key, self.fs.find, key, detail=True, withdirs=True)
        for name, info in found.items():
            self._record(name, info)
        if found and key not in self._entries:
            self._entries[key] = Entry(True, 0, 0.0)
        self._deep.add(key)

    def lookup(self, key: str) -> Entry | None:
        """What ``key`` is (a file, or a prefix with keys below it), or None if nothing."""
        with self._lock:
            got = self._entries.get(key)
            if got is not None or (self._covered(_parent(key)) and "/" in key):
                return got
            if not self._covered(key):
                self._list(key)
                got = self._entries.get(key)
                if got is not None:
                    return got
            try:
                info = self.call(key, self.fs.info, key)
            except StorageError as e:
                if "no such key" in e.message:
                    return None
                raise
            self._record(key, info)
            return self._entries.get(key)

    def children(self, key: str) -> list[str]:
        """Names directly below prefix ``key`` (listing it recursively first, once)."""
        with self._lock:
            if not self._covered(key):
                self._list(key)
            return sorted(self._children.get(key, ()))

    def submit(self, key: str, start: int, end: int) -> Future[bytes]:
        """Fetch ``[start, end)`` of ``key`` in the background (read-ahead)."""
        from concurrent.futures import ThreadPoolExecutor  # lazy: store listings only

        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=max(4, 2 * concurrency()),
                                                thread_name_prefix="ckpt-get")
            pool = self._pool
        return pool.submit(lambda: self.fetch(key, [(start, end)])[0])

    def shutdown(self) -> None:
        """Stop the read-ahead threads (queued fetches are cancelled)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def changed(self) -> None:
        """Forget every listing and cached block: this process just wrote or deleted."""
        with self._lock:
            self._entries.clear()
            self._children.clear()
            self._deep.clear()
            self._blocks.clear()
        invalidate = getattr(self.fs, "invalidate_cache", None)
        if invalidate is not None:
            invalidate()

    def versioned(self, bucket: str) -> bool | None:
        """Whether a bucket keeps old versions of objects (None when it cannot be told)."""
        probe = getattr(self.fs, "is_bucket_versioned", None)
        if probe is None:
            return None
        try:
            return bool(self.call(bucket, probe, bucket))
        except StorageError:
            return None

    @property
    def is_s3(self) -> bool:
        """Whether the store is S3 (or S3-compatible), so :meth:`s3` can be used."""
        return (getattr(self.fs, "_call_s3", None) is not None
                and getattr(self.fs, "loop", None) is not None)

    def s3(self, key: str, op: str, **kw: Any) -> Any:
        """One S3 API call (``delete_objects``, ``upload_part``...) through s3fs's client,
        with its retries, as a :class:`StorageError` naming ``key`` when it fails. For what
        fsspec's own calls do not offer: exact-key deletes, parallel parts, upload listings.
        Only when :attr:`is_s3`."""
        from fsspec.asyn import sync  # type: ignore[import-untyped]  # heavy: fsspec

        return self.call(key, sync, self.fs.loop, self.fs._call_s3, op, **kw)

    def pending_uploads(self, prefix: str) -> list[tuple[str, str, float]]:
        """Multipart uploads begun below ``prefix`` (``bucket/key...``) and never completed
        or aborted: ``(key, upload id, last activity)``. Their parts cost storage while invisible
        to listings; a write killed with ``kill -9`` leaves one. Empty for stores without
        multipart uploads."""
        if not self.is_s3:
            return []

        def s3(op: str, **kw: Any) -> Any:
            return self.s3(prefix, op, **kw)

        bucket, _, key = prefix.partition("/")
        kw: dict[str, Any] = {"Bucket": bucket, "Prefix": key}
        out: list[tuple[str, str, float]] = []
        while True:
            page = s3("list_multipart_uploads", **kw)
            for u in page.get("Uploads", []):
                # The last sign of life: its newest part, else when it began (a 2.5 TB
                # upload outlives any grace period while its parts keep coming).
                times = [_mtime({"LastModified": u.get("Initiated")})]
                pkw: dict[str, Any] = {"Bucket": bucket, "Key": u["Key"],
                                       "UploadId": u["UploadId"]}
                while True:  # 1,000 parts a page: a 64 GB shard has more
                    parts = s3("list_parts", **pkw)
                    times += [_mtime(p) for p in parts.get("Parts", [])]
                    if not parts.get("IsTruncated"):
                        break
                    pkw["PartNumberMarker"] = parts.get("NextPartNumberMarker")
                out.append((f"{bucket}/{u['Key']}", u["UploadId"], max(times)))
            if not page.get("IsTruncated"):
                return out
            kw.update(KeyMarker=page.get("NextKeyMarker"),
                      UploadIdMarker=page.get("NextUploadIdMarker"))

    def abort_upload(self, key: str, upload_id: str) -> None:
        """Abort a multipart upload (its parts are deleted)."""
        bucket, _, k = key.partition("/")
        self.call(key, self.fs.abort_mpu, bucket, k, upload_id)

    def delete(self, keys: list[str]) -> None:
        """Delete exactly these objects: on S3 with ``DeleteObjects`` (1,000 keys a call),
        elsewhere one by one. Never through fsspec's ``rm``, which expands ``[`` ``?`` ``*``
        in a key as a glob and would delete other keys (``run[1]`` matching ``run1``)."""
        try:
            if not self.is_s3:
                for k in keys:
                    self.call(k, self.fs.rm_file, k)
                return
            by_bucket: dict[str, list[str]] = {}
            for k in keys:
                bucket, _, rest = k.partition("/")
                by_bucket.setdefault(bucket, []).append(rest)
            for bucket, names in by_bucket.items():
                for i in range(0, len(names), 1000):
                    batch = names[i:i + 1000]
                    out = self.s3(f"{bucket}/{batch[0]}", "delete_objects", Bucket=bucket,
                                  Delete={"Objects": [{"Key": n} for n in batch],
                                          "Quiet": True})
                    errors = out.get("Errors") or []
                    if errors:
                        e = errors[0]
                        raise StorageError(f"could not delete {len(errors)} object(s) "
                                           f"({e.get('Code')}: {e.get('Message')})",
                                           path=self.url(f"{bucket}/{e.get('Key')}"))
        finally:
            self.changed()

    def has_blocks(self, key: str, blocks: range) -> bool:
        """Whether every block of ``key`` in ``blocks`` is cached."""
        with self._lock:
            return all((key, b) in self._blocks for b in blocks)

    def blocks(self, key: str, size: int, blocks: range) -> list[bytes]:
        """Blocks of ``key`` (of ``size`` bytes), from the cache or fetched: runs of
        neighbouring missing blocks are one GET each, all runs concurrently. A block another
        thread is fetching is waited for, not fetched twice."""
        from concurrent.futures import Future  # lazy: store uploads only

        mine: list[int] = []
        waits: dict[int, Future[None]] = {}
        with self._lock:
            have = {b: self._blocks[(key, b)] for b in blocks if (key, b) in self._blocks}
            for b in blocks:
                if b in have:
                    continue
                pending = self._pending.get((key, b))
                if pending is not None:
                    waits[b] = pending
                else:
                    mine.append(b)
            done: Future[None] = Future()
            for b in mine:
                self._pending[(key, b)] = done
        if mine:
            try:
                runs: list[list[int]] = []
                for b in mine:
                    if runs and runs[-1][-1] == b - 1:
                        runs[-1].append(b)
                    else:
                        runs.append([b])
                got = self.fetch(key, [(r[0] * BLOCK, min(size, (r[-1] + 1) * BLOCK))
                                       for r in runs])
                for r, data in zip(runs, got, strict=True):
                    for i, b in enumerate(r):
                        have[b] = data[i * BLOCK:(i + 1) * BLOCK]
                with self._lock:
                    for b in mine:
                        self._blocks[(key, b)] = have[b]
                done.set_result(None)
            except BaseException as e:
                done.set_exception(e)
                raise
            finally:
                with self._lock:
                    for b in mine:
                        self._pending.pop((key, b), None)
        for b, pending in waits.items():
            pending.result()  # that fetch's error is this read's too
            with self._lock:
                blk = self._blocks.get((key, b))
            if blk is None:  # evicted in between: fetch it after all
                blk = self.fetch(key, [(b * BLOCK, min(size, (b + 1) * BLOCK))])[0]
            have[b] = blk
        with self._lock:
            for b in blocks:
                self._blocks[(key, b)] = have[b]
                self._blocks.move_to_end((key, b))
            while len(self._blocks) > CACHE_BLOCKS:
                self._blocks.popitem(last=False)
        return [have[b] for b in blocks]

    def fetch(self, key: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        """Bytes of ``[start, end)`` ranges of ``key``, fetched concurrently."""
        if len(ranges) == 1:
            s, e = ranges[0]
            out = [self.call(key, self.fs.cat_file, key, start=s, end=e)]
        else:
            with self._lock:
                self.requests += len(ranges) - 1
            out = self.call(key, self.fs.cat_ranges, [key] * len(ranges),
                            [s for s, _ in ranges], [e for _, e in ranges],
                            batch_size=concurrency())
        for r in out:
            if isinstance(r, BaseException):
                self.call(key, _reraise, r)
        with self._lock:
            self.bytes += sum(len(r) for r in out)
        return cast(list[bytes], out)


class Upload:
    """One object being written: a multipart upload that becomes visible only at
    :meth:`commit` (S3 has no rename; CompleteMultipartUpload is the atomic step). A file
    smaller than one part is a single PUT at commit.

    On S3 the parts go up concurrently (at most :data:`UPLOAD_IN_FLIGHT` at once, so memory
    stays at that many parts plus the one filling), sized from ``expected`` so that any
    object fits S3's 10,000 parts; on other stores through fsspec's writer.

    Use as a context manager: leaving it normally commits, an exception (Ctrl-C included)
    aborts the upload, so no partial object is ever visible.

    Args:
        path: The object to write.
        part_size: Bytes per uploaded part (default: from ``expected``, at least
            :data:`UPLOAD_PART`).
        expected: About how many bytes will be written, if known.
    """

    def __init__(self, path: ObjectPath, part_size: int | None = None,
                 expected: int | None = None):
        self.path, self.store, self.key = path, path.store, path.key
        self.written = 0
        self.done = False
        self.part_size = part_size or max(UPLOAD_PART, -(-(expected or 0) // 9_000))
        self._s3 = self.store.is_s3
        if not self._s3:
            self.f = self.store.call(self.key, self.store.fs.open, self.key, "wb",
                                     block_size=self.part_size)
            return
        self.bucket, _, self.name = self.key.partition("/")
        self._buf = bytearray()
        self._mpu: str | None = None
        self._sent: list[tuple[int, Future[Any]]] = []
        self._pool: ThreadPoolExecutor | None = None

    def _req(self, op: str, **kw: Any) -> Any:
        return self.store.s3(self.key, op, Bucket=self.bucket, Key=self.name, **kw)

    def write(self, data: bytes | memoryview) -> int:
        """Append ``data``; returns its length (writes are never short)."""
        n = len(data)
        if not self._s3:
            self.store.call(self.key, self.f.write, data)
        else:
            self._buf += data
            while len(self._buf) >= self.part_size:
                self._send(bytes(self._buf[:self.part_size]))
                del self._buf[:self.part_size]
        self.written += n
        return n

    def _send(self, body: bytes) -> None:
        from concurrent.futures import ThreadPoolExecutor  # lazy: store deletes only

        if self._mpu is None:
            self._mpu = self._req("create_multipart_upload")["UploadId"]
            self._pool = ThreadPoolExecutor(UPLOAD_IN_FLIGHT, thread_name_prefix="ckpt-put")
        assert self._pool is not None
        # Back-pressure: wait for the oldest part while the most are in flight (its error,
        # if any, is raised here).
        running = [f for _, f in self._sent if not f.done()]
        if len(running) >= UPLOAD_IN_FLIGHT:
            running[0].result()
        for _, f in self._sent:
            if f.done():
                f.result()
        number = len(self._sent) + 1
        self._sent.append((number, self._pool.submit(
            self._req, "upload_part", UploadId=self._mpu, PartNumber=number, Body=body)))

    def tell(self) -> int:
        """Bytes written so far."""
        return self.written

    def flush(self) -> None:
        """Nothing: parts go out as they fill."""

    def commit(self) -> None:
        """Complete the upload: the object appears, whole."""
        if self.done:
            return
        self.done = True
        try:
            if not self._s3:
                self.store.call(self.key, self.f.close)
            elif self._mpu is None:
                self._req("put_object", Body=bytes(self._buf))
            else:
                if self._buf:
                    self._send(bytes(self._buf))
                    self._buf.clear()
                parts = []
                for number, f in self._sent:
                    out = f.result()
                    part = {"PartNumber": number, "ETag": out["ETag"]}
                    part.update({k: v for k, v in out.items() if k.startswith("Checksum")
                                 and k != "ChecksumType"})
                    parts.append(part)
                self._req("complete_multipart_upload", UploadId=self._mpu,
                          MultipartUpload={"Parts": parts})
                self._close_pool()
        except BaseException:
            self._abort()
            raise
        finally:
            self.store.changed()

    def abort(self) -> None:
        """Abandon the upload (its parts are deleted); nothing appears."""
        if not self.done:
            self.done = True
            self._abort()

    def _close_pool(self) -> None:
        if self._s3 and self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def _abort(self) -> None:
        if not self._s3:
            with contextlib.suppress(Exception):
                self.f.discard()
            with contextlib.suppress(Exception):
                self.f.closed = True
            return
        self._close_pool()  # parts in flight finish first, or they would outlive the abort
        if self._mpu is not None:
            with contextlib.suppress(Exception):
                self._req("abort_multipart_upload", UploadId=self._mpu)
            self._mpu = None

    def __enter__(self) -> Upload:
        return self

    def __exit__(self, et: type[BaseException] | None, *exc: object) -> None:
        if et is None:
            self.commit()
        else:
            self.abort()

