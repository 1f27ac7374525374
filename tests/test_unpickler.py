"""The allowlisting unpickler never imports or calls what a pickle names."""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from pathlib import Path

import pytest
import torch

from ckpt_cli.errors import CorruptCheckpointError
from ckpt_cli.formats import read_index
from ckpt_cli.formats.unpickler import Opaque, classify_global, safe_load


class Evil:
    """Pickles as ``os.system(<cmd>)``: loading it with pickle.load would run the command."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def _torch_zip_with(obj: object, path: Path) -> None:
    """A real torch.save zip whose data.pkl is replaced by ``pickle.dumps(obj)``."""
    torch.save({"w": torch.ones(2)}, path)
    with zipfile.ZipFile(path) as zf:
        entries = {i.filename: zf.read(i.filename) for i in zf.infolist()}
    prefix = next(n for n in entries if n.endswith("data.pkl"))
    entries[prefix] = pickle.dumps(obj, protocol=2)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for name, data in entries.items():
            zf.writestr(name, data)


def test_reduce_of_os_system_is_recorded_not_run(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    result = safe_load(pickle.dumps(Evil(marker)))
    assert not marker.exists()
    assert isinstance(result.obj, Opaque)
    assert result.obj.qualname in ("posix.system", "os.system")
    assert result.obj.args == (f"touch {marker}",)
    assert result.globals[result.obj.qualname] == "dangerous"


def test_torch_file_with_malicious_pickle_is_reported(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    _torch_zip_with({"w": Evil(marker)}, path)
    index = read_index(path)
    assert not marker.exists()
    unsafe = [f for f in index.findings if f.code == "unsafe-global"]
    assert unsafe and unsafe[0].severity == "error"
    assert "system" in unsafe[0].message and "not executed" in unsafe[0].message


def test_stack_global_and_protocol_5_are_handled() -> None:
    data = pickle.dumps({"a": [1, 2.5, "x"], "b": Evil(Path("/nonexistent"))}, protocol=5)
    result = safe_load(data)
    assert result.obj["a"] == [1, 2.5, "x"]
    assert isinstance(result.obj["b"], Opaque)


def test_numpy_scalars_and_namespaces_stay_data() -> None:
    import argparse

    import numpy as np

    from ckpt_cli.formats.containers import extract_metadata

    data = pickle.dumps({"step": np.int64(42), "lr": np.float32(0.5),
                         "args": argparse.Namespace(tensor_model_parallel_size=2)})
    result = safe_load(data)
    meta = extract_metadata(result.obj)
    assert meta["step"] == 42
    assert meta["lr"] == 0.5
    assert meta["args"] == {"tensor_model_parallel_size": 2}
    assert classify_global("argparse.Namespace") == "benign"


@pytest.mark.parametrize("name,expected", [
    ("torch._utils._rebuild_tensor_v2", "allowed"),
    ("collections.OrderedDict", "allowed"),
    ("builtins.eval", "dangerous"),
    ("subprocess.Popen", "dangerous"),
    ("os.system", "dangerous"),
    ("mypackage.Model", "unknown"),
    ("transformers.training_args.TrainingArguments", "benign"),
])
def test_classification(name: str, expected: str) -> None:
    assert classify_global(name) == expected


def test_garbage_data_pkl_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.pt"
    torch.save({"w": torch.ones(2)}, path)
    with zipfile.ZipFile(path) as zf:
        entries = {i.filename: zf.read(i.filename) for i in zf.infolist()}
    pkl = next(n for n in entries if n.endswith("data.pkl"))
    entries[pkl] = b"\x80\x02garbage"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in entries.items():
            zf.writestr(name, data)
    with pytest.raises(CorruptCheckpointError, match=r"data\.pkl is not a readable pickle"):
        read_index(path)


def test_bytes_via_codecs_encode() -> None:
    # protocol 2 pickles bytes as _codecs.encode(str, 'latin1')
    buf = io.BytesIO()
    pickle.dump({"b": b"\x00\xff"}, buf, protocol=2)
    assert safe_load(buf.getvalue()).obj == {"b": b"\x00\xff"}
