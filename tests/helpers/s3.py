"""A real S3 endpoint for tests and benchmarks: moto's server on 127.0.0.1, and a proxy in
front of it that counts requests and bytes and can inject faults (503 SlowDown, 403, a
connection dropped in the middle of an object).

Requests are real HTTP with real SigV4 signing by botocore; nothing in the client is mocked.
"""

from __future__ import annotations

import http.client
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

SECRET = "sEcReT-4d8f1b9e-never-print-me"
"""The secret access key tests use: it must never appear in any output."""

ACCESS_KEY = "AKIACKPTTESTKEY00001"


@dataclass
class Traffic:
    """What the proxy saw: requests by method, bytes of response bodies sent."""

    requests: int = 0
    lists: int = 0
    by_method: dict[str, int] = field(default_factory=dict)
    bytes_out: int = 0
    log: list[str] = field(default_factory=list)  # "METHOD path range" of each request
    lock: threading.Lock = field(default_factory=threading.Lock)

    def reset(self) -> None:
        with self.lock:
            self.requests, self.lists, self.bytes_out = 0, 0, 0
            self.by_method.clear()
            self.log.clear()


@dataclass
class Faults:
    """Faults the proxy injects. ``status`` answers every request (while ``remaining`` is
    above 0, or always if None) with that error; ``cut_after`` sends only that many bytes of
    a GET's body and drops the connection."""

    status: int | None = None
    remaining: int | None = None
    cut_after: int | None = None
    cut_remaining: int | None = None
    only_method: str | None = None
    only_path: str | None = None  # faults apply to requests whose path holds this

    def clear(self) -> None:
        self.status = self.remaining = self.cut_after = self.cut_remaining = None
        self.only_method = self.only_path = None


_ERROR_BODIES = {
    503: ("SlowDown", "Please reduce your request rate."),
    403: ("AccessDenied", "Access Denied"),
    500: ("InternalError", "We encountered an internal error. Please try again."),
}


class Proxy:
    """A counting, fault-injecting HTTP proxy in front of an endpoint."""

    def __init__(self, upstream_host: str, upstream_port: int):
        self.upstream = (upstream_host, upstream_port)
        self.traffic = Traffic()
        self.faults = Faults()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                return None

            def _handle(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                with proxy.traffic.lock:
                    proxy.traffic.requests += 1
                    proxy.traffic.by_method[self.command] = (
                        proxy.traffic.by_method.get(self.command, 0) + 1)
                    if self.command == "GET" and "list-type=" in self.path:
                        proxy.traffic.lists += 1
                    proxy.traffic.log.append(
                        f"{self.command} {self.path} {self.headers.get('Range', '')}")
                f = proxy.faults
                applies = ((f.only_method is None or f.only_method == self.command)
                           and (f.only_path is None or f.only_path in self.path))
                if f.status is not None and applies and (f.remaining is None or f.remaining > 0):
                    if f.remaining is not None:
                        f.remaining -= 1
                    code, msg = _ERROR_BODIES.get(f.status, ("Error", "error"))
                    xml = (f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code>"
                           f"<Message>{msg}</Message></Error>").encode()
                    self.send_response(f.status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(xml)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(xml)
                    return
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                headers = dict(self.headers.items())
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                conn.close()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                # A HEAD's length is the object's, not that of the (empty) body.
                self.send_header("Content-Length", resp.getheader("Content-Length", "0")
                                 if self.command == "HEAD" else str(len(data)))
                self.end_headers()
                if self.command == "HEAD":
                    return
                if (f.cut_after is not None and applies and self.command == "GET"
                        and len(data) > f.cut_after
                        and (f.cut_remaining is None or f.cut_remaining > 0)):
                    if f.cut_remaining is not None:
                        f.cut_remaining -= 1
                    self.wfile.write(data[:f.cut_after])
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return
                self.wfile.write(data)
                with proxy.traffic.lock:
                    proxy.traffic.bytes_out += len(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextmanager
def moto_endpoint() -> Iterator[tuple[str, Proxy]]:
    """Start moto's S3 server on 127.0.0.1 and a proxy in front of it.

    Yields:
        ``(moto's URL, the proxy)``; point clients at ``proxy.url``.
    """
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    proxy = Proxy(host, port)
    try:
        yield f"http://{host}:{port}", proxy
    finally:
        proxy.close()
        server.stop()


@contextmanager
def moto_process_endpoint() -> Iterator[tuple[str, Proxy]]:
    """Like :func:`moto_endpoint`, with moto in a process of its own (benchmarks: the objects
    it holds must not count in the peak RSS of the processes measured, which a child forked
    from the process holding them would report)."""
    import subprocess
    import sys
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(url + "/moto-api/", timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        proxy = Proxy("127.0.0.1", port)
        try:
            yield url, proxy
        finally:
            proxy.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def env_for(endpoint: str) -> dict[str, str]:
    """The environment a client needs to reach ``endpoint`` with the test credentials."""
    return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint,
            "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": "/nonexistent",
            "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent"}


def client(endpoint: str) -> Any:
    """A boto3 S3 client for setting up fixtures (uploads, buckets)."""
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=ACCESS_KEY,
                        aws_secret_access_key=SECRET, region_name="us-east-1")


def upload(endpoint: str, local: Path, bucket: str, prefix: str) -> None:
    """Upload a file, or a directory tree (symlinks skipped), under ``bucket/prefix``."""
    c = client(endpoint)
    if local.is_file():
        c.upload_file(str(local), bucket, prefix)
        return
    for p in sorted(local.rglob("*")):
        if p.is_file() and not p.is_symlink():
            c.upload_file(str(p), bucket, f"{prefix}/{p.relative_to(local).as_posix()}")


@contextmanager
def client_env(proxy: Proxy, monkeypatch: Any) -> Iterator[Proxy]:
    """The test credentials and ``proxy``'s endpoint in the environment (``AWS_PROFILE``
    unset), with ckpt's storage options reset on the way in and out."""
    from ckpt_cli import storage

    for k, v in env_for(proxy.url).items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    storage.configure({})
    yield proxy
    storage.configure({})


def new_bucket(endpoint: str) -> str:
    """Create a bucket with a fresh random name on ``endpoint``; returns its name."""
    import uuid

    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    client(endpoint).create_bucket(Bucket=name)
    return name
