"""Where checkpoint bytes live: local files, or objects behind an fsspec URL.

Readers take a :class:`~pathlib.Path` and read through the handle :func:`ckpt_cli.formats.base.
open_regular` returns. For a local path that is a file descriptor read with ``os.pread``; for a
URL (``s3://bucket/run/step_9000``, ``gs://``, ``az://``, any protocol fsspec knows) the path is
an :class:`ObjectPath` and the handle an :class:`ObjectFile`, which reads with ranged GETs
through a small block cache. Local paths never import fsspec.

An object store has no directories, only keys. The first question about a prefix lists it
once, recursively (a LIST call per 1,000 keys), and every later ``stat``, ``is_file`` or
``iterdir`` below it is answered from that listing: inspecting a run directory of 100
checkpoints costs a few LIST pages plus the metadata reads, not a HEAD per file.

Credentials come the standard way (AWS environment variables, profiles, ``AWS_ENDPOINT_URL``)
or from ``--storage-option KEY=VALUE``; :func:`redact` takes them out of every message.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from ckpt_cli.errors import CkptError, StorageError, UsageError

if TYPE_CHECKING:  # imported when a URL is used: local paths and --help never pay for them
    from concurrent.futures import Future, ThreadPoolExecutor

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]+)://")
"""A URL's scheme (two characters or more, so a Windows drive ``C:`` is never one)."""

BLOCK = 256 << 10
"""Bytes fetched per small read: a safetensors header, a zip's end records and central
directory, a ``data.pkl`` usually fit one or two blocks."""

CACHE_BLOCKS = 256
"""Blocks a store keeps (64 MiB): enough for every structure readers revisit."""

LARGE_READ = 4 << 20
"""Reads at least this large (tensor data) bypass the cache."""

RANGE_BYTES = 8 << 20
"""Bytes per ranged GET of a large read; a large read's ranges are fetched concurrently."""

CONCURRENCY = 8
"""Default ranged GETs in flight for one stream (``--concurrency``): one large read's
ranges, or the chunks a sequential reader is given ahead of where it reads."""

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

EXTRA_HINT = "pip install 'ckpt-cli[s3]'"

CLIENTS = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs",
           "abfs": "adlfs", "abfss": "adlfs", "adl": "adlfs", "oss": "ossfs"}
"""The package fsspec needs for each scheme (``memory://`` is fsspec's own)."""


def install_hint(scheme: str, *, fsspec: bool = True) -> str:
    """What to install for ``scheme://`` URLs: the ``s3`` extra, else fsspec's client.

    Args:
        scheme: The URL scheme.
        fsspec: Whether fsspec itself is missing too.

    Returns:
        The ``pip install`` command.
    """
    client = CLIENTS.get(scheme)
    if client == "s3fs":
        return EXTRA_HINT
    return "pip install " + " ".join(p for p in ("fsspec" if fsspec else None, client) if p)

OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss",
                           "memory"})
"""Schemes whose URLs are ``scheme://bucket/key`` (fsspec's object stores): the ones ckpt
takes. Others (``http://``, ``ftp://``...) name a host, not a bucket."""

_SECRET_KEYS = re.compile(r"secret|token|password|passwd|credential|key$|^key|sas|signature",
                          re.IGNORECASE)
_SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
               "AZURE_STORAGE_KEY", "AZURE_STORAGE_SAS_TOKEN", "AZURE_STORAGE_CONNECTION_STRING",
               "AZURE_CLIENT_SECRET", "GOOGLE_OAUTH_ACCESS_TOKEN", "AWS_ACCESS_KEY_ID")
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]+://)[^/@\s]+@")

_lock = threading.RLock()
_concurrency = CONCURRENCY
_options: dict[str, Any] = {}
_stores: dict[str, ObjectStore] = {}
_classes: dict[str, type[ObjectPath]] = {}


def is_url(text: str | os.PathLike[str]) -> bool:
    """Whether ``text`` is a URL (``scheme://...``) rather than a local path."""
    return isinstance(text, str) and _URL.match(text) is not None


def is_remote(path: object) -> bool:
    """Whether ``path`` names an object on a store (an :class:`ObjectPath`)."""
    return isinstance(path, ObjectPath)


