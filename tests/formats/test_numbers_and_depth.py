"""Numbers and nesting a checkpoint declares are bounded before anything computes with them:
a step that ``str.isdigit`` accepts but ``int`` refuses, a step of 5,000 digits, a 100,000-deep
``quantization_config``, a dimension past 2^63, a DCP tensor of 2^80 elements. Every command
answers with exit 0, 1 or 2 and one line, never exit 101 (an internal error).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from ckpt_cli.dtypes import strict_int
from ckpt_cli.units import natural_key
from tests.conftest import run_cli, third_party_quiet
from tests.helpers.damage import edit_dcp_metadata, edit_safetensors_header

pytestmark = pytest.mark.requires_torch

DEEP = "[" * 100_000 + "]" * 100_000


def _commands(path: Path, out: Path) -> dict[str, list[str | Path]]:
    return {"validate": ["validate", path], "inspect": ["inspect", path],
            "diff": ["diff", path, path], "convert": ["convert", path, "-o", out]}


def _answers(args: list[str | Path], codes: tuple[int, ...] = (0, 1, 2)) -> str:
    r = run_cli(*args)
    assert r.exit_code in codes, (args, r.exit_code, r.output)
    assert "internal error" not in r.output and "Traceback" not in r.output
    return r.output


def test_strict_int() -> None:
    assert strict_int("12") == 12 and strict_int(b"7") == 7
    assert strict_int("-12") is None and strict_int("-12", signed=True) == -12
    for bad in ("²", "٣", "9" * 5000, "", " 1", "1_000", "+1", "0x10", str(2**63)):
        assert strict_int(bad) is None, bad
    assert strict_int(str(2**63 - 1)) == 2**63 - 1
    assert natural_key("²") == [(1, "²")]
    assert natural_key("step" + "9" * 5000)[0] == (1, "step")


@pytest.mark.parametrize("step", ["²", "9" * 5000, "-" + "9" * 5000])
@pytest.mark.parametrize("command", ["validate", "inspect", "diff", "convert"])
def test_a_step_int_refuses_is_ignored(tmp_path: Path, step: str, command: str) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.ones(4)}, path, metadata={"step": step, "ckpt.step": step,
                                                    "ckpt.epoch": step})
    _answers(_commands(path, tmp_path / "out.safetensors")[command])


def _fp8(d: Path, *, metadata: dict[str, str] | None = None) -> Path:
    d.mkdir()
    save_file({"l.weight": torch.randn(256, 256).to(torch.float8_e4m3fn),
               "l.weight_scale_inv": torch.ones(2, 2)}, d / "model.safetensors",
              metadata=metadata)
    return d


@pytest.mark.parametrize("command", ["validate", "inspect", "dequantize"])
def test_a_deep_quantization_config_is_a_clear_error(tmp_path: Path, command: str) -> None:
    d = _fp8(tmp_path / "fp8")
    (d / "config.json").write_text('{"quantization_config": {"quant_method": "fp8", "x": '
                                   + DEEP + "}}")
    args: list[str | Path] = {"validate": ["validate", d], "inspect": ["inspect", d],
                              "dequantize": ["convert", d, "--to", "bf16", "-o",
                                             tmp_path / "out"]}[command]
    out = _answers(args)
    if command != "inspect":
        assert "nests deeper than 64 levels" in out


@pytest.mark.parametrize("command", ["validate", "inspect", "dequantize"])
def test_a_deep_quantization_config_in_metadata(tmp_path: Path, command: str) -> None:
    d = _fp8(tmp_path / "fp8", metadata={"ckpt.quantization_config": DEEP})
    path = d / "model.safetensors"
    args: list[str | Path] = {"validate": ["validate", path], "inspect": ["inspect", path],
                              "dequantize": ["convert", path, "--to", "bf16", "-o",
                                             tmp_path / "out.safetensors"]}[command]
    _answers(args)


def test_a_deep_safetensors_header_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.ones(4)}, path)
    edit_safetensors_header(path, lambda h: h.update(junk=[[[[]]]]))
    raw = path.read_bytes()
    deep = raw.replace(b"[[[[]]]]", b"[" * 200 + b"]" * 200)
    n = int.from_bytes(raw[:8], "little") + 392
    path.write_bytes(n.to_bytes(8, "little") + deep[8:])
    for command in ("validate", "inspect"):
        out = _answers([command, path])
        assert "header nests deeper than 128 levels" in out


def test_a_dimension_past_2_63_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.ones(4)}, path)
    edit_safetensors_header(path, lambda h: h.update(
        z={"dtype": "F32", "shape": [0, 2**64 - 1], "data_offsets": [16, 16]}))
    out = _answers(["validate", path], (1,))
    assert "shape declares a dimension of 18446744073709551615, past 2^63-1" in out
    out = _answers(["convert", path, "-o", tmp_path / "out.pt"], (2,))
    assert "past 2^63-1" in out and not (tmp_path / "out.pt").exists()


@pytest.mark.parametrize("size", [(2**64, 4), (2**40, 2**40), (2**70,)])
@pytest.mark.parametrize("command", ["validate", "convert", "consolidate"])
def test_a_dcp_tensor_of_a_huge_size(tmp_path: Path, size: tuple[int, ...],
                                     command: str) -> None:
    d = tmp_path / "dcp"
    with third_party_quiet():
        dcp.save({"model": {"a": torch.ones(4, 4), "b": torch.zeros(3)}},  # type: ignore[attr-defined]
                 checkpoint_id=str(d))

    def edit(md: object) -> None:
        t = md.state_dict_metadata["model.a"]  # type: ignore[attr-defined]
        t.size = size
        if len(size) == 2:
            t.chunks[0].sizes = size

    edit_dcp_metadata(d, edit)
    out = tmp_path / "out"
    _answers({"validate": ["validate", d], "convert": ["convert", d, "-o", out],
              "consolidate": ["consolidate", d, "-o", out]}[command],
             (1,) if command == "validate" else (2,))


@pytest.mark.parametrize("shape", ["list", "dict"])
@pytest.mark.parametrize("command", ["validate", "inspect", "diff", "convert"])
def test_a_pickle_nested_100000_deep(tmp_path: Path, shape: str, command: str) -> None:
    import zipfile

    path = tmp_path / "deep.pt"
    torch.save({"w": torch.ones(2)}, path)
    with zipfile.ZipFile(path) as zf:
        records = [(i.filename, zf.read(i.filename)) for i in zf.infolist()]
    n = 100_000
    payload = (b"\x80\x02" + b"]" * n + b"a" * (n - 1) + b"." if shape == "list" else
               b"\x80\x02" + b"}X\x01\x00\x00\x00k" * n + b"}" + b"s" * n + b".")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for name, data in records:
            zf.writestr(name, payload if name.endswith("data.pkl") else data)
    _answers([*_commands(path, tmp_path / "out.safetensors")[command], "--json"])


def test_zero_parameter_shapes_are_bounded() -> None:
    from ckpt_cli.errors import CorruptCheckpointError
    from ckpt_cli.formats.zero import _shape

    assert _shape([2, 3]) == (2, 3)
    for bad in ([2**64], [-1, 4], [2**40, 2**40], [1] * 65, "x", [[[]]]):
        with pytest.raises(CorruptCheckpointError):
            _shape(bad)
    deep: list[object] = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(CorruptCheckpointError, match="malformed parameter shape"):
        _shape(deep)
