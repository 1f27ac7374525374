"""Object-store settings and wording: URL syntax, the options stores open with, the credentials
kept out of every message, and how a store's failures are told in one line.

Credentials come the standard way (AWS environment variables, profiles, ``AWS_ENDPOINT_URL``)
or from ``--storage-option KEY=VALUE``; :func:`redact` takes them out of every message.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ckpt_cli.errors import UsageError

if TYPE_CHECKING:
    from ckpt_cli.storage.objects import ObjectStore

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]+)://")
"""A URL's scheme (two characters or more, so a Windows drive ``C:`` is never one)."""

CONCURRENCY = 8
"""Default ranged GETs in flight for one stream (``--concurrency``): one large read's
ranges, or the chunks a sequential reader is given ahead of where it reads."""

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


def is_url(text: str | os.PathLike[str]) -> bool:
    """Whether ``text`` is a URL (``scheme://...``) rather than a local path."""
    return isinstance(text, str) and _URL.match(text) is not None


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
        raise UsageError(f"concurrency must be at least 1, not {concurrency}",
                         param="concurrency")
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
            raise UsageError(f"storage_options wants KEY=VALUE, not {_mask_pair(pair)!r}",
                             param="storage_options")
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
                raise UsageError(f"storage_options {key}: {h} is set twice",
                                 param="storage_options")
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
        import fsspec  # type: ignore[import-untyped]  # heavy: fsspec (only URLs pay for it)
    except ImportError:
        raise UsageError(f"{scheme}:// URLs need fsspec: {install_hint(scheme)}") from None
    return fsspec


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