def locate(text: str | os.PathLike[str]) -> Path:
    """A local :class:`Path` for a path or ``file://`` URL, an :class:`ObjectPath` for others.

    The store itself is opened at the first read, with the options :func:`configure` set.

    Args:
        text: A command-line argument.

    Returns:
        Something path-like every reader takes (typed ``Path``: an :class:`ObjectPath`
        answers the subset of ``Path`` readers use).
    """
    if isinstance(text, ObjectPath):
        return cast(Path, text)
    if not isinstance(text, str) or not is_url(text):
        return Path(text)
    m = _URL.match(text)
    assert m is not None
    scheme = m.group(1).lower()
    rest = text[m.end():]
    if scheme == "file":
        return Path("/" + rest.lstrip("/")) if rest.startswith("/") else Path(rest)
    if scheme not in OBJECT_STORES:
        raise UsageError(f"{scheme}:// is not an object store ckpt reads; URLs may be "
                         f"{', '.join(s + '://' for s in sorted(OBJECT_STORES))}")
    if "@" in rest.split("/", 1)[0]:
        raise UsageError(f"{redact(text)}: credentials in a URL are not accepted; use the "
                         "standard environment variables or --storage-option")
    rest = rest.strip("/")
    if not rest:
        raise UsageError(f"{text}: name a bucket (and a key or prefix)")
    return cast(Path, _path_class(scheme)("/" + rest))


def configure(options: Mapping[str, Any], concurrency: int | None = None) -> None:
    """Set the fsspec options every store is opened with (``--storage-option``).

    Stores opened before are dropped, so the next read opens them with these options.

    Args:
        options: fsspec keyword arguments.
        concurrency: Ranged GETs in flight per stream (default :data:`CONCURRENCY`).

    Raises:
        UsageError: If ``concurrency`` is below 1.
    """
    global _concurrency
    if concurrency is not None and concurrency < 1:
        raise UsageError(f"--concurrency must be at least 1, not {concurrency}")
    with _lock:
        _options.clear()
        _options.update(options)
        for st in _stores.values():
            st.shutdown()
        _stores.clear()
        _concurrency = concurrency or CONCURRENCY


def concurrency() -> int:
    """Ranged GETs in flight per stream (``--concurrency``)."""
    return _concurrency


def parse_options(pairs: list[str] | None) -> dict[str, Any]:
    """``KEY=VALUE`` strings as fsspec keyword arguments.

    ``true``/``false``/``none`` become booleans and None, integers become ints, and dotted keys
    nest (``client_kwargs.region_name=eu-west-1``).

    Raises:
        UsageError: For an item without ``=`` or with an empty key.
    """
    out: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, raw = pair.partition("=")
        key = key.strip()
        if not sep or not key or any(not k for k in key.split(".")):
            raise UsageError(f"--storage-option wants KEY=VALUE, not {_mask_pair(pair)!r}")
        value: Any = raw
        low = raw.strip().lower()
        if low in ("true", "false"):
            value = low == "true"
        elif low in ("none", "null"):
            value = None
        elif re.fullmatch(r"-?\d+", raw.strip()):
            value = int(raw)
        *heads, last = key.split(".")
        node = out
        for h in heads:
            nxt = node.setdefault(h, {})
            if not isinstance(nxt, dict):
                raise UsageError(f"--storage-option {key}: {h} is set twice")
            node = nxt
        node[last] = value
    return out


def _mask_pair(pair: str) -> str:
    key, sep, _ = pair.partition("=")
    return f"{key}=***" if sep else pair


def _secrets() -> list[str]:
    found: list[str] = []

    def walk(node: Mapping[str, Any]) -> None:
        for k, v in node.items():
            if isinstance(v, Mapping):
                walk(v)
            elif isinstance(v, str) and len(v) >= 4 and _SECRET_KEYS.search(k):
                found.append(v)

    with _lock:
        walk(_options)
    found.extend(v for name in _SECRET_ENV if len(v := os.environ.get(name, "")) >= 4)
    return sorted(set(found), key=len, reverse=True)


