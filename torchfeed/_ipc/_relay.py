"""Reading the result queue without file descriptors: the portable backend's
``MessageReader`` (Windows, or ``TORCHFEED_PORTABLE=1``).

``_pipe_reader.MessageReader`` reads the pipe's bytes with ``os.read`` as they
come, so half a message from a worker that died writing it never blocks the
main process.  Where the pipe is not a file descriptor (Windows' named pipes)
only ``Connection.recv_bytes`` can read it, and it blocks until a whole
message is there: for good, if its writer died half-way.  So the main process
never calls it; a relay thread does, and hands each whole message over inside
the process: a deque, and a token on a pipe of the relay's own, which the main
process waits on together with the workers' sentinels (``wait_ready``:
``multiprocessing.connection.wait``, WaitForMultipleObjects on Windows).  The
token is in that pipe exactly while the deque holds a message (both change
under one lock), so the pipe is readable exactly while a message can be
taken without waiting, as the result pipe itself is for the fd reader.

The thread may block on half a message; the main process never does.  While
the thread is part-way through a message (``started``) and a worker is dead,
``read`` waits at most ``STALL`` seconds for the rest, then raises
``HalfMessage`` naming that worker, as the fd reader does.  Unlike that
reader it cannot see bytes arrive, only whole messages, so a live worker's
message that takes longer than ``STALL`` to write while another worker lies
dead is taken for the dead one's half message: the error names the dead
worker either way, and only a restart (``_restart.py``) is refused.

The thread runs only while the iterator reads: it starts when ``fd`` is first
waited on, stops before any worker is forked (``paused_for_fork``, from
``_processes._alone_for_fork``: NOTE [ No thread of ours at a fork ]) and
when the queue is closed (``close_queue``), and restarts on the next wait.
"""
from __future__ import annotations

import collections
import multiprocessing.connection
import threading
import weakref
from contextlib import contextmanager

from ._mp_queue import close_writer, reader_connection, size_semaphore
from ._pipe_reader import Stopped, check_stall
from ._wait import WAIT_SLICE, wait_ready

_TOKEN = b"\1"
_relays: weakref.WeakSet = weakref.WeakSet()  # every open RelayReader of this process


class RelayReader:
    """Whole messages from ``queue``'s pipe (the result queue's), through a relay thread."""

    def __init__(self, queue) -> None:
        self.queue = queue
        self._conn = reader_connection(queue)
        self._give_slot = size_semaphore(queue).release
        self._inbox: collections.deque = collections.deque()
        self._lock = threading.Lock()  # the inbox and the token change together
        self._wake_r, self._wake_w = multiprocessing.connection.Pipe(duplex=False)
        self._thread: threading.Thread | None = None
        self._halt = False      # the thread is asked to stop (a fork, the close)
        self._midway = False    # the thread has seen a message begin and is reading it
        self._ended: BaseException | None = None  # what ended the thread (the pipe closed)
        self.closed = False
        _relays.add(self)

    @property
    def fd(self):
        """What to wait on, with the sentinels, for a whole message: the relay's
        own pipe.  Waiting on it starts the relay thread if it is not running."""
        self._run_thread()
        return self._wake_r

    def has_message(self) -> bool:
        """A whole message is here: reading it will not wait."""
        return bool(self._inbox)

    def started(self) -> bool:
        """A message has begun to arrive: in the inbox, part-way through the
        relay, or in the pipe still (the thread is between reads, or stopped:
        a restart's drain must see those too).  ``poll`` reads nothing."""
        if self._inbox or self._midway:
            return True
        try:
            return not self.closed and self._conn.poll(0)
        except (OSError, EOFError):
            return False

    def read(self, sentinels: dict, stopping, dead: int | None = None,
             ready: bool = False, alive=None) -> bytes:
        """One whole message; one must have begun to arrive (``started``).
        ``sentinels``, ``stopping``, ``dead``, ``alive`` as ``MessageReader.read``'s;
        ``ready`` needs no handling here (the inbox says)."""
        sentinels = dict(sentinels)
        stalled_since = None
        while True:
            message = self._take()
            if message is not None:
                return message
            if self._ended is not None and not self._midway:
                raise EOFError("the result queue was closed mid-message") from self._ended
            woken = wait_ready([self.fd, *sentinels], WAIT_SLICE)
            if not woken and alive is not None:  # NOTE [ A sentinel held open ] (_wait.py)
                woken = [s for s, worker_id in sentinels.items() if not alive(worker_id)]
            if self._wake_r in woken:
                continue  # a message is in
            for sentinel in woken:  # stop watching it: a dead sentinel stays ready
                if sentinel in sentinels:
                    dead = sentinels.pop(sentinel)
            if stopping():
                raise Stopped()
            stalled_since = check_stall(dead, stalled_since)

    def _take(self) -> bytes | None:
        """The first message of the inbox, or None; the token goes with the last one."""
        with self._lock:
            if not self._inbox:
                return None
            message = self._inbox.popleft()
            if not self._inbox:
                self._wake_r.recv_bytes()  # there: written with the first message, under this lock
        self._give_slot()  # as Queue.get does: the writer took it
        return message

    # -- the relay thread -------------------------------------------------------
    def _run_thread(self) -> None:
        if self.closed:
            return
        self._halt = False
        thread = self._thread
        if thread is None or not thread.is_alive():
            if self._ended is not None:
                return  # the pipe is gone: nothing more will come
            thread = threading.Thread(target=self._relay, name="torchfeed-result-relay",
                                      daemon=True)
            thread.start()
            self._thread = thread

    def _relay(self) -> None:
        conn, inbox, wake, lock = self._conn, self._inbox, self._wake_w, self._lock
        try:
            while not self._halt:
                if not conn.poll(WAIT_SLICE):
                    continue
                self._midway = True
                message = conn.recv_bytes()
                with lock:
                    inbox.append(message)
                    if len(inbox) == 1:
                        wake.send_bytes(_TOKEN)  # one token: the pipe never fills
                self._midway = False
        except (EOFError, OSError) as exc:  # the queue was closed (its last writer gone)
            with lock:
                self._ended = exc
                if not inbox:
                    try:
                        wake.send_bytes(_TOKEN)  # wakes a reader, which then sees the end
                    except OSError:
                        pass
        finally:
            self._midway = False

    def stop_thread(self, timeout: float = 1.0) -> bool:
        """Stop the relay thread; False if it is still alive after ``timeout``
        (blocked on half a message from a dead writer: it ends when the pipe
        is closed)."""
        self._halt = True
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(timeout)
        return not thread.is_alive()

    def close(self) -> None:
        """Before the queue is closed, its workers gone: the thread stops reading
        its pipe.  A thread blocked on half a message from a dead worker is
        woken by closing this process's end of the pipe's write side, the
        last one open (the main process never writes results)."""
        if self.closed:
            return
        if not self.stop_thread():
            close_writer(self.queue)
            self.stop_thread()
        self.closed = True
        _relays.discard(self)
        self._wake_r.close()
        self._wake_w.close()


@contextmanager
def paused_for_fork():
    """No relay thread runs while the block forks a worker (each restarts on
    its next wait)."""
    for relay in list(_relays):
        relay.stop_thread()
    yield


def stop_reading(queue) -> None:
    """Close the relay reading ``queue``, if any, before the queue is closed."""
    for relay in list(_relays):
        if relay.queue is queue:
            relay.close()
