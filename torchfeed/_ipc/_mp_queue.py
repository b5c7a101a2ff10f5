"""The private parts of ``multiprocessing.Queue`` that torchfeed relies on.

Writing and reading a queue's pipe around its feeder thread needs the pipe's
ends, the queue's size semaphore (``put`` takes a unit, ``get`` gives it
back), its write lock (shared by every writer process) and its feeder thread.
These are private attributes of ``multiprocessing.queues.Queue``; this module
is the only place in torchfeed that names them, so a Python release that
changes them is adapted to here.

Attributes used: ``_reader``, ``_writer`` (the pipe's ``Connection`` ends),
``_sem``, ``_wlock`` (None on Windows), ``_thread`` (None until the first
``put``), ``_ignore_epipe`` (read by the feeder thread when it starts).
``Queue.close()`` closes the pipe ends only
through the feeder thread, so a queue that never started one keeps them open
(``close_queue``).

Checked against: CPython 3.10.13, 3.11.7, 3.12.1 and 3.13.0, by reading their
``multiprocessing/queues.py`` (the attributes above, ``close``, ``_reset``,
``_start_thread`` and ``_feed`` are the same in all four) and by running the
package's round trip, ``python tests/ipc_roundtrip.py .``, under each (the
test suite runs it on the interpreter it runs on: 3.11).
"""
from __future__ import annotations

import threading


def writer_fd(q) -> int:
    """The file descriptor of the queue's write end."""
    return q._writer.fileno()


def reader_fd(q) -> int:
    """The file descriptor of the queue's read end."""
    return q._reader.fileno()


def reader_connection(q):
    """The queue's read end, a ``Connection`` (a ``PipeConnection`` on Windows,
    whose ``fileno()`` is a handle, not a descriptor)."""
    return q._reader


def close_writer(q) -> None:
    """Close this process's write end of ``q`` (a queue it never writes to):
    once every writer's end is closed, a reader blocked on the pipe gets
    end-of-file."""
    q._writer.close()


def size_semaphore(q):
    """The queue's size bound: ``put`` acquires it and ``get`` releases it, so a
    writer that bypasses ``put`` acquires, and a reader that bypasses ``get``
    releases, exactly as they would."""
    return q._sem


def write_lock(q):
    """The lock every writer process holds while it writes a message (None
    where the platform's pipe writes are atomic: Windows)."""
    return q._wlock


def quiet_epipe(q) -> None:
    """Make ``q``'s feeder thread end quietly when the pipe's readers are all
    gone (``EPIPE``), instead of printing a traceback for that message and
    every later one.  The feeder reads the setting when it starts: call this
    before the first ``put``."""
    q._ignore_epipe = True


def become_write_only(q) -> None:
    """For a process that only writes to ``q``: close its read end (holding it
    open would keep the pipe alive after every reader is gone), and make a
    feeder thread that finds the pipe broken (EPIPE) exit quietly instead of
    printing a traceback."""
    q._reader.close()
    q._ignore_epipe = True


def close_queue(q, close_pipe_ends: bool = False) -> None:
    """Close ``q`` without waiting on it at exit, and give its feeder thread a
    second to flush.  ``Queue.close`` closes the pipe ends only through the
    feeder thread; with ``close_pipe_ends``, a queue that never started one
    has them closed here.

    ``close_pipe_ends`` is for a queue this process only writes (an index
    queue, whose reader has exited): its read end is closed first, so a
    feeder thread blocked on a full pipe that no one will read again gets
    ``EPIPE`` and ends (quietly, after ``quiet_epipe``), instead of blocking
    for good."""
    q.cancel_join_thread()
    feeder = q._thread
    if close_pipe_ends and feeder is not None:
        q._reader.close()
    q.close()
    if feeder is None:
        if close_pipe_ends:
            q._reader.close()
            q._writer.close()
    elif feeder is not threading.current_thread():
        feeder.join(timeout=1.0)
