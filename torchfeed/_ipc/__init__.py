"""The pipes between the main process and the workers.

Two kinds of ``multiprocessing.Queue`` carry everything: one index queue per
worker (main → worker: tasks) and one result queue that all workers share
(worker → main: results).  Both keep the queue's wire format, so either side
may still use ``Queue.put`` / ``Queue.get``; on the hot path torchfeed writes
and reads the pipes itself, which spares a feeder-thread wakeup per message
and never hangs on half a message.

- ``_framing.py``: the wire format, one codec for both writers and the reader;
  ``PIPE_BUF``, the largest message written directly.
- ``_index_queue.py``: ``IndexQueue``, the main thread's direct writes of tasks.
- ``_result_writer.py``: ``ResultWriter``, a worker's direct writes of results.
- ``_pipe_reader.py``: ``MessageReader``, the main process's reads of results.
- ``_wait.py``: ``wait_ready`` on pipes and sentinels, ``join_process`` (a join
  that also sees a death whose sentinel stays quiet); ``WAIT_SLICE``.
- ``_relay.py``: ``RelayReader``, the portable backend's reads of results.
- ``_mp_queue.py``: the only module that touches ``multiprocessing.Queue``'s
  private attributes (and the Python versions that was checked on).

Two backends, chosen per process by ``_host.fd_backend()``: the fd backend
(Linux, macOS) writes and reads the pipes as file descriptors as above; the
portable one (Windows, whose pipes are handles and which has no ``poll``, or
``TORCHFEED_PORTABLE=1`` anywhere) writes through the queues' own ``put``
(their feeder threads), reads results through ``RelayReader`` and waits with
``multiprocessing.connection.wait``.  Both keep the wire format, so a process
of one backend talks to a process of the other.  What the portable backend
gives up where it is forced on a POSIX host: its index queues' feeder threads
(multiprocessing's, as in torch's loader) are alive when a restarted worker is
forked (Windows, which needs the backend, has no fork), and the test-only fault
hook's kill points in the direct writes (``tests/faults``) are never reached.
"""
from __future__ import annotations

from .. import _host
from . import _mp_queue, _relay
from ._index_queue import IndexQueue
from ._mp_queue import become_write_only, reader_connection, reader_fd, write_lock
from ._pipe_reader import HalfMessage, MessageReader, Stopped
from ._relay import RelayReader, paused_for_fork
from ._result_writer import ResultWriter
from ._wait import WAIT_SLICE, join_process, wait_ready

__all__ = [
    "WAIT_SLICE", "HalfMessage", "IndexQueue", "MessageReader", "RelayReader", "ResultWriter",
    "Stopped", "become_write_only", "close_queue", "join_process", "paused_for_fork", "reader_fd",
    "reader_ready", "result_reader", "wait_ready", "write_lock",
]


def result_reader(queue):
    """The reader of the result queue for this process's backend."""
    return MessageReader(queue) if _host.fd_backend() else RelayReader(queue)


def reader_ready(queue):
    """``ready(timeout) -> bool``: whether ``queue`` has a message to ``get``,
    waiting up to ``timeout`` (a worker's wait for its next task)."""
    if _host.fd_backend():
        fds = [reader_fd(queue)]
        return lambda timeout: bool(wait_ready(fds, timeout))
    return reader_connection(queue).poll


def close_queue(q, close_pipe_ends: bool = False) -> None:
    """``_mp_queue.close_queue``, once a relay reading ``q`` has stopped."""
    _relay.stop_reading(q)
    _mp_queue.close_queue(q, close_pipe_ends)
