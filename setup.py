"""The optional C extension (psring._native: the same-host board's hot loop); everything else is in
pyproject.toml. Where it does not build (no compiler, no Python headers) psring installs without it
and runs the pure-Python path, which gives the same bits."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "psring._native",
            ["psring/_native.c"],
            # one IEEE operation at a time: the folds' bits are numpy's
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-fast-math"],
            optional=True,
        )
    ]
)
