"""Fixtures and helpers the s3 test modules share."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_cli
from tests.helpers import s3


@pytest.fixture(scope="session")
def endpoint() -> Iterator[tuple[str, s3.Proxy]]:
    """moto's S3 server and the proxy in front of it, for the whole session."""
    with s3.moto_endpoint() as pair:
        yield pair


@pytest.fixture(scope="session")
def bucket_run(endpoint: tuple[str, s3.Proxy], sample_run: Path) -> str:
    """The sample run uploaded to ``s3://<bucket>/run``; returns the bucket."""
    moto, _ = endpoint
    name = s3.new_bucket(moto)
    s3.upload(moto, sample_run, name, "run")
    return name


def _doc(*args: str | Path, code: int = 0) -> dict[str, Any]:
    r = run_cli(*args, "--json")
    assert r.exit_code == code, r.output
    doc: dict[str, Any] = json.loads(r.stdout)
    return doc


_VARYING = {"mtime", "age_seconds", "modified", "created", "elapsed_seconds", "seconds",
            "changed", "duration_seconds"}


def _normal(doc: Any, local: str, url: str) -> Any:
    """``doc`` with the local root spelled as the URL and times dropped."""
    if isinstance(doc, dict):
        return {k: _normal(v, local, url) for k, v in doc.items() if k not in _VARYING}
    if isinstance(doc, list):
        return [_normal(v, local, url) for v in doc]
    if isinstance(doc, str):
        return doc.replace(local, url)
    return doc


# -- bad input and faults: one line naming the URL, exit 2, never a traceback -----------------


def _fails(*args: str, says: str) -> str:
    r = run_cli(*args)
    assert r.exit_code == 2, r.output
    err = r.stderr
    assert "Traceback" not in err and "internal error" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("ckpt: error:")]
    assert len(lines) == 1, err
    assert says in lines[0], lines[0]
    assert s3.SECRET not in r.output and s3.SECRET not in err
    return lines[0]


# -- outputs on object storage: atomic by ordering -----------------------------------------


def _bucket(endpoint: tuple[str, s3.Proxy]) -> str:
    name = f"out-{uuid.uuid4().hex[:10]}"
    s3.client(endpoint[0]).create_bucket(Bucket=name)
    return name


def _keys(endpoint: tuple[str, s3.Proxy], bucket: str, prefix: str = "") -> list[str]:
    c = s3.client(endpoint[0])
    pages = c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


def _pending_uploads(endpoint: tuple[str, s3.Proxy], bucket: str) -> list[str]:
    got = s3.client(endpoint[0]).list_multipart_uploads(Bucket=bucket)
    return [u["Key"] for u in got.get("Uploads", [])]


def _get(endpoint: tuple[str, s3.Proxy], bucket: str, key: str) -> bytes:
    body: bytes = s3.client(endpoint[0]).get_object(Bucket=bucket, Key=key)["Body"].read()
    return body
