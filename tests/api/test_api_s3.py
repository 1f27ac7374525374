"""The Python API on URLs: ``ckpt_cli.inspect("s3://...")`` and the rest read through a real
S3 endpoint (moto's server on 127.0.0.1, as in tests/storage/test_s3.py) and return the CLI's
documents for the same URL."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import pytest
from typer.testing import Result

import ckpt_cli
from ckpt_cli.errors import UsageError
from tests.api.test_api import stable
from tests.helpers import s3

# moto's S3 server and the sample run uploaded to it: test_s3.py's session fixtures.
from tests.storage.conftest import bucket_run, endpoint  # noqa: F401

pytestmark = [pytest.mark.requires_torch,  # the sample run is written with torch
              # botocore and moto call datetime.utcnow() and friends; not ckpt's code.
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def _doc(result: Result, code: int = 0) -> Any:
    assert result.exit_code == code, result.output
    return json.loads(result.stdout)


def test_functions_take_urls(s3env: s3.Proxy, bucket_run: str,  # noqa: F811 (the fixture)
                             cli: Callable[..., Result]) -> None:
    run = f"s3://{bucket_run}/run"
    r = ckpt_cli.inspect(run)
    assert r.to_dict() == _doc(cli("inspect", run, "--json"))
    assert r.to_dict()["path"] == run and s3env.traffic.requests > 0
    v = ckpt_cli.validate(f"{run}/step_000100", quick=True)
    assert v.ok
    cli_doc = _doc(cli("validate", f"{run}/step_000100", "--quick", "--json"))
    assert stable(v.to_dict()) == stable(cli_doc)
    d = ckpt_cli.diff(f"{run}/step_000100", f"{run}/step_000100", structure_only=True)
    assert d.equal
    p = ckpt_cli.prune(run, keep=1, grace=0)
    cli_prune = _doc(cli("prune", run, "--keep", "1", "--grace", "0", "--dry-run", "--json"))
    # The same document, its reasons naming options as each caller spells them.
    assert "keep=1" in str(p.to_dict()) and "--keep 1" in str(cli_prune)
    assert dataclasses.replace(p, caller="cli").to_dict() == cli_prune
    assert p.to_dict()["object_store"] is not None
    with pytest.raises(UsageError, match=r"^write_manifest's checkpoint must be a local path"):
        ckpt_cli.validate(f"{run}/step_000100", write_manifest=True)


def test_open_reads_tensors_of_an_object_with_ranged_gets(
        s3env: s3.Proxy, bucket_run: str, sample_run: Any) -> None:  # noqa: F811 (fixture)
    """``ckpt_cli.open`` on a URL: the same tensors and slices, bit for bit, as from the local
    copy, read through the endpoint."""
    url = f"s3://{bucket_run}/run/step_000100/checkpoint.pt"
    s3env.traffic.reset()
    with ckpt_cli.open(sample_run / "step_000100" / "checkpoint.pt") as local, \
            ckpt_cli.open(url) as remote:
        assert remote.keys() == local.keys() and remote.path == url
        for name in remote.keys():
            assert remote.read(name).tobytes() == local.read(name).tobytes(), name
        full = local.read("model.wte.weight")
        rows = remote.read_slice("model.wte.weight", 10, 12)
        assert rows.tobytes() == full[10:12].tobytes()
    assert s3env.traffic.requests > 0 and s3env.traffic.bytes_out > 0