def redact(text: str) -> str:
    """``text`` with every credential ckpt knows of replaced by ``***``.

    Covers ``--storage-option`` values whose key names a secret, the standard credential
    environment variables, and ``user:password@`` in URLs.
    """
    for s in _secrets():
        text = text.replace(s, "***")
    return _USERINFO.sub(r"\g<scheme>***@", text)


def _import_fsspec(scheme: str) -> Any:
    try:
        import fsspec  # type: ignore[import-untyped]  # only URLs pay for it
    except ImportError:
        raise UsageError(f"{scheme}:// URLs need fsspec: {install_hint(scheme)}") from None
    return fsspec


def store_for(scheme: str) -> ObjectStore:
    """The store of ``scheme``, opened at first use with the configured options."""
    with _lock:
        st = _stores.get(scheme)
        if st is None:
            st = _stores[scheme] = ObjectStore(scheme, dict(_options))
        return st


def _path_class(scheme: str) -> type[ObjectPath]:
    with _lock:
        cls = _classes.get(scheme)
        if cls is None:
            # One subclass per scheme: pathlib builds children with type(self), so a child
            # of s3://b/run knows it lives on s3 without carrying a reference.
            cls = _classes[scheme] = type(f"ObjectPath_{scheme}", (ObjectPath,),
                                          {"scheme": scheme})
        return cls


class Entry(NamedTuple):
    """What a listing says of one key."""

    is_dir: bool
    size: int
    mtime: float


def _mtime(info: Mapping[str, Any]) -> float:
    from datetime import datetime

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
                                   _mtime(info))
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
        from concurrent.futures import ThreadPoolExecutor

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
        from fsspec.asyn import sync  # type: ignore[import-untyped]

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
        from concurrent.futures import Future

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


def _reraise(e: BaseException) -> None:
    raise e


def _short(e: BaseException) -> str:
    msg = redact(" ".join(str(e).split()))
    return msg[:200] if msg else type(e).__name__


def _not_found(e: FileNotFoundError) -> str:
    msg = str(e).lower()
    # The phrase, not the word: a missing key's message is its path, which may hold "bucket".
    if "bucket does not exist" in msg or "nosuchbucket" in msg:
        return "no such bucket"
    return "no such key"


def _describe(e: BaseException) -> str:
    name = type(e).__name__
    msg = _short(e)
    # Status codes are looked for outside URLs: the endpoint http://127.0.0.1:53403/ holds
    # no 403 (a test found that out, with a random port).
    low = _URL_TEXT.sub(" ", f"{name} {msg}".lower())
    if "credential" in low and ("unable to locate" in low or "nocredentials" in low):
        return ("no credentials found (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, a "
                "profile, or --storage-option anon=true for a public bucket)")
    if (any(w in low for w in ("invalidaccesskeyid", "signaturedoesnotmatch", "accessdenied",
                               "forbidden")) or _STATUS_403.search(low)):
        return f"access denied ({msg})"
    if (any(w in low for w in ("slowdown", "serviceunavailable", "throttl",
                               "too many requests", "reduce your request rate"))
            or _STATUS_503.search(low)):
        return f"the store keeps refusing requests (throttled: {msg})"
    if any(w in low for w in ("connect", "endpoint", "timeout", "timed out", "reset",
                              "disconnected", "payload")):
        return f"cannot reach the storage endpoint ({msg})"
    return f"storage error ({name}: {msg})"


_URL_TEXT = re.compile(r"[a-z][a-z0-9+.\-]*://\S+")
_STATUS_403 = re.compile(r"(?<![\d.:/])403(?!\d)")
_STATUS_503 = re.compile(r"(?<![\d.:/])503(?!\d)")


