"""Where checkpoint bytes live: the only package that knows a local file from an object on a
store. Everything above it asks the capability predicates (:func:`can_rename_atomically`,
:func:`has_file_system`...) and uses the operations here, never "is it remote?".

- ``access``: :func:`locate`, the predicates, :func:`open_regular` and the handles
  (:func:`pread`, :func:`readinto`, :func:`read_full`), listings (:func:`scandir`,
  :func:`walk`), and the operations whose local and object forms differ (:func:`create`,
  :func:`write_whole`, :func:`remove`).
- ``local``: regular files told from FIFOs, sockets and devices; non-blocking opens.
- ``sidefiles``: :func:`read_side`, the one guarded read of a side file (manifest, ledger,
  config, trainer state, index, pointer): regular files only, a size cap per kind
  (:data:`CAPS`); :func:`parse_json`, JSON with its nesting bounded.
- ``objects``: :class:`ObjectStore` (fsspec, listings, block cache, S3 calls) and
  :class:`Upload`; ``objectpath``: :class:`ObjectPath`, :class:`ObjectFile`.
- ``config``: URL syntax, ``--storage-option``, :func:`redact`, failures in one line.
- ``reads``: positioned reads of whole files, CRC-32, thread pools, the memory budget;
  ``atomic``: temp + fsync + rename for local outputs; ``stages``: per-stage busy time for the
  benchmarks. (Imported by their module path.)

This module only re-exports, lazily: ``ckpt --help`` imports none of the submodules, and the
first use of a name imports the one module that defines it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# The errors storage raises, as they were reachable here before the package split.
from ckpt_cli.errors import CkptError as CkptError
from ckpt_cli.errors import StorageError as StorageError
from ckpt_cli.errors import UsageError as UsageError

if TYPE_CHECKING:
    from ckpt_cli.storage.access import (
        Handle as Handle,
    )
    from ckpt_cli.storage.access import (
        Stamp as Stamp,
    )
    from ckpt_cli.storage.access import (
        Window as Window,
    )
    from ckpt_cli.storage.access import (
        can_rename_atomically as can_rename_atomically,
    )
    from ckpt_cli.storage.access import (
        close as close,
    )
    from ckpt_cli.storage.access import (
        create as create,
    )
    from ckpt_cli.storage.access import (
        file_stamp as file_stamp,
    )
    from ckpt_cli.storage.access import (
        has_file_system as has_file_system,
    )
    from ckpt_cli.storage.access import (
        has_multipart_uploads as has_multipart_uploads,
    )
    from ckpt_cli.storage.access import (
        is_int64 as is_int64,
    )
    from ckpt_cli.storage.access import (
        is_remote as is_remote,
    )
    from ckpt_cli.storage.access import (
        is_stamp as is_stamp,
    )
    from ckpt_cli.storage.access import (
        key_url as key_url,
    )
    from ckpt_cli.storage.access import (
        lexists as lexists,
    )
    from ckpt_cli.storage.access import (
        locate as locate,
    )
    from ckpt_cli.storage.access import (
        lstat as lstat,
    )
    from ckpt_cli.storage.access import (
        names_local_path as names_local_path,
    )
    from ckpt_cli.storage.access import (
        open_regular as open_regular,
    )
    from ckpt_cli.storage.access import (
        pread as pread,
    )
    from ckpt_cli.storage.access import (
        read_full as read_full,
    )
    from ckpt_cli.storage.access import (
        readinto as readinto,
    )
    from ckpt_cli.storage.access import (
        reads_are_cheap as reads_are_cheap,
    )
    from ckpt_cli.storage.access import (
        remove as remove,
    )
    from ckpt_cli.storage.access import (
        scandir as scandir,
    )
    from ckpt_cli.storage.access import (
        size_of as size_of,
    )
    from ckpt_cli.storage.access import (
        tree_paths as tree_paths,
    )
    from ckpt_cli.storage.access import (
        walk as walk,
    )
    from ckpt_cli.storage.access import (
        write_whole as write_whole,
    )
    from ckpt_cli.storage.config import (
        CLIENTS as CLIENTS,
    )
    from ckpt_cli.storage.config import (
        CONCURRENCY as CONCURRENCY,
    )
    from ckpt_cli.storage.config import (
        EXTRA_HINT as EXTRA_HINT,
    )
    from ckpt_cli.storage.config import (
        OBJECT_STORES as OBJECT_STORES,
    )
    from ckpt_cli.storage.config import (
        _describe as _describe,
    )
    from ckpt_cli.storage.config import (
        concurrency as concurrency,
    )
    from ckpt_cli.storage.config import (
        configure as configure,
    )
    from ckpt_cli.storage.config import (
        install_hint as install_hint,
    )
    from ckpt_cli.storage.config import (
        is_url as is_url,
    )
    from ckpt_cli.storage.config import (
        parse_options as parse_options,
    )
    from ckpt_cli.storage.config import (
        redact as redact,
    )
    from ckpt_cli.storage.local import (
        not_regular as not_regular,
    )
    from ckpt_cli.storage.local import (
        special_kind as special_kind,
    )
    from ckpt_cli.storage.objectpath import (
        ObjectEntry as ObjectEntry,
    )
    from ckpt_cli.storage.objectpath import (
        ObjectFile as ObjectFile,
    )
    from ckpt_cli.storage.objectpath import (
        ObjectPath as ObjectPath,
    )
    from ckpt_cli.storage.objects import (
        BLOCK as BLOCK,
    )
    from ckpt_cli.storage.objects import (
        CACHE_BLOCKS as CACHE_BLOCKS,
    )
    from ckpt_cli.storage.objects import (
        LARGE_READ as LARGE_READ,
    )
    from ckpt_cli.storage.objects import (
        RANGE_BYTES as RANGE_BYTES,
    )
    from ckpt_cli.storage.objects import (
        STREAM_AFTER as STREAM_AFTER,
    )
    from ckpt_cli.storage.objects import (
        UPLOAD_IDLE as UPLOAD_IDLE,
    )
    from ckpt_cli.storage.objects import (
        UPLOAD_IN_FLIGHT as UPLOAD_IN_FLIGHT,
    )
    from ckpt_cli.storage.objects import (
        UPLOAD_PART as UPLOAD_PART,
    )
    from ckpt_cli.storage.objects import (
        Entry as Entry,
    )
    from ckpt_cli.storage.objects import (
        ObjectStore as ObjectStore,
    )
    from ckpt_cli.storage.objects import (
        Upload as Upload,
    )
    from ckpt_cli.storage.objects import (
        store_for as store_for,
    )
    from ckpt_cli.storage.sidefiles import (
        CAPS as CAPS,
    )
    from ckpt_cli.storage.sidefiles import (
        MAX_JSON_DEPTH as MAX_JSON_DEPTH,
    )
    from ckpt_cli.storage.sidefiles import (
        json_depth_over as json_depth_over,
    )
    from ckpt_cli.storage.sidefiles import (
        load_side_json as load_side_json,
    )
    from ckpt_cli.storage.sidefiles import (
        parse_json as parse_json,
    )
    from ckpt_cli.storage.sidefiles import (
        read_side as read_side,
    )

_WHERE = {
    **dict.fromkeys(("Handle", "Stamp", "Window", "can_rename_atomically", "close", "create",
                    "file_stamp", "has_file_system", "has_multipart_uploads", "is_int64",
                    "is_remote", "is_stamp", "key_url", "lexists", "locate", "lstat",
                    "names_local_path", "open_regular", "pread", "read_full", "reads_are_cheap",
                    "readinto", "remove", "scandir", "size_of", "tree_paths", "walk",
                    "write_whole"), "access"),
    **dict.fromkeys(("CLIENTS", "CONCURRENCY", "EXTRA_HINT", "OBJECT_STORES", "_describe",
                    "concurrency", "configure", "install_hint", "is_url", "parse_options",
                    "redact"), "config"),
    **dict.fromkeys(("not_regular", "special_kind"), "local"),
    **dict.fromkeys(("CAPS", "MAX_JSON_DEPTH", "json_depth_over", "load_side_json", "parse_json",
                     "read_side"),
                    "sidefiles"),
    **dict.fromkeys(("ObjectEntry", "ObjectFile", "ObjectPath"), "objectpath"),
    **dict.fromkeys(("BLOCK", "CACHE_BLOCKS", "LARGE_READ", "RANGE_BYTES", "STREAM_AFTER",
                    "UPLOAD_IDLE", "UPLOAD_IN_FLIGHT", "UPLOAD_PART", "Entry", "ObjectStore",
                    "Upload", "store_for"), "objects"),
}
"""Which submodule defines each name re-exported here."""

if not TYPE_CHECKING:  # mypy sees the names above, so a misspelt one is still an error

    def __getattr__(name: str) -> Any:
        mod = _WHERE.get(name)
        if mod is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
        globals()[name] = value  # later uses find it without coming here
        return value

    def __dir__() -> list[str]:
        return sorted([*globals(), *_WHERE])
