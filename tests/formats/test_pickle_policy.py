"""Issue #23: the pickle scanner fails closed, reads zips as torch does, and keeps no state.

The regression corpus of published bypasses is tests/formats/test_pickle_corpus.py; these tests pin
the mechanisms: allowlist semantics, attribute paths, BUILD onto globals, zip records two
readers could disagree on, protocols 0-5 and legacy tars, ``--allow-global``.
"""

from __future__ import annotations

import io
import json
import pickle
import struct
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch

from ckpt_cli.formats import read_index
from ckpt_cli.formats import unpickler as up
from ckpt_cli.formats.allowlist import DATA_TYPES
from ckpt_cli.formats.unpickler import classify_global, looks_like_pickle, safe_load
from tests.conftest import run_cli

pytestmark = pytest.mark.requires_torch


def _zip(path: Path, records: list[tuple[str, bytes]]) -> Path:
    """A torch-layout zip written by zipfile (data.pkl and friends as given)."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for name, data in records:
            zf.writestr(name, data)
    return path


def _real_records(tmp_path: Path) -> list[tuple[str, bytes]]:
    src = tmp_path / "real.pt"
    torch.save({"w": torch.arange(4.0)}, src)
    with zipfile.ZipFile(src) as zf:
        return [(i.filename, zf.read(i.filename)) for i in zf.infolist()]


def _validate(path: Path, *args: str) -> tuple[int, dict[str, object], str]:
    r = run_cli("validate", path, "--json", *args)
    return r.exit_code, json.loads(r.stdout) if r.stdout.strip() else {}, r.output


def _codes(doc: dict[str, object]) -> set[tuple[str, str | None]]:
    checks = doc["checkpoints"]
    assert isinstance(checks, list)
    return {(f["code"], f["location"]) for c in checks for f in c["findings"]}


# --- allowlist semantics ---------------------------------------------------------------------

@pytest.mark.parametrize("name", [
    "profile.run", "cProfile.runctx", "trace.Trace", "doctest.debug_script",
    "uuid._get_command_stdout", "pydoc.pipepager", "imaplib.IMAP4_stream",
    "_osx_support._read_output", "distutils.spawn.spawn", "_functools.reduce",
    "cPickle.loads",
])
def test_code_running_callables_outside_the_old_denylist_are_dangerous(name: str) -> None:
    assert classify_global(name) == "dangerous"


@pytest.mark.parametrize("name", ["mypkg.Model", "torch._utils._rebuild_nonexistent",
                                  "transformers.pipeline", "torch.nn.modules.linear.Linear"])
def test_anything_not_allowlisted_is_unknown_not_benign(name: str) -> None:
    assert classify_global(name) == "unknown"


def test_a_merely_referenced_unknown_global_makes_validate_fail(tmp_path: Path) -> None:
    # A global that is only named (a dict value), never called: still outside the allowlist.
    class Ref:
        def __reduce__(self) -> tuple[object, ...]:
            return (getattr, (Path, "cwd"))

    payload = b"\x80\x02}X\x01\x00\x00\x00acmypkg.mod\nfactory\ns."
    path = _zip(tmp_path / "ref.pt", [("archive/data.pkl", payload),
                                      ("archive/version", b"3\n")])
    code, doc, out = _validate(path)
    assert code == 1 and not doc["valid"], out
    assert ("unknown-global", "mypkg.mod.factory") in _codes(doc)
    assert "--allow-global mypkg.mod.factory" in out
    # One flag away for a user who trusts it; a name without a module is a usage error.
    code, doc, out = _validate(path, "--allow-global", "mypkg.mod.factory")
    assert code == 0 and doc["valid"], out
    assert ("allowed-global", "mypkg.mod.factory") in _codes(doc)
    assert run_cli("validate", path, "--allow-global", "factory").exit_code == 2


@pytest.mark.parametrize("module,name,shown", [
    ("torch", "os.system", "torch.os.system"),
    ("torch.serialization", "os.system", "torch.serialization.os.system"),
    ("posixpath", "os.system", "posixpath.os.system"),
    ("numpy.core.numeric", "__builtins__.eval", "numpy.core.numeric.__builtins__.eval"),
])
def test_attribute_paths_are_judged_by_where_they_lead(tmp_path: Path, module: str, name: str,
                                                       shown: str) -> None:
    # Protocol 4's STACK_GLOBAL resolves a dotted name attribute by attribute.
    payload = (b"\x80\x04\x8c" + bytes([len(module)]) + module.encode() + b"\x8c"
               + bytes([len(name)]) + name.encode() + b"\x93\x8c\x04true\x85R.")
    result = safe_load(payload)
    assert result.globals[shown] == "dangerous"
    assert shown in result.calls
    path = _zip(tmp_path / "dotted.pt", [("archive/data.pkl", payload)])
    code, doc, out = _validate(path)
    assert code == 1 and ("unsafe-global", shown) in _codes(doc), out


def test_every_allowlisted_data_type_exists_where_its_library_is_installed() -> None:
    # The allowlist names real classes (no typo lets a look-alike through unnoticed).
    import importlib

    missing = []
    for qual in sorted(DATA_TYPES):
        module, _, attr = qual.rpartition(".")
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue  # numpy.core on numpy 2, lightning_fabric's twin, ...
        if not hasattr(mod, attr):
            missing.append(qual)
    # numpy 2 exports only some dtype class aliases; everything else must exist.
    assert [q for q in missing if not q.startswith("numpy.dtypes.")] == []


# --- no state crosses files ------------------------------------------------------------------

_BUILD_TARGETS = [
    ("torch", "FloatStorage"), ("torch", "float32"), ("torch", "Tensor"),
    ("torch._utils", "_rebuild_tensor_v2"), ("mypkg", "Thing"),
]


@pytest.mark.parametrize("module,name", _BUILD_TARGETS)
def test_build_onto_a_global_is_recorded_and_changes_nothing(module: str, name: str) -> None:
    # GLOBAL, then BUILD (None, {"dtype": "F16"}): under a real loader this would change
    # the class or function for the rest of the process. ckpt records it and goes on.
    payload = (b"\x80\x02c" + f"{module}\n{name}\n".encode()
               + b"N}X\x05\x00\x00\x00dtypeX\x03\x00\x00\x00F16s\x86b.")
    result = safe_load(payload)
    assert result.builds == {f"{module}.{name}"}
    again = safe_load(b"\x80\x02c" + f"{module}\n{name}\n".encode() + b".")
    assert getattr(again.obj, "dtype", "F32") != "F16"
    assert getattr(again.obj, "name", "") != "F16"


def test_a_poisoned_file_changes_nothing_about_a_clean_one(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    torch.save({"w": torch.ones(3)}, run / "step_1.pt")
    records = _real_records(tmp_path)
    poison = (b"\x80\x02ctorch\nFloatStorage\nN}X\x05\x00\x00\x00dtypeX\x03\x00\x00\x00F16s"
              b"\x86b0")
    records = [(n, poison + d[2:] if n.endswith("data.pkl") else d) for n, d in records]
    _zip(run / "step_0.pt", records)
    # The poisoned file is invalid, naming the global; the clean one still reads F32.
    code, doc, out = _validate(run / "step_0.pt")
    assert code == 1 and ("unsafe-global", "torch.FloatStorage") in _codes(doc), out
    assert {t.dtype for t in read_index(run / "step_0.pt").tensors.values()} == {"F32"}
    assert {t.dtype for t in read_index(run / "step_1.pt").tensors.values()} == {"F32"}
    assert up._ALLOWED["torch.FloatStorage"] == up.StorageType("F32", "FloatStorage")
    # Either order of diff gives the same answer; a run directory holds one valid of two.
    a = run_cli("diff", run / "step_0.pt", run / "step_1.pt")
    b = run_cli("diff", run / "step_1.pt", run / "step_0.pt")
    assert a.exit_code == b.exit_code, (a.output, b.output)
    assert "torch.FloatStorage" in a.output and "torch.FloatStorage" in b.output
    code, doc, out = _validate(run)
    assert code == 1, out
    valid = {Path(c["path"]).name: c["valid"] for c in doc["checkpoints"]}
    assert valid == {"step_0.pt": False, "step_1.pt": True}, out


def test_stand_in_classes_belong_to_one_file() -> None:
    a = safe_load(b"\x80\x02cmypkg\nThing\n)R.")
    b = safe_load(b"\x80\x02cmypkg\nThing\n.")
    assert type(a.obj) is not b.obj  # each unpickler makes its own stand-in
    assert a.calls == {"mypkg.Thing"} and b.calls == set()


# --- zips read the way torch reads them -----------------------------------------------------

def test_data_pkl_is_found_whatever_its_case(tmp_path: Path) -> None:
    payload = b"\x80\x02cos\nsystem\nX\x04\x00\x00\x00true\x85R."
    path = _zip(tmp_path / "case.pt", [("archive/Data.PKL", payload),
                                       ("archive/version", b"3\n")])
    code, doc, out = _validate(path)
    assert code == 1 and ("unsafe-global", "os.system") in _codes(doc), out


@pytest.mark.parametrize("names", [("archive/data.pkl", "archive/DATA.pkl"),
                                   ("archive/data.pkl", "archive/data.pkl")])
def test_records_that_collide_are_refused_everywhere(tmp_path: Path,
                                                     names: tuple[str, str]) -> None:
    records = _real_records(tmp_path)
    pkl = next(d for n, d in records if n.endswith("data.pkl"))
    path = tmp_path / "twice.pt"
    with pytest.warns(UserWarning) if names[0] == names[1] else _nothing():
        _zip(path, [(names[0], pkl), *[(n, d) for n, d in records
                                       if not n.endswith("data.pkl")], (names[1], pkl)])
    for cmd in (("inspect", path), ("validate", path), ("diff", path, path),
                ("convert", path, "-o", tmp_path / "o.safetensors")):
        r = run_cli(*cmd)
        assert r.exit_code != 0 and "two records" in r.output, (cmd, r.output)
    assert not (tmp_path / "o.safetensors").exists()


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def test_a_second_end_of_central_directory_is_refused(tmp_path: Path) -> None:
    records = _real_records(tmp_path)
    good = _zip(tmp_path / "good.pt", records).read_bytes()
    eocd = good[good.rindex(b"PK\x05\x06"):]
    # A record near the end holding another end record that points at a central directory
    # before it: zipfile and miniz take the last one, a scanner reading forwards this one.
    fake = b"PK\x05\x06" + struct.pack("<HHHHIIH", 0, 0, 1, 1, 46, 0, 0)
    path = _zip(tmp_path / "two-ends.pt", [*records, ("real/extra", fake)])
    code, _, out = _validate(path)
    assert code == 1 and "2 end-of-central-directory records" in out, out
    # Damage that leaves a broken second end record is refused too (zipfile cannot read it).
    bad = good[:-len(eocd)] + eocd[:20] + struct.pack("<H", len(eocd)) + eocd
    (tmp_path / "nested.pt").write_bytes(bad)
    assert run_cli("validate", tmp_path / "nested.pt").exit_code == 1


def test_a_zip_shifted_by_prepended_bytes_is_refused(tmp_path: Path) -> None:
    # zipfile shifts every offset to where the central directory really is; torch's reader
    # takes the recorded offsets. The same bytes then name different records.
    good = _zip(tmp_path / "good.pt", _real_records(tmp_path)).read_bytes()
    path = tmp_path / "shifted.pt"
    path.write_bytes(b"PK\x03\x04" + b"\0" * 60 + good)
    r = run_cli("inspect", path)
    assert r.exit_code == 2 and "central directory lies 64 bytes away" in r.output, r.output


def test_a_local_header_naming_another_record_is_invalid(tmp_path: Path) -> None:
    # torch reads the payload past the local header whatever it names (as ckpt does);
    # validate reports the disagreement, the same on disk as on a store.
    good = _zip(tmp_path / "good.pt", _real_records(tmp_path)).read_bytes()
    at = good.index(b"real/data.pkl")  # its local header's name comes first
    bad = good[:at] + b"real/data.pkX" + good[at + 13:]
    path = tmp_path / "renamed.pt"
    path.write_bytes(bad)
    code, doc, out = _validate(path)
    assert code == 1 and any(c == "zip-local-header" for c, _ in _codes(doc)), out


def test_a_pickle_record_under_another_name_is_scanned(tmp_path: Path) -> None:
    records = _real_records(tmp_path)
    evil = pickle.dumps({"x": 1}, protocol=2)[:-2] + b"cos\nsystem\n)R\x86."
    path = _zip(tmp_path / "extra.pt", [*records, ("archive/extra/HOOK.PKL", evil)])
    code, _, out = _validate(path)
    assert code == 1 and "os.system" in out, out


# --- every pickle torch reads is recognised --------------------------------------------------

@pytest.mark.parametrize("protocol", [0, 1, 2, 3, 4, 5])
def test_plain_pickles_of_every_protocol_are_scanned(tmp_path: Path, protocol: int) -> None:
    class Call:
        def __reduce__(self) -> tuple[object, ...]:
            import os
            return (os.system, ("true",))

    data = pickle.dumps({"w": 1, "hook": Call()}, protocol=protocol)
    assert looks_like_pickle(data[:4096])
    path = tmp_path / "plain.pt"
    path.write_bytes(data)
    code, _, out = _validate(path)
    assert code == 1 and "system" in out, out


@pytest.mark.parametrize("text", [b"hello world\n", b'{"a": 1}', b"global_step40", b"",
                                  b"# comment\n", b"12345"])
def test_text_is_not_taken_for_a_pickle(text: bytes) -> None:
    assert not looks_like_pickle(text)


def test_a_legacy_stream_with_a_protocol_0_magic_is_read_as_one(tmp_path: Path) -> None:
    # torch.load unpickles the magic number with whatever protocol it was written in; the
    # pickles after it run too.
    path = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(3)}, path, _use_new_zipfile_serialization=False)
    data = path.read_bytes()
    magic = pickle.dumps(0x1950A86A20F9469CFC6C, protocol=0)
    assert data[14:15] == b"."  # the protocol 2 magic: PROTO 2, LONG1 <10 bytes>, STOP
    path.write_bytes(magic + data[15:])
    index = read_index(path)
    assert [f.format for f in index.files] == ["torch-legacy"]
    assert index.tensors["w"].shape == (3,)


def test_a_legacy_tar_checkpoint_is_scanned(tmp_path: Path) -> None:
    path = tmp_path / "old.tar.pt"
    payload = b"\x80\x02cos\nsystem\nX\x04\x00\x00\x00true\x85R."
    with tarfile.open(path, "w:", format=tarfile.PAX_FORMAT) as tar:
        for name, data in (("sys_info", pickle.dumps({"little_endian": True}, protocol=2)),
                           ("pickle", payload), ("storages", pickle.dumps(0, protocol=2))):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    code, doc, out = _validate(path)
    assert code == 1 and ("unsafe-global", "os.system") in _codes(doc), out


# --- the controls: what the real libraries write validates clean ----------------------------

@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["sample_run", "hf_trainer_dir", "lightning_dir", "ds_dir"])
def test_real_library_checkpoints_name_only_allowlisted_globals(
        fixture: str, request: pytest.FixtureRequest) -> None:
    # torch (torch.save, DCP), transformers' Trainer (training_args.bin, rng_state.pth),
    # Lightning, DeepSpeed ZeRO 1-3: the allowlist covers every global they pickle.
    root: Path = request.getfixturevalue(fixture)
    files = [p for p in sorted(root.rglob("*")) if p.is_file()
             and (p.suffix in (".pt", ".pth", ".bin", ".ckpt", ".distcp") or p.name == ".metadata")]
    assert files
    for p in files:
        index = read_index(p.parent if p.suffix == ".distcp" or p.name == ".metadata" else p)
        bad = [f for f in index.findings if f.code in ("unsafe-global", "unknown-global")]
        assert not bad, (p, bad)
        assert not any(f.code == "unscanned-pickle" for f in index.findings), p


# --- found in review: places a pickle could hide ---------------------------------------------

_SYSTEM = b"\x80\x02cos\nsystem\nX\x04\x00\x00\x00true\x85R."


@pytest.mark.parametrize("magic", [
    # torch.load's legacy reader reads on when the first pickle equals its magic number; an
    # allowlisted type can build that number where ckpt sees only a stand-in.
    b"\x80\x02cbuiltins\nint\nX\x14\x00\x00\x001950a86a20f9469cfc6cK\x10\x86R.",
    b"\x80\x02cdecimal\nDecimal\nX\x18\x00\x00\x00119547037146038801333356\x85R.",
])
def test_every_pickle_of_a_plain_file_is_scanned(tmp_path: Path, magic: bytes) -> None:
    path = tmp_path / "stream.pt"
    path.write_bytes(magic + _SYSTEM)
    code, doc, out = _validate(path)
    assert code == 1 and ("unsafe-global", "os.system") in _codes(doc), out


def test_data_only_classes_may_be_restored_not_constructed(tmp_path: Path) -> None:
    # accelerate's PartialState: REDUCE runs its __init__ (shared process state) under a real
    # loader; NEWOBJ + BUILD (what TrainingArguments pickles hold) restores data only.
    called = b"\x80\x02caccelerate.state\nPartialState\n)R}X\x01\x00\x00\x00aK\x07sb."
    restored = b"\x80\x02caccelerate.state\nPartialState\n)\x81}X\x01\x00\x00\x00aK\x07sb."
    for name, data, bad in (("called.pkl", called, True), ("restored.pkl", restored, False)):
        (tmp_path / name).write_bytes(data)
        code, doc, out = _validate(tmp_path / name)
        assert (code == 1) is bad, out
        assert (("unsafe-global", "accelerate.state.PartialState") in _codes(doc)) is bad, out


def test_a_pickle_beside_the_checkpoint_s_own_files_is_scanned(tmp_path: Path) -> None:
    # model.safetensors is what ckpt reads of an HF directory; other tools torch.load the
    # pytorch_model.bin beside it, and DeepSpeed loads every file of its tag directory.
    from safetensors.torch import save_file

    d = tmp_path / "export"
    d.mkdir()
    save_file({"w": torch.ones(2)}, str(d / "model.safetensors"))
    (d / "config.json").write_text("{}")
    _zip(d / "pytorch_model.bin", [("archive/data.pkl", _SYSTEM), ("archive/version", b"3\n")])
    code, doc, out = _validate(d)
    assert code == 1 and ("unsafe-global", "os.system") in _codes(doc), out
    assert "pytorch_model.bin" in out


def test_a_pickle_that_looks_like_safetensors_is_named(tmp_path: Path) -> None:
    # BINFLOAT's eight bytes read as a header length, then '{': torch.load takes it for the
    # pickle it is.
    path = tmp_path / "f.pt"
    path.write_bytes(b"G\x00\x00\x00\x00\x00\x00\x00{0" + b"\x80\x02" + _SYSTEM[2:] + b" " * 64)
    r = run_cli("validate", path)
    assert r.exit_code == 1 and "os.system" in r.output, r.output


@pytest.mark.parametrize("first", [b"\x95", b"\x8c"])
def test_pickles_without_a_protocol_header_are_recognised(first: bytes) -> None:
    frame = b"\x95" + (len(_SYSTEM) - 2).to_bytes(8, "little") + _SYSTEM[2:]
    data = frame if first == b"\x95" else b"\x8c\x01a0" + _SYSTEM[2:]
    assert looks_like_pickle(data)


def test_an_unreadable_stray_pickle_is_judged_by_what_its_pickles_name(tmp_path: Path) -> None:
    # A stray file ckpt cannot read as a checkpoint: refused when its pickles name a global
    # outside the allowlist (here a zip with colliding records), ignored when it holds none.
    from safetensors.torch import save_file

    d = tmp_path / "export"
    d.mkdir()
    save_file({"w": torch.ones(2)}, str(d / "model.safetensors"))
    from ckpt_cli.ops.validate.strays import _names_refused_globals

    junk = tmp_path / "notes.bin"
    junk.write_bytes(b"\x00\x01 not a pickle at all")
    assert not _names_refused_globals(junk)
    _zip(d / "pytorch_model.bin", [("archive/data.pkl", _SYSTEM), ("archive/DATA.pkl", _SYSTEM)])
    assert _names_refused_globals(d / "pytorch_model.bin")
    code, _, out = _validate(d)
    assert code == 1 and "two records" in out and "os.system" in out, out