class ObjectFile:
    """An object opened for positioned reads: ranged GETs through the store's block cache.

    Small reads (headers, central directories, pickles) fetch whole :data:`BLOCK`-aligned
    blocks, coalescing neighbouring missing blocks into one GET, and keep them in a cache the
    store shares between every open of the object (a sniff, then a parse, read the same
    header once). Reads of :data:`LARGE_READ` or more (tensor data) go straight to
    concurrent ranged GETs of :data:`RANGE_BYTES`.

    Args:
        store: The store.
        key: The object's key.
        size: Its size (from the listing).
    """

    def __init__(self, store: ObjectStore, key: str, size: int):
        self.store, self.key, self.size = store, key, size
        self._local = threading.local()  # where each thread reading it is
        self._chunks: OrderedDict[int, Future[bytes]] = OrderedDict()
        self._readers: dict[int, tuple[int, int]] = {}  # thread -> (its chunk, when)
        self._tick = 0
        self._chunk_lock = threading.Lock()

    @property
    def url(self) -> str:
        """The object's URL."""
        return self.store.url(self.key)

    def cached(self, offset: int, n: int) -> bool:
        """Whether ``[offset, offset + n)`` is already in the cache (no request needed)."""
        first, last = offset // BLOCK, max(offset, offset + n - 1) // BLOCK
        return self.store.has_blocks(self.key, range(first, last + 1))

    def pread(self, n: int, offset: int) -> bytes:
        """Up to ``n`` bytes at ``offset`` (fewer only at the end of the object)."""
        end = min(self.size, offset + max(0, n))
        if end <= offset:
            return b""
        if end - offset >= LARGE_READ:
            return b"".join(self.store.fetch(self.key, _ranges(offset, end)))
        st = self._stream()
        if offset == st.next:
            st.run += end - offset
        else:
            st.run = end - offset
        st.next = end
        if st.run > STREAM_AFTER or self._chunk_at(offset):
            return self._streamed(offset, end)
        first, last = offset // BLOCK, (end - 1) // BLOCK
        data = b"".join(self.store.blocks(self.key, self.size, range(first, last + 1)))
        lo = offset - first * BLOCK
        return data[lo:lo + (end - offset)]

    def _stream(self) -> _Stream:
        st: _Stream | None = getattr(self._local, "stream", None)
        if st is None:
            st = self._local.stream = _Stream()
        return st

    def _chunk_at(self, offset: int) -> bool:
        """Whether the chunk holding ``offset`` was read ahead already (another thread's
        pass reached it): then it serves this read too, however short."""
        with self._chunk_lock:
            return offset // RANGE_BYTES in self._chunks

    def _streamed(self, offset: int, end: int) -> bytes:
        """Serve sequential readers from :data:`RANGE_BYTES` chunks fetched ahead of them.

        The chunks are shared by every thread reading the object (validate checks the
        records of one file on several threads, each reading its own stretch, and a chunk
        may straddle two stretches). Each reader's position is known; a chunk stays while a
        reader is in it or within its read-ahead window; others are kept, least recently used
        first out, up to ``2 x concurrency + readers`` chunks (a dropped chunk's fetch, if
        still running, is left to finish: another reader may wait on it). The readers share
        :func:`concurrency` chunks of read-ahead between them, so memory stays bounded
        whatever the number of threads.
        """
        me = threading.get_ident()
        first, last = offset // RANGE_BYTES, (end - 1) // RANGE_BYTES
        n_chunks = -(-self.size // RANGE_BYTES)
        with self._chunk_lock:
            self._tick += 1
            self._readers[me] = (first, self._tick)
            # A reader not heard from in a while has moved on to other work.
            for tid, (_, seen) in list(self._readers.items()):
                if self._tick - seen > _READER_STALE:
                    del self._readers[tid]
            ahead = max(1, concurrency() // len(self._readers))
            windows = [(pos, pos + max(ahead, 1)) for pos, _ in self._readers.values()]
            windows.append((first, last + 1))
            for c in range(first, min(max(last + 1, first + ahead), n_chunks)):
                if c not in self._chunks:
                    lo, hi = c * RANGE_BYTES, min(self.size, (c + 1) * RANGE_BYTES)
                    self._chunks[c] = self.store.submit(self.key, lo, hi)
            for c in range(first, last + 1):
                self._chunks.move_to_end(c)
            futures = [self._chunks[c] for c in range(first, last + 1)]
            # Past the cap, the least recently used chunks no reader's window covers go (a
            # chunk that straddles two stretches often waits there for the second reader).
            cap = 2 * concurrency() + len(self._readers)
            for c in [c for c in self._chunks if not any(lo <= c < hi for lo, hi in windows)]:
                if len(self._chunks) <= cap:
                    break
                del self._chunks[c]
        parts = [f.result() for f in futures]
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        lo = offset - first * RANGE_BYTES
        return data[lo:lo + (end - offset)]

    def fetch_ranges(self, ranges: list[tuple[int, int]]) -> list[bytes]:
        """Many small ``(offset, n)`` ranges at once, concurrently, past the cache (a zip's
        scattered local headers)."""
        return self.store.fetch(self.key, [(o, min(self.size, o + n)) for o, n in ranges])

    def readinto(self, out: memoryview, offset: int) -> int:
        """Fill ``out`` from ``offset``; returns how many bytes (fewer only at the end)."""
        end = min(self.size, offset + len(out))
        if end - offset >= LARGE_READ:  # each range straight into place: no joined copy
            got = 0
            ranges = _ranges(offset, end)
            for (s, _), data in zip(ranges, self.store.fetch(self.key, ranges), strict=True):
                out[s - offset:s - offset + len(data)] = data
                got += len(data)
            return got
        data = self.pread(len(out), offset)
        out[:len(data)] = data
        return len(data)

    def close(self) -> None:
        """Drop the chunks read ahead (the block cache is the store's)."""
        with self._chunk_lock:
            self._chunks.clear()
            self._readers.clear()


def _ranges(offset: int, end: int) -> list[tuple[int, int]]:
    """``[offset, end)`` as the :data:`RANGE_BYTES` ranges of concurrent GETs."""
    return [(s, min(end, s + RANGE_BYTES)) for s in range(offset, end, RANGE_BYTES)]


class _Stream:
    """One thread's pass over an object: where it will read next, and how far it has read
    contiguously (a long run is served from chunks read ahead)."""

    def __init__(self) -> None:
        self.next, self.run = -1, 0


Handle = int | ObjectFile
"""What :func:`ckpt_cli.formats.base.open_regular` returns: a descriptor or an object."""


class Window(io.RawIOBase):
    """A read-only, seekable view of ``length`` bytes at ``start`` of an open handle.

    Args:
        fd: An open descriptor or object handle.
        start: First byte of the view.
        length: Length of the view.
        owns: Whether closing the view closes the handle.
    """

    def __init__(self, fd: Handle, start: int, length: int, *, owns: bool = False):
        super().__init__()
        self.fd, self.start, self.length, self.pos, self.owns = fd, start, length, 0, owns

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.length}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self.length - self.pos))
        if n == 0:
            return 0
        data = pread(self.fd, n, self.start + self.pos)
        b[: len(data)] = data
        self.pos += len(data)
        return len(data)

    def close(self) -> None:
        if self.owns and not self.closed:
            close(self.fd)
        super().close()


