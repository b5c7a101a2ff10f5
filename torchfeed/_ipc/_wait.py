"""Waiting on pipes and process sentinels: ``wait_ready``, ``join_process`` and
``WAIT_SLICE``.

The main process waits on the result queue's pipe and every live worker's
sentinel at once; a worker waits on its index queue's pipe between checks that
the main process is alive.  No wait anywhere in the main process is longer
than ``WAIT_SLICE``, so timeouts, dead writers and stop requests are noticed
within it.

Two backends behind one call: file descriptors (ints) on a host with
``poll`` go to one cached ``poll`` object; anything else (the portable
backend's ``Connection`` objects, Windows' process handles) goes to
``multiprocessing.connection.wait``, which takes both, on every platform
(WaitForMultipleObjects on Windows).

NOTE [ A sentinel held open ]
A process's sentinel is the read end of a pipe whose write end only the
process should hold, so that it becomes readable when the process ends.  But
a child the worker starts with ``exec`` inherits that write end wherever it
was passed to the worker as an inheritable descriptor, as ``spawn`` does:
torch's ``torch_shm_manager``, which the ``file_system`` sharing strategy
starts (macOS's default strategy), outlives the worker, orphaned, and keeps
the sentinel quiet for good.  So a sentinel is a fast path, never the only
one: every wait that watches sentinels also asks ``is_alive()`` (a
``waitpid``) once per slice in which nothing arrived, as torch's loader polls
``is_alive()``, and a join is sliced the same way (``join_process``).
"""
from __future__ import annotations

import math
import multiprocessing.connection
import select
import threading
import time

from .. import _host

WAIT_SLICE = 0.1   # longest single wait, so timeouts, dead writers and stop requests are noticed
JOIN_SLICE = 0.05  # how often a join asks whether a process whose sentinel stays quiet is gone

_pollers = threading.local()


def wait_ready(fds, timeout: float | None) -> list:
    """The objects among ``fds`` that are readable (or closed, or in error),
    waiting up to ``timeout`` seconds.

    Plain fds where the host has ``poll``: ``connection.wait`` without
    building and tearing down a selector on every call, which is most of its
    cost when it runs once or twice per batch.  One poll object per thread and
    set of fds (a fd number reused by a new worker's sentinel means the same to
    poll, so the cache needs no invalidation).  Anything else: ``connection.wait``."""
    key = tuple(fds)
    if not _host.HAS_POLL or not all(type(fd) is int for fd in key):
        return multiprocessing.connection.wait(key, timeout)
    return _poll(key, timeout)


def _poll(key: tuple, timeout: float | None) -> list:
    if not _host.HAS_POLL:
        raise OSError(f"no poll on {_host.PLATFORM}")
    cache = getattr(_pollers, "cache", None)
    if cache is None:
        cache = _pollers.cache = {}
    poller = cache.get(key)
    if poller is None:
        if len(cache) > 16:  # sentinel sets change only when workers retire or restart
            cache.clear()
        poller = cache[key] = select.poll()
        for fd in key:
            poller.register(fd, select.POLLIN)
    ms = -1 if timeout is None else max(0, math.ceil(timeout * 1000))
    while True:
        try:
            return [fd for fd, event in poller.poll(ms) if event & ~select.POLLOUT]
        except InterruptedError:  # pragma: no cover - PEP 475 retries poll itself
            continue


def join_process(process, timeout: float) -> None:
    """``process.join(timeout)`` that also ends when the process is gone though
    its sentinel stays quiet (NOTE [ A sentinel held open ]): it joins in
    slices of at most ``JOIN_SLICE`` and asks ``is_alive()`` between them."""
    deadline = time.monotonic() + timeout
    while process.is_alive():
        left = deadline - time.monotonic()
        if left <= 0:
            return
        process.join(min(left, JOIN_SLICE))
