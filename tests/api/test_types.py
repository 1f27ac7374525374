"""Types a library user leans on: ``Literal`` aliases that list exactly the values the ops
accept, errors that are also the builtins a caller catches, typed result members, and a user
script that ``mypy --strict`` checks against the installed package."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import get_args

import numpy as np
import pytest
from safetensors.numpy import save_file

import ckpt_cli
from ckpt_cli import choices as types


@pytest.mark.parametrize(("alias", "runtime"), [
    ("InputFormat", lambda: __import__("ckpt_cli.formats", fromlist=["x"]).reader_names()),
    ("OutputFormat", lambda: __import__("ckpt_cli.writers.plan", fromlist=["x"]).FORMATS),
    ("CastTarget", lambda: __import__("ckpt_cli.tensors.cast", fromlist=["x"]).TARGETS),
    ("ConvertTarget",
     lambda: [*__import__("ckpt_cli.tensors.cast", fromlist=["x"]).TARGETS, "fp8", "dcp"]),
    ("Fp8Layout", lambda: __import__("ckpt_cli.fp8.scheme", fromlist=["x"]).LAYOUTS),
    ("Fp8Activations", lambda: __import__("ckpt_cli.fp8.config", fromlist=["x"]).ACTIVATIONS),
    ("ManifestHash", lambda: __import__("ckpt_cli.manifest", fromlist=["x"]).ALGORITHMS),
    ("Precision", lambda: __import__("ckpt_cli.ops.plan.cadence", fromlist=["x"]).PRECISIONS),
    ("Optimizer", lambda: __import__("ckpt_cli.ops.plan.cadence", fromlist=["x"]).OPTIMIZERS),
    ("ThinDtype", lambda: __import__("ckpt_cli.trust.thinning.base", fromlist=["x"]).THIN_DTYPES),
])
def test_each_alias_lists_what_the_op_accepts(alias: str, runtime: object) -> None:
    assert callable(runtime)
    assert sorted(get_args(getattr(types, alias))) == sorted(runtime())
    assert getattr(ckpt_cli, alias) is getattr(types, alias)  # exported at the root


def test_literal_keywords_are_the_aliases() -> None:
    hints = {n: ckpt_cli.convert.__annotations__[n]
             for n in ("to", "fp8_layout", "output_format")}
    assert hints == {"to": "ConvertTarget", "fp8_layout": "Fp8Layout",
                     "output_format": "OutputFormat | None"}
    assert ckpt_cli.inspect.__annotations__["input_format"] == "InputFormat | None"


def _file(tmp_path: Path) -> Path:
    src = tmp_path / "m.safetensors"
    save_file({"w": np.ones((2, 2), np.float32)}, str(src))
    return src


def test_a_missing_path_is_a_file_not_found_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.safetensors"
    with pytest.raises(FileNotFoundError) as e:
        ckpt_cli.inspect(missing)
    assert isinstance(e.value, ckpt_cli.CheckpointNotFoundError)
    assert isinstance(e.value, ckpt_cli.CkptError)
    assert e.value.filename == str(missing)
    assert str(e.value) == f"{missing}: no such file or directory"
    with pytest.raises(FileNotFoundError):
        ckpt_cli.validate(missing)


def test_a_bad_value_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="fp12") as e:
        ckpt_cli.convert(_file(tmp_path), tmp_path / "out.safetensors",
                         to="fp12")  # type: ignore[arg-type]
    assert isinstance(e.value, ckpt_cli.UsageError)


def test_an_existing_output_is_a_file_exists_error(tmp_path: Path) -> None:
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"mine")
    with pytest.raises(FileExistsError) as e:
        ckpt_cli.convert(_file(tmp_path), out, to="fp16")
    assert isinstance(e.value, ckpt_cli.DestinationExistsError)
    assert e.value.filename == str(out)
    assert out.read_bytes() == b"mine"


def test_written_files_and_step_are_typed(tmp_path: Path) -> None:
    r = ckpt_cli.convert(_file(tmp_path), tmp_path / "out.safetensors", to="fp16")
    (f,) = r.write.files
    assert isinstance(f, ckpt_cli.WrittenFile)
    assert (f.path, f.bytes) == ("out.safetensors", (tmp_path / "out.safetensors").stat().st_size)
    name, size = f  # still a tuple
    assert r.to_dict()["files"] == [{"path": name, "bytes": size}]
    index = ckpt_cli.inspect(tmp_path / "out.safetensors").index
    assert index is not None
    assert index.step is None and index.step_source is None


USER_SCRIPT = """\
    from pathlib import Path

    import ckpt_cli


    def shrink(src: Path, out: Path) -> int:
        try:
            result = ckpt_cli.convert(src, out, to={to!r}, fp8_layout="channel")
        except FileExistsError:
            return 0
        except ckpt_cli.CkptError as e:
            raise SystemExit(str(e)) from e
        step = ckpt_cli.inspect(out).index
        if step is not None and step.step is not None:
            print(step.step + 1)
        return sum(f.bytes for f in result.write.files)
"""


@pytest.mark.slow
def test_a_user_script_type_checks_against_the_installed_package(tmp_path: Path) -> None:
    """What README's ``pip install -e .`` installs is visible to mypy (no import hook), and
    the aliases make a bad value a type error before anything runs."""
    pytest.importorskip("mypy")

    def check(to: str) -> subprocess.CompletedProcess[str]:
        script = tmp_path / f"user_{to}.py"
        script.write_text(textwrap.dedent(USER_SCRIPT.format(to=to)))
        return subprocess.run([sys.executable, "-m", "mypy", "--strict", "--no-incremental",
                               "--cache-dir", str(tmp_path / ".mypy"), script.name],
                              cwd=tmp_path, capture_output=True, text=True, timeout=600,
                              env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})

    good = check("fp8")
    assert good.returncode == 0, good.stdout + good.stderr
    bad = check("fp12")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert 'Argument "to" to "convert" has incompatible type "Literal[\'fp12\']"' in bad.stdout