def pread(h: Handle, n: int, offset: int) -> bytes:
    """``os.pread`` for either kind of handle."""
    if isinstance(h, int):
        return os.pread(h, n, offset)
    return h.pread(n, offset)


def readinto(h: Handle, out: memoryview, offset: int) -> int:
    """One positioned read into ``out`` (``os.preadv``); may return fewer bytes locally."""
    if isinstance(h, int):
        return os.preadv(h, [out], offset)
    return h.readinto(out, offset)


def size_of(h: Handle) -> int:
    """The size of the file or object behind a handle."""
    if isinstance(h, int):
        return os.fstat(h).st_size
    return h.size


def close(h: Handle) -> None:
    """Close a handle."""
    if isinstance(h, int):
        os.close(h)
    else:
        h.close()


class ObjectPath(PurePosixPath):
    """A key or prefix on an object store, answering the part of ``Path`` readers use.

    ``str()`` gives the URL. There are no symlinks; a prefix with keys below it is a
    directory. Anything that would need a local file (``os.open``, ``os.fspath``) raises
    :class:`~ckpt_cli.errors.UsageError` naming the URL instead of touching the local disk.
    """

    scheme = ""

    @property
    def store(self) -> ObjectStore:
        """The store this path lives on."""
        return store_for(self.scheme)

    @property
    def key(self) -> str:
        """The key (``bucket/prefix/name``) as fsspec names it."""
        return PurePosixPath.__str__(self).strip("/")

    def __str__(self) -> str:
        # Held as /bucket/key: relative_to() gives relative paths, which print plainly.
        if not self.is_absolute():
            return PurePosixPath.__str__(self)
        return f"{self.scheme}://{self.key}"

    def as_posix(self) -> str:
        """The URL, or a relative path as is."""
        return str(self)

    def __repr__(self) -> str:
        return f"ObjectPath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        # pathlib compares parts only: s3://b/x would equal gs://b/x and the local /b/x.
        if not isinstance(other, ObjectPath):
            return False
        return self.scheme == other.scheme and PurePosixPath.__eq__(self, other)

    def __hash__(self) -> int:
        return hash((self.scheme, PurePosixPath.__str__(self)))

    def __fspath__(self) -> str:
        raise UsageError(f"{self}: this needs a local file (object storage is not supported "
                         "here yet)")

    def as_uri(self) -> str:
        """The URL."""
        return str(self)

    def _entry(self) -> Entry | None:
        return self.store.lookup(self.key)

    def stat(self, *, follow_symlinks: bool = True) -> os.stat_result:
        """A ``stat`` result from the listing (mode, size, modification time).

        Raises:
            FileNotFoundError: When nothing is stored at or below this key.
        """
        e = self._entry()
        if e is None:
            raise FileNotFoundError(2, "No such file or directory", str(self))
        mode = (stat.S_IFDIR | 0o755) if e.is_dir else (stat.S_IFREG | 0o644)
        ns = int(e.mtime * 1e9)
        return os.stat_result((mode, 0, 0, 1, 0, 0, e.size, int(e.mtime), int(e.mtime),
                               int(e.mtime), e.mtime, e.mtime, e.mtime, ns, ns, ns))

    def lstat(self) -> os.stat_result:
        """The same as :meth:`stat`: objects are never links."""
        return self.stat()

    def exists(self, *, follow_symlinks: bool = True) -> bool:
        """Whether a key, or keys below this prefix, exist."""
        return self._entry() is not None

    def is_file(self) -> bool:
        """Whether this is a key holding an object."""
        e = self._entry()
        return e is not None and not e.is_dir

    def is_dir(self) -> bool:
        """Whether keys exist below this prefix."""
        e = self._entry()
        return e is not None and e.is_dir

    def is_symlink(self) -> bool:
        """Never: object stores have no links."""
        return False

    def is_mount(self) -> bool:
        """Never."""
        return False

    def iterdir(self) -> Iterator[ObjectPath]:
        """The keys and prefixes directly below this one."""
        if not self.is_dir():
            raise NotADirectoryError(20, "Not a directory", str(self))
        for name in self.store.children(self.key):
            yield self / name

    def glob(self, pattern: str) -> Iterator[ObjectPath]:
        """Children matching a one-level ``pattern`` (``*.safetensors``)."""
        from fnmatch import fnmatchcase

        if "/" in pattern or "**" in pattern:
            raise UsageError(f"{self}: glob {pattern!r} across levels is not supported")
        for child in self.iterdir():
            if fnmatchcase(child.name, pattern):
                yield child

    def resolve(self, strict: bool = False) -> ObjectPath:
        """Itself: keys have no links to resolve."""
        return self

    def absolute(self) -> ObjectPath:
        """Itself."""
        return self

    def expanduser(self) -> ObjectPath:
        """Itself."""
        return self

    def readlink(self) -> ObjectPath:
        """Always fails: objects are never links."""
        raise OSError(22, "Invalid argument (not a link)", str(self))

    def samefile(self, other: object) -> bool:
        """Whether ``other`` names the same key on the same store."""
        return isinstance(other, ObjectPath) and str(other) == str(self)

    def open_object(self) -> ObjectFile:
        """Open the object for positioned reads.

        Raises:
            StorageError: If there is no such key.
            CkptError: If it is a prefix, not an object.
        """
        e = self._entry()
        if e is None:
            raise StorageError("no such key", path=str(self))
        if e.is_dir:
            raise CkptError("a directory (prefix), not a file", path=str(self))
        return ObjectFile(self.store, self.key, e.size)

    def read_bytes(self) -> bytes:
        """The whole object (used for small files only)."""
        f = self.open_object()
        return f.pread(f.size, 0)

    def read_text(self, encoding: str | None = None, errors: str | None = None) -> str:
        """The whole object as text."""
        return self.read_bytes().decode(encoding or "utf-8", errors or "strict")

    def write_bytes(self, data: bytes) -> int:
        """Store ``data`` as this object (one PUT: it appears whole or not at all)."""
        with Upload(self) as up:
            up.write(data)
        return len(data)

    def unlink(self, missing_ok: bool = False) -> None:
        """Delete the object.

        Raises:
            FileNotFoundError: If there is none and ``missing_ok`` is False.
        """
        if not self.is_file():
            if missing_ok:
                return
            raise FileNotFoundError(2, "No such file or directory", str(self))
        self.store.delete([self.key])

    def keys_below(self) -> list[str]:
        """Every object key at or below this prefix."""
        e = self._entry()
        if e is None:
            return []
        if not e.is_dir:
            return [self.key]
        self.store.children(self.key)
        with self.store._lock:
            return sorted(k for k, v in self.store._entries.items()
                          if not v.is_dir and k.startswith(self.key + "/"))


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
        from concurrent.futures import ThreadPoolExecutor

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


