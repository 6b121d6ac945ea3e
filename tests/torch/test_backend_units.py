"""The torch backend's own arithmetic and argument checks, in process: AVG of integers as NCCL does
it, and pg_options from frameworks."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (CI installs torch==2.13.0)")

from psring.torch.backend import _integer_avg  # noqa: E402

pytestmark = [pytest.mark.torch]


def test_the_sum_then_cs_integer_division_truncating_toward_zero() -> None:
    op, post = _integer_avg("avg", torch.int64, 2)
    assert op == "sum"
    summed = np.array([-7, 7, -1, 1, 0, -8], np.int64)
    out = post(summed)
    assert out.dtype == np.int64 and out.tolist() == [-3, 3, 0, 0, 0, -4]
    assert out.tolist() == torch.div(torch.from_numpy(summed), 2, rounding_mode="trunc").tolist()
    scalar = post(np.array(-9, np.int64))  # a 0-d tensor's sum (Lightning's batch count) stays an array
    assert isinstance(scalar, np.ndarray) and scalar.shape == () and int(scalar) == -4


def test_floats_and_other_ops_go_through_untouched_and_bool_is_refused() -> None:
    for op, dtype in (("avg", torch.float32), ("avg", torch.bfloat16), ("sum", torch.int64), ("max", torch.int8)):
        got, post = _integer_avg(op, dtype, 3)
        x = np.arange(4)
        assert got == op and post(x) is x
    with pytest.raises(ValueError, match="AVG of bool"):
        _integer_avg("avg", torch.bool, 2)


def test_pg_options_of_another_backend_are_named_psrings_own_are_accepted() -> None:
    """What frameworks may pass to init_process_group(pg_options=...): psring's dict, or c10d's
    options naming psring (their timeout reached the backend separately); another backend's
    options are a clear error naming them."""
    from torch._C._distributed_c10d import Backend

    from psring.torch.backend import _options

    assert _options({"topology": "ps", "servers": 2}) == {"topology": "ps", "servers": 2}
    assert _options(Backend.Options("psring")) == {}
    with pytest.raises(ValueError, match=r"Backend.Options for backend 'nccl' are another backend's"):
        _options(Backend.Options("nccl"))
    if hasattr(torch.distributed, "ProcessGroupGloo"):
        with pytest.raises(ValueError, match=r"ProcessGroupGloo._Options .*'gloo'"):
            _options(torch.distributed.ProcessGroupGloo._Options())
    with pytest.raises(ValueError, match=r"unknown pg_options \['bogus'\]"):
        _options({"bogus": 1})
