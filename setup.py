"""The optional C extension (psring._native, psring/native/: one file per engine -- the same-host boards,
the TCP small-message links' one-hop and two-hop exchanges, the data plane's ring -- the fold they share,
and the module table); everything else is in pyproject.toml. Where it does not build (no compiler, no
Python headers) psring installs without it and runs the pure-Python path, which gives the same bits.

``PSRING_NATIVE_CFLAGS`` adds compiler and linker flags (``.ci/sanitize`` builds it with
``-fsanitize=address,undefined`` that way)."""

import os
from glob import glob

from setuptools import Extension, setup

extra = os.environ.get("PSRING_NATIVE_CFLAGS", "").split()

setup(
    ext_modules=[
        Extension(
            "psring._native",
            sorted(glob("psring/native/*.c")),
            include_dirs=["psring/native"],
            depends=sorted(glob("psring/native/*.h")),
            # one IEEE operation at a time: the folds' bits are numpy's
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-fast-math", *extra],
            extra_link_args=extra,
            optional=True,
        )
    ]
)
