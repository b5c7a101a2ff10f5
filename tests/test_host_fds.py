"""The suite's descriptors start at 1024 where the host allows it (tests/host_fds.py),
so that a ``select.select`` anywhere in torchfeed or the tests fails in every run."""
from __future__ import annotations

import multiprocessing.connection
import os
import select

import pytest
from host_fds import FD_LIMIT_FOR_HIGH_FDS, SELECT_LIMIT, high_fds_possible


@pytest.mark.skipif(not high_fds_possible(), reason=(
    f"ulimit -n is below {FD_LIMIT_FOR_HIGH_FDS}: the suite's descriptors stay low here, "
    "and select.select cannot fail on them"))
def test_descriptors_start_past_what_select_takes():
    r, w = os.pipe()
    try:
        assert min(r, w) >= SELECT_LIMIT
        with pytest.raises(ValueError, match="filedescriptor out of range"):
            select.select([r], [], [], 0)  # so a select.select in a test or in torchfeed fails
        os.write(w, b"x")
        assert multiprocessing.connection.wait([r], 1.0) == [r]  # what the tests use instead
    finally:
        os.close(r)
        os.close(w)
