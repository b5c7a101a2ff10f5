"""Where a stuck worker is stuck: its Python stacks, for the timeout error.

torch's timeout says only "DataLoader timed out after N seconds".  torchfeed
says which batch it was waiting for, from which worker, and where that worker
is: every worker registers ``faulthandler`` on ``SIGUSR1``, writing into the
write end of a pipe the main process made for it.  When ``timeout`` expires the
main process signals the workers that owe the awaited batch, reads their dumps
from the pipes and puts them in the error.

A worker that has not installed its handler yet (it is still importing torch
under spawn, say) must not be signalled: SIGUSR1's default action would kill
it.  So a worker writes one byte, ``READY``, into its pipe right after the
handler is in place, and the main process signals only workers whose byte it
has read; the others are reported as still starting.  Every read is bounded by
a deadline, and a pipe at EOF (its worker is gone) means "no dump".

faulthandler's handler is a C signal handler: it dumps the stacks even while
the worker is blocked in a system call or in native code, or holds the GIL in
a loop.  A pipe, not a file, carries the dump, so nothing is left on disk;
the main process closes its end of every pipe at shutdown.

Windows has no SIGUSR1 and no ``faulthandler.register`` (``_host.HAS_STACK_DUMPS``):
there no pipe is made, and the timeout error says, instead of the stacks, that
this platform cannot give them: torch's message, with what was awaited.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import time
from typing import Any

from . import _host
from ._errors import describe_samples
from ._protocol import TaskInfo

FIRST_BYTE_WAIT = 1.0  # how long a signalled worker has to start its dump
QUIET = 0.1            # a dump is complete once its pipe has been quiet this long
MAX_DUMP = 1 << 16     # the pipe's own capacity: faulthandler never writes more
READY = b"\0"          # a worker's first byte: its handler is installed
STARTING = "starting"  # collect_dumps' answer for a worker not yet ready
UNAVAILABLE = "unavailable"  # collect_dumps' answer where the host cannot dump stacks

_installed = None  # the worker's write end, kept alive while faulthandler uses its fd


class StackPipe:
    """The main process's end of one worker's dump pipe (none where the host
    cannot dump stacks: ``reader`` and ``writer`` are None)."""

    def __init__(self, ctx) -> None:
        self.reader: Any = None
        self.writer: Any = None
        if _host.HAS_STACK_DUMPS:
            self.reader, self.writer = ctx.Pipe(duplex=False)
        self.ready = False  # the worker has said its handler is installed

    def started(self) -> None:
        """The worker has its copy of the write end; the main needs none."""
        if self.writer is not None:
            self.writer.close()

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
            self.writer.close()

    def _drain(self) -> tuple[bytes, bool]:
        """What the pipe holds now, without waiting, and whether it is at EOF."""
        out = b""
        fd = self.reader.fileno()
        while len(out) < MAX_DUMP and self.reader.poll(0):
            try:
                chunk = os.read(fd, MAX_DUMP)
            except OSError:
                return out, True
            if not chunk:
                return out, True
            out += chunk
        return out, False

    def request(self, pid: int) -> bool:
        """Signal the worker to dump its stacks; False if it is not ready for
        that (or gone).  Whatever the pipe holds (the ready byte, the rest of
        an earlier dump) is read first, so the answer starts clean."""
        if not _host.HAS_STACK_DUMPS:
            return False
        data, eof = self._drain()
        if READY in data:
            self.ready = True
        if not self.ready or eof:
            return False
        try:
            os.kill(pid, signal.SIGUSR1)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def collect(self, deadline: float) -> str | None:
        """The dump that ``request`` asked for, or None if none began by
        ``deadline``.  Once it has begun it is read until the pipe is quiet
        for ``QUIET`` or at EOF, and never past ``deadline + FIRST_BYTE_WAIT``."""
        if not self.reader.poll(max(0.0, deadline - time.monotonic())):
            return None
        hard_deadline = deadline + FIRST_BYTE_WAIT
        out = b""
        while True:
            data, eof = self._drain()
            out += data
            left = hard_deadline - time.monotonic()
            if eof or len(out) >= MAX_DUMP or left <= 0 or not self.reader.poll(min(QUIET, left)):
                break
        return out.decode("utf-8", "replace") or None


def install(writer) -> None:
    """In the worker: dump all threads' stacks into ``writer`` on SIGUSR1."""
    global _installed
    if not _host.HAS_STACK_DUMPS:
        return
    if writer is None:
        return
    _installed = writer
    faulthandler.register(signal.SIGUSR1, file=writer.fileno(), all_threads=True, chain=False)
    try:
        os.write(writer.fileno(), READY)  # from now on a SIGUSR1 is safe
    except OSError:
        pass  # the main process is gone; the watchdog ends us


_OWN_THREADS = ("in _watch_main_process", "in _feed", "in _serve")  # watchdog, queue feeder, fd sharer


