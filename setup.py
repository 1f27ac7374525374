"""Build step for the optional compiled kernels (everything else is in pyproject.toml).

``ckpt_cli.tensors._f16c`` converts FP32 to FP16 with the x86 F16C instruction, about 10x
numpy's cast per core. It is optional: where it cannot be built (no C compiler, another
architecture) the install goes on and casts use the pure-numpy kernel, bit for bit the same.

``ckpt_cli.tensors._moments`` computes ``ckpt stats``' figures of a piece of values in one
pass (plain C99, built wherever a C compiler is found; no -ffast-math, which would break its
NaN checks and the order of its sums, and no fused multiply-adds, so that every CPU gives
the same bits). Also optional: without it the numpy kernel in
``ckpt_cli/tensors/moments.py`` gives the same figures, several times slower.
"""

import platform
import sys

from setuptools import Extension, setup

extensions = []
if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686") and sys.platform != "win32":
    extensions.append(Extension("ckpt_cli.tensors._f16c", ["ckpt_cli/tensors/_f16c.c"],
                                extra_compile_args=["-O2"], optional=True))

extensions.append(Extension("ckpt_cli.tensors._moments", ["ckpt_cli/tensors/_moments.c"],
                            extra_compile_args=[] if sys.platform == "win32"
                            else ["-O3", "-ffp-contract=off"],
                            optional=True))

setup(ext_modules=extensions)
