"""The allowlisting unpickler never imports or calls what a pickle names."""

from __future__ import annotations

import io
import json
import os
import pickle
import pickletools
import time
import zipfile
from pathlib import Path

import pytest
import torch

from ckpt_cli.errors import CorruptCheckpointError
from ckpt_cli.formats import read_index
from ckpt_cli.formats.unpickler import Opaque, classify_global, safe_load
from tests.conftest import run_cli, third_party_quiet
from tests.helpers.damage import replace_pickle

pytestmark = pytest.mark.requires_torch


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


def _legacy_with_sys_info(path: Path, sys_info: object) -> None:
    """A real legacy torch.save stream whose sys_info pickle (the third) is replaced."""
    torch.save({"w": torch.ones(3)}, path, _use_new_zipfile_serialization=False)
    data = path.read_bytes()
    f = io.BytesIO(data)
    for _ in range(2):
        pickletools.dis(f, out=io.StringIO())  # walks the magic and protocol pickles
    start = f.tell()
    pickletools.dis(f, out=io.StringIO())
    path.write_bytes(data[:start] + pickle.dumps(sys_info, protocol=2) + data[f.tell():])


def test_legacy_sys_info_payload_is_reported(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "legacy.pt"
    _legacy_with_sys_info(path, {"protocol_version": 1001, "little_endian": True,
                                 "x": Evil(marker)})
    index = read_index(path)
    assert not marker.exists()
    assert index.files[0].format == "torch-legacy" and list(index.tensors) == ["w"]
    unsafe = [f for f in index.findings if f.code == "unsafe-global"]
    assert unsafe and unsafe[0].severity == "error"
    assert "system" in unsafe[0].message and "sys_info" in unsafe[0].message


def test_real_legacy_and_zip_files_have_no_global_findings(tmp_path: Path) -> None:
    # sys_info is a dict of plain values and the key list a list of strings: nothing to
    # report, in a legacy stream as in a zip.
    sd = {"w": torch.ones(3), "b": torch.zeros(2, dtype=torch.float16), "step": 3}
    for legacy in (True, False):
        path = tmp_path / f"real_{legacy}.pt"
        torch.save(sd, path, _use_new_zipfile_serialization=not legacy)
        index = read_index(path)
        assert index.files[0].format == ("torch-legacy" if legacy else "torch")
        assert sorted(index.tensors) == ["b", "w"]
        assert index.findings == []


def test_legacy_magic_pickle_payload_is_named_when_the_stream_breaks(tmp_path: Path) -> None:
    # A payload in the magic number's pickle, after which the stream is garbage: torch.load
    # would have run it before failing; the error says what it referenced.
    path = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(3)}, path, _use_new_zipfile_serialization=False)
    head = path.read_bytes()[:14]  # PROTO 2, LONG1 <magic>
    payload = pickle.dumps(Evil(tmp_path / "pwned"), protocol=2)[2:-1]  # no PROTO, no STOP
    path.write_bytes(head + b"0" + payload + b"0" + head[2:] + b"." + b"\x80\x02\xff")
    with pytest.raises(CorruptCheckpointError, match=r"(references|would call) (os|posix)\.system"):
        read_index(path)
    assert not (tmp_path / "pwned").exists()


def _with_records(path: Path, extra: dict[str, bytes]) -> None:
    """Add records to a real torch.save zip (under its archive prefix)."""
    with zipfile.ZipFile(path) as zf:
        entries = {i.filename: zf.read(i.filename) for i in zf.infolist()}
    prefix = next(n for n in entries if n.endswith("data.pkl"))[: -len("data.pkl")]
    entries.update({prefix + k: v for k, v in extra.items()})
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for name, data in entries.items():
            zf.writestr(name, data)