def _trim(dump: str) -> str:
    """The worker's main thread first, then any threads the user's code
    started; the loader's own helper threads are left out.  Frames below
    ``worker_loop`` are dropped too: they are the fork's bootstrap and, with
    the fork start method, the main process's frames at the time of the fork,
    which would point the reader at the wrong process."""
    main, others = [], []
    for block in dump.strip().split("\n\n"):
        lines, kept = block.splitlines(), []
        for line in lines:
            kept.append(line)
            if "in worker_loop" in line:
                break
        text = "\n".join(kept)
        if "in worker_loop" in text:
            main.append(text)
        elif not any(marker in text for marker in _OWN_THREADS):
            others.append(text)
    return "\n\n".join(main + others)


def describe_timeout(timeout: float, awaited: list[tuple], dumps: dict[int, str | None]) -> str:
    """The timeout message: torch's sentence, word for word, as its first
    line, then what was awaited and where the workers that owe it are.
    ``awaited``: (worker_id, pid, batch_index, indices description) of what
    the main process was waiting for; ``dumps``: worker id to its stacks,
    ``STARTING`` for a worker that had not started, or None when it did not
    answer."""
    lines = [f"DataLoader timed out after {timeout} seconds"]
    if awaited:
        parts = [f"batch {b} ({ix}) from worker {w} (pid {p})" if b is not None
                 else f"worker {w} (pid {p})" for w, p, b, ix in awaited]
        lines.append("It was waiting for " + "; ".join(parts) + ".")
    starting = False
    for worker_id, pid, _, _ in awaited:
        dump = dumps.get(worker_id)
        if dump == UNAVAILABLE:
            lines.append(f"Python stacks of worker {worker_id} (pid {pid}) are not available on "
                         f"{_host.PLATFORM}, which has no SIGUSR1 for faulthandler.register.")
        elif dump == STARTING:
            starting = True
            lines.append(f"worker {worker_id} (pid {pid}) was still starting: it had not "
                         "reached the dataset yet (importing modules, or unpickling the "
                         "dataset under the spawn or forkserver start method).")
        elif dump:
            lines.append(f"Python stacks of worker {worker_id} (pid {pid}) when the timeout "
                         f"expired, most recent call first:\n{_trim(dump)}")
        else:
            lines.append(f"Worker {worker_id} (pid {pid}) did not answer the request for its "
                         f"stacks (SIGUSR1) within {FIRST_BYTE_WAIT:g} s; it may be "
                         "stuck with signals blocked, or have replaced the handler.")
    if any(dumps.get(w) == UNAVAILABLE for w, _, _, _ in awaited):
        lines.append(f"Hint: a deadlock, a read from disk or network that never returns, or a "
                     f"sample that takes longer than timeout={timeout} to load. Run with "
                     f"num_workers=0 to see where it is stuck, or raise timeout.")
    elif starting:
        lines.append(f"Hint: a worker that is still starting when timeout={timeout} expires "
                     "needs a longer timeout: timeout counts from iter(), and a worker started "
                     "with spawn or forkserver imports torch and unpickles the dataset first.")
    else:
        lines.append(f"Hint: the stacks show where each worker was when the timeout expired: "
                     f"a deadlock, a read from disk or network that never returns, or a sample "
                     f"that takes longer than timeout={timeout} to load. Fix the code at the top "
                     f"of the stack, or raise timeout.")
    return "\n".join(lines)


def timeout_message(timeout: float, owed: dict[int, TaskInfo | None], workers: list,
                    stack_pipes: list) -> str:
    """``describe_timeout`` for the workers of ``owed`` (worker id -> the first task
    it owes, None if not known) that are alive, with their stacks."""
    alive = {w: t for w, t in owed.items() if workers[w].is_alive()}
    dumps = collect_dumps({w: (stack_pipes[w], workers[w].pid) for w in alive})
    awaited = [(w, workers[w].pid, None, None) if t is None else
               (w, workers[w].pid, t.batch_index, describe_samples(t.indices))
               for w, t in sorted(alive.items())]
    return describe_timeout(timeout, awaited, dumps)


def collect_dumps(requests: dict[int, tuple[StackPipe, int]]) -> dict[int, str | None]:
    """Signal every ready worker first, then read the answers, so N stuck
    workers cost one wait, not N.  A worker that has not said it is ready is
    not signalled (the signal would kill it): its answer is ``STARTING``."""
    asked: dict[int, StackPipe] = {}
    answers: dict[int, str | None] = {}
    if not _host.HAS_STACK_DUMPS:
        return dict.fromkeys(requests, UNAVAILABLE)
    for w, (pipe, pid) in requests.items():
        if pipe.request(pid):
            asked[w] = pipe
        else:
            answers[w] = STARTING if not pipe.ready else None
    deadline = time.monotonic() + FIRST_BYTE_WAIT
    answers.update({w: pipe.collect(deadline) for w, pipe in asked.items()})
    return answers