class ObjectEntry:
    """What :func:`scandir` yields for an object store: the ``os.DirEntry`` subset the run
    listing uses (never a link; ``path`` is the URL, which :func:`locate` turns back)."""

    __slots__ = ("_p", "name", "path")

    def __init__(self, p: ObjectPath):
        self._p, self.name, self.path = p, p.name, str(p)

    def is_dir(self, *, follow_symlinks: bool = True) -> bool:
        return self._p.is_dir()

    def is_file(self, *, follow_symlinks: bool = True) -> bool:
        return self._p.is_file()

    def is_symlink(self) -> bool:
        return False

    def stat(self, *, follow_symlinks: bool = True) -> os.stat_result:
        return self._p.stat()


class _Listing:
    def __init__(self, entries: list[ObjectEntry]):
        self._entries = entries

    def __enter__(self) -> Iterator[ObjectEntry]:
        return iter(self._entries)

    def __exit__(self, *exc: object) -> None:
        return None


def scandir(path: str | Path) -> Any:
    """``os.scandir`` for a local path or URL, an object store's prefix included.

    Returns:
        A context manager yielding entries with ``name``, ``path``, ``is_dir()``,
        ``is_file()``, ``is_symlink()`` and ``stat()``.

    Raises:
        OSError: If it cannot be listed (``NotADirectoryError`` for an object or nothing).
    """
    p = path if isinstance(path, ObjectPath) else locate(path) if is_url(path) else None
    if p is None:
        return os.scandir(path)
    obj = cast(ObjectPath, p)
    return _Listing([ObjectEntry(c) for c in obj.iterdir()])


