"""The collection check that every test importing torch carries ``requires_torch``."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

from tests.conftest import function_imports_torch, module_imports_torch

pytest_plugins = ["pytester"]

SOURCE = textwrap.dedent("""
    import pytest
    from safetensors.numpy import save_file

    def helper():
        import torch

    def test_plain():
        pass

    def test_local():
        from torch.nn import Linear

    class TestGroup:
        def test_method(self):
            import torch.nn.functional as F
""")


def test_imports_are_found_where_they_are() -> None:
    tree = ast.parse(SOURCE)
    assert not module_imports_torch(tree)  # a helper's local import is not the module's
    assert not function_imports_torch(tree, "test_plain")
    assert function_imports_torch(tree, "test_local")
    assert function_imports_torch(tree, "test_method")
    assert module_imports_torch(ast.parse("from safetensors.torch import load_file\n"))
    guarded = "try:\n    import torch\nexcept ImportError:\n    pass\n"
    assert module_imports_torch(ast.parse(guarded))
    assert not module_imports_torch(ast.parse("import torchvision_like_name_is_not\n"))


def test_an_unmarked_torch_test_fails_collection(pytester: pytest.Pytester) -> None:
    conftest = Path(__file__).with_name("conftest.py").read_text()
    pytester.makeconftest(conftest.replace("from ckpt_cli.cli.app import app\n", "app = None\n"))
    pytester.makeini("[pytest]\nmarkers =\n    requires_torch: imports torch\n")
    pytester.makepyfile(test_bad="def test_x():\n    import torch\n",
                        test_good="import pytest\n\n@pytest.mark.requires_torch\n"
                                  "def test_y():\n    import torch\n")
    bad = pytester.runpytest("--collect-only", "-q", "test_bad.py")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    bad.stderr.fnmatch_lines(["*1 test(s) import torch without the requires_torch marker*"
                              "test_bad.py::test_x*"])
    good = pytester.runpytest("--collect-only", "-q", "test_good.py")
    assert good.ret == pytest.ExitCode.OK
