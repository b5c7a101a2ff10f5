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
- ``_mp_queue.py``: the only module that touches ``multiprocessing.Queue``'s
  private attributes (and the Python versions that was checked on).
"""
from __future__ import annotations

from ._index_queue import IndexQueue
from ._mp_queue import become_write_only, close_queue, reader_fd, write_lock
from ._pipe_reader import HalfMessage, MessageReader, Stopped
from ._result_writer import ResultWriter
from ._wait import WAIT_SLICE, join_process, wait_ready

__all__ = [
    "WAIT_SLICE", "HalfMessage", "IndexQueue", "MessageReader", "ResultWriter", "Stopped",
    "become_write_only", "close_queue", "join_process", "reader_fd", "wait_ready",
    "write_lock",
]