def lexists(path: str | Path) -> bool:
    """``os.path.lexists`` for a local path or an object."""
    if isinstance(path, ObjectPath):
        return path.exists()
    return os.path.lexists(path)


def lstat(path: str | Path) -> os.stat_result:
    """``os.lstat`` for a local path or an object."""
    if isinstance(path, ObjectPath):
        return path.stat()
    return os.lstat(path)


def walk(path: Path, onerror: Callable[[OSError], None] | None = None
         ) -> Iterator[tuple[Path, list[str], list[str]]]:
    """``os.walk`` (top-down, ``dirnames`` prunable) for a local directory or a prefix.

    Yields:
        ``(directory, subdirectory names, file names)``, the directory as a path.
    """
    if not isinstance(path, ObjectPath):
        for d, dirs, files in os.walk(path, onerror=onerror):
            yield Path(d), dirs, files
        return
    stack: list[ObjectPath] = [path]
    while stack:
        d = stack.pop()
        kids = list(d.iterdir())
        dirs = [k.name for k in kids if k.is_dir()]
        files = [k.name for k in kids if not k.is_dir()]
        yield cast(Path, d), dirs, files
        stack.extend(d / n for n in reversed(dirs))


def tree_paths(path: Path) -> Iterator[tuple[str, os.stat_result]]:
    """Every object below a prefix with its ``stat`` (from the listing), for tree totals."""
    obj = cast(ObjectPath, path)
    for k in obj.keys_below():
        child = type(obj)("/" + k)
        yield str(child), child.stat()
