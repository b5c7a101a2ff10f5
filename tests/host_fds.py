"""Descriptors numbered past what ``select.select`` takes, for the whole suite
(tests/conftest.py's docstring says why; tests/test_host_fds.py checks it)."""
from __future__ import annotations

import os

SELECT_LIMIT = 1024  # select.select takes descriptors below this (FD_SETSIZE)
FD_LIMIT_FOR_HIGH_FDS = 4096  # ulimit -n from which the tests' descriptors start at SELECT_LIMIT
_low_fds: list[int] = []  # the /dev/null descriptors that take the numbers below SELECT_LIMIT


def high_fds_possible() -> bool:
    try:
        import resource
    except ImportError:  # not a POSIX host
        return False
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= FD_LIMIT_FOR_HIGH_FDS


def take_low_fds() -> None:
    """The numbers below ``SELECT_LIMIT``, taken by descriptors of ``/dev/null``
    (not inheritable: PEP 446), where ``ulimit -n`` is ``FD_LIMIT_FOR_HIGH_FDS``
    or more; once per process."""
    if _low_fds or not high_fds_possible():
        return
    while True:
        fd = os.open(os.devnull, os.O_RDONLY)
        if fd >= SELECT_LIMIT:
            os.close(fd)
            return
        _low_fds.append(fd)
