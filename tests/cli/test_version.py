"""``psring --version``: the package's version and its wire protocol's, as the daemons report them."""

from __future__ import annotations

import subprocess
import sys

import pytest

import psring
from psring.core import wire


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_version_flag_prints_the_packages_version_and_exits() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "psring", "--version"], capture_output=True, text=True, timeout=50, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"psring {psring.__version__} (wire {wire.WIRE_VERSION})"