def test_torchscript_shaped_zip_with_hostile_constants_is_reported(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "ts.pt"
    torch.save({"w": torch.ones(2)}, path)
    _with_records(path, {"code/__torch__.py": b"def f(x):\n    return x\n",
                         "constants.pkl": pickle.dumps((Evil(marker),), protocol=2)})
    index = read_index(path)
    assert not marker.exists()
    codes = {(f.severity, f.code) for f in index.findings}
    assert ("error", "torchscript-archive") in codes
    unsafe = [f for f in index.findings if f.code == "unsafe-global"]
    assert unsafe and "constants.pkl" in unsafe[0].message and "system" in unsafe[0].message


def test_every_pkl_record_is_scanned(tmp_path: Path) -> None:
    # Not TorchScript-shaped, but a second pickle record torch.jit.load would read.
    path = tmp_path / "extra.pt"
    torch.save({"w": torch.ones(2)}, path)
    _with_records(path, {"extra/more.pkl": pickle.dumps(Evil(tmp_path / "x"), protocol=2)})
    index = read_index(path)
    assert not any(f.code == "torchscript-archive" for f in index.findings)
    unsafe = [f for f in index.findings if f.code == "unsafe-global"]
    assert unsafe and "extra/more.pkl" in unsafe[0].message


def test_unparsable_extra_pickle_still_reports_what_it_named(tmp_path: Path) -> None:
    path = tmp_path / "broken.pt"
    torch.save({"w": torch.ones(2)}, path)
    evil = pickle.dumps(Evil(tmp_path / "x"), protocol=2)[:-1] + b"\xff"  # no STOP
    _with_records(path, {"constants.pkl": evil})
    index = read_index(path)
    codes = {f.code for f in index.findings}
    assert {"unscanned-pickle", "unsafe-global", "torchscript-archive"} <= codes


def test_real_torchscript_archive_is_named(tmp_path: Path) -> None:
    path = tmp_path / "scripted.pt"
    with third_party_quiet():  # torch.jit.script is deprecated
        torch.jit.save(torch.jit.script(_Scriptable()), path)
    index = read_index(path)
    script = [f for f in index.findings if f.code == "torchscript-archive"]
    assert script and "CVE-2025-32434" in script[0].message
    assert not any(f.code in ("unsafe-global", "unscanned-pickle") for f in index.findings)


class _Scriptable(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * 2.0


# Every opcode with a length field, as (opcode bytes, width of the length, name).
_COUNTED_OPS = [(b"\x8e", 8, "BINBYTES8"), (b"B", 4, "BINBYTES"), (b"C", 1, "SHORT_BINBYTES"),
                (b"X", 4, "BINUNICODE"), (b"\x8d", 8, "BINUNICODE8"),
                (b"\x8c", 1, "SHORT_BINUNICODE"), (b"T", 4, "BINSTRING"),
                (b"U", 1, "SHORT_BINSTRING"), (b"\x8b", 4, "LONG4"), (b"\x8a", 1, "LONG1"),
                (b"\x96", 8, "BYTEARRAY8"), (b"\x95", 8, "FRAME")]


@pytest.mark.parametrize("op,width,name", _COUNTED_OPS)
def test_length_fields_are_bounded_before_allocation(op: bytes, width: int, name: str) -> None:
    n = (1 << 40) if width == 8 else (2**31 - 1) if width == 4 else 200
    data = b"\x80\x04" + op + n.to_bytes(width, "little") + b"abc."
    with pytest.raises(pickle.UnpicklingError, match=rf"{name} at byte 2 declares {n:,} bytes "
                                                     r"but only \d+ remain"):
        safe_load(data)


def test_length_check_covers_files_and_crafted_memo_indices(tmp_path: Path) -> None:
    path = tmp_path / "big.pkl"
    path.write_bytes(b"\x80\x04\x8e" + (1 << 40).to_bytes(8, "little") + b"abc.")
    with open(path, "rb") as f, pytest.raises(pickle.UnpicklingError, match="BINBYTES8"):
        safe_load(f)  # type: ignore[arg-type]
    with pytest.raises(pickle.UnpicklingError, match=r"memo index 4,294,967,280"):
        safe_load(b"\x80\x02Nr" + (0xFFFFFFF0).to_bytes(4, "little") + b".")


def test_length_walk_knows_every_opcode_and_real_pickles_pass() -> None:
    from ckpt_cli.formats import unpickler

    known = (set(unpickler._NO_ARG) | set(unpickler._COUNTED) | set(unpickler._FIXED)
             | set(unpickler._LINES))
    assert known == {ord(o.code) for o in pickletools.opcodes}
    obj = {"a": [1, 2.5, "x" * 300, b"y" * 70000, 2**3000, -5, (1,), {1, 2}], "b": None}
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        data = pickle.dumps(obj, protocol=protocol)
        assert unpickler.check_lengths(data + b"tail") == len(data)
        assert safe_load(data).obj == obj


def test_huge_length_in_a_torch_file_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "huge.pt"
    _torch_zip_with({"w": 1}, path)
    with zipfile.ZipFile(path) as zf:
        entries = {i.filename: zf.read(i.filename) for i in zf.infolist()}
    pkl = next(n for n in entries if n.endswith("data.pkl"))
    entries[pkl] = b"\x80\x02\x8e" + (1 << 42).to_bytes(8, "little") + b"."
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in entries.items():
            zf.writestr(name, data)
    with pytest.raises(CorruptCheckpointError, match=r"data\.pkl is not a readable pickle "
                                                     r"\(BINBYTES8 at byte 2 declares"):
        read_index(path)


def test_length_walk_without_an_mmap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under an address-space limit a multi-GB file cannot be mapped: the walk then reads it
    block by block, with the same verdicts, and a legacy file still reads."""
    import errno
    import mmap

    from ckpt_cli.formats import unpickler

    obj = {"a": [1, "x\ny" * 300, b"y" * (3 << 20), 2**3000], "b": None}
    for protocol in (0, 2, 4):  # protocol 0 has newline-terminated arguments
        path = tmp_path / f"p{protocol}.pkl"
        data = pickle.dumps(obj, protocol=protocol)
        path.write_bytes(b"pad" + data + b"tail" * 1000)
        with open(path, "rb") as f:
            view = unpickler._PreadView(f.fileno(), os.fstat(f.fileno()).st_size)
            assert unpickler.check_lengths(view, 3) == 3 + len(data)
    bad = tmp_path / "bad.pkl"
    bad.write_bytes(b"\x80\x04\x8e" + (1 << 40).to_bytes(8, "little") + b"abc.")

    def no_room(*args: object, **kwargs: object) -> mmap.mmap:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(unpickler.mmap, "mmap", no_room)
    with open(bad, "rb") as f, pytest.raises(pickle.UnpicklingError, match="BINBYTES8"):
        safe_load(f)  # type: ignore[arg-type]
    legacy = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(3)}, legacy, _use_new_zipfile_serialization=False)
    index = read_index(legacy)
    assert list(index.tensors) == ["w"] and index.findings == []


@pytest.mark.parametrize("name", ["torch.storage._load_from_bytes",
                                  "torch.fx.graph_module._forward_from_src",
                                  "torch.utils.cpp_extension.load_inline",
                                  "torch.hub.load_state_dict_from_url",
                                  "numpy.distutils.exec_command.exec_command",
                                  "__builtin__.setattr", "__builtin__.globals"])
def test_code_execution_gadgets_are_dangerous(name: str) -> None:
    assert classify_global(name) == "dangerous"


def test_shared_lists_do_not_explode(tmp_path: Path) -> None:
    """A 'billion laughs' pickle: 40 levels of [a, a] describe 2**40 leaves in a few bytes."""
    node: list[object] = [1]
    for _ in range(40):
        node = [node, node]
    p = tmp_path / "laughs.pt"
    torch.save({"w": torch.ones(1)}, p)
    replace_pickle(p, pickle.dumps({"w": 1, "x": node}, protocol=2))
    t0 = time.monotonic()
    read_index(p)
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("module", [b"builtins", b"__builtin__"])
def test_bytearray_of_a_huge_size_is_refused(module: bytes) -> None:
    # bytearray(2**30): a real bytearray pickles as its text, never as a size.
    crafted = b"\x80\x02c" + module + b"\nbytearray\nJ\x00\x00\x00\x40\x85R."
    with pytest.raises(pickle.UnpicklingError):
        safe_load(crafted)
    assert safe_load(pickle.dumps(bytearray(b"ab"), protocol=2)).obj == bytearray(b"ab")


def test_a_pickle_cannot_change_the_standins() -> None:
    from ckpt_cli.formats import unpickler

    # GLOBAL an allowlisted rebuild function, then BUILD it with slot state that would set
    # its __defaults__ for every later file read in this process.
    crafted = (b"\x80\x02ctorch._utils\n_rebuild_meta_tensor_no_storage\n"
               b"N}X\x0c\x00\x00\x00__defaults__\x88\x85s\x86b.")
    # Recorded as an attempt to modify the global (an error finding, issue #23), not done.
    assert safe_load(crafted).builds == {"torch._utils._rebuild_meta_tensor_no_storage"}
    assert unpickler._rebuild_meta.__defaults__ == (False,)


def test_tensors_with_python_attributes_are_allowlisted(tmp_path: Path) -> None:
    """DeepSpeed's optimizer state pickles tensors via _rebuild_from_type_v2(.., torch.Tensor)."""
    t = torch.zeros(3)
    t.ds_id = 5  # type: ignore[attr-defined]
    p = torch.nn.Parameter(torch.ones(2))
    p.extra = "x"  # type: ignore[attr-defined]
    f = tmp_path / "attr.pt"
    torch.save({"t": t, "p": p}, f)
    assert classify_global("torch.Tensor") == "allowed"
    index = read_index(f)
    assert {n: x.shape for n, x in index.tensors.items()} == {"t": (3,), "p": (2,)}
    assert not index.findings
    r = run_cli("validate", f, "--strict")
    assert r.exit_code == 0, r.output
    # The class is an argument there; a pickle that calls it does not unpickle.
    evil = (b"\x80\x02ctorch\nTensor\nq\x00)Rq\x01.")
    with pytest.raises(Exception, match="not callable"):
        safe_load(io.BytesIO(evil))


def test_generator_and_dataloader_state_are_not_code(tmp_path: Path) -> None:
    # torch.save of a torch.Generator or a DataLoader: data torch's weights_only loader
    # refuses, but nothing that runs code; a warning, not an invalid checkpoint.
    src = tmp_path / "rng.pt"
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(6.0)),
                                         batch_size=2, shuffle=True)
    torch.save({"model": {"w": torch.randn(4, 4)}, "gen": torch.Generator().manual_seed(3),
                "loader": loader}, src)
    r = run_cli("validate", src, "--json")
    doc = json.loads(r.stdout)
    assert r.exit_code == 0 and doc["valid"], r.output
    found = {(f["code"], f["location"]) for f in doc["checkpoints"][0]["findings"]}
    assert not any(code == "unsafe-global" for code, _ in found), found
    assert ("non-allowlisted-global", "torch._C.Generator") in found
    # On ckpt's allowlist of data holders (issue #23): reported, not refused.
    assert ("non-allowlisted-global", "torch.utils.data.dataloader.DataLoader") in found
    assert classify_global("torch._C.Generator") == "benign"
    for gadget in ("torch._C._jit_script_compile", "numpy.memmap", "numpy.lib.npyio.load",
                   "torch.fx.graph_module.reduce_graph_module",
                   # unpickles bytes it is given, writes files, views raw memory, reads files
                   "torch.utils.data.datapipes.utils.decoder.basichandlers",
                   "torch.utils.data.datapipes.gen_pyi.gen_from_template",
                   "numpy.lib.stride_tricks.as_strided", "numpy._core.multiarray.fromfile",
                   "numpy.rec.fromfile", "numpy.ndarray.tofile", "pathlib.Path.write_text"):
        assert classify_global(gadget) == "dangerous", gadget
    # Callables under packages whose data classes are benign are not benign themselves.
    for callable_ in ("transformers.AutoModel.from_pretrained", "transformers.pipeline",
                      "deepspeed.launcher.runner.main"):
        assert classify_global(callable_) == "unknown", callable_
    for data in ("deepspeed.utils.tensor_fragment.fragment_address", "datetime.datetime",
                 "transformers.training_args.TrainingArguments", "pathlib.PosixPath"):
        assert classify_global(data) == "benign", data


def test_a_datapipe_gadget_makes_a_checkpoint_invalid(tmp_path: Path) -> None:
    # A pickle that calls a torch.utils.data decoder on embedded pickle bytes runs them under
    # torch.load(weights_only=False); ckpt must call it dangerous, not just unknown.
    class Gadget:
        def __reduce__(self) -> tuple[object, ...]:
            from torch.utils.data.datapipes.utils.decoder import basichandlers
            return (basichandlers, ("pickle", b"not executed"))

    src = tmp_path / "evil.pt"
    torch.save({"model": {"w": torch.ones(2)}, "x": Gadget()}, src)
    r = run_cli("validate", src)
    assert r.exit_code == 1 and "INVALID" in r.output, r.output
