"""Where a stuck worker is stuck: its Python stacks, for the timeout error.

torch's timeout says only "DataLoader timed out after N seconds".  torchfeed
says which batch it was waiting for, from which worker, and where that worker
is: every worker registers ``faulthandler`` on ``SIGUSR1``, writing into the
write end of a pipe the main process made for it.  When ``timeout`` expires the
main process signals the workers that owe the awaited batch, reads their dumps
from the pipes and puts them in the error.

faulthandler's handler is a C signal handler: it dumps the stacks even while
the worker is blocked in a system call or in native code, or holds the GIL in
a loop.  A pipe, not a file, carries the dump, so nothing is left on disk;
the main process closes its end of every pipe at shutdown.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import time

DUMP_SIGNAL = signal.SIGUSR1
FIRST_BYTE_WAIT = 1.0  # how long a signalled worker has to start its dump
QUIET = 0.1            # a dump is complete once its pipe has been quiet this long
MAX_DUMP = 1 << 16     # the pipe's own capacity: faulthandler never writes more

_installed = None  # the worker's write end, kept alive while faulthandler uses its fd


class StackPipe:
    """The main process's end of one worker's dump pipe."""

    def __init__(self, ctx) -> None:
        self.reader, self.writer = ctx.Pipe(duplex=False)

    def started(self) -> None:
        """The worker has its copy of the write end; the main needs none."""
        self.writer.close()

    def close(self) -> None:
        self.reader.close()
        self.writer.close()

    def _drain(self) -> bytes:
        out = b""
        fd = self.reader.fileno()
        while len(out) < MAX_DUMP and self.reader.poll(0):
            chunk = os.read(fd, MAX_DUMP)
            if not chunk:
                break
            out += chunk
        return out

    def request(self, pid: int) -> bool:
        self._drain()  # whatever an earlier request left behind
        try:
            os.kill(pid, DUMP_SIGNAL)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def collect(self, deadline: float) -> str | None:
        """The dump that ``request`` asked for, or None if none came by ``deadline``."""
        if not self.reader.poll(max(0.0, deadline - time.monotonic())):
            return None
        out = b""
        while True:
            out += self._drain()
            if len(out) >= MAX_DUMP or not self.reader.poll(QUIET):
                break
        return out.decode("utf-8", "replace")


def install(writer) -> None:
    """In the worker: dump all threads' stacks into ``writer`` on SIGUSR1."""
    global _installed
    if writer is None:
        return
    _installed = writer
    faulthandler.register(DUMP_SIGNAL, file=writer.fileno(), all_threads=True, chain=False)


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
    """The timeout message.  ``awaited``: (worker_id, pid, batch_index, indices
    description) of what the main process was waiting for; ``dumps``: worker id
    to its stacks, or None when it did not answer."""
    head = f"DataLoader timed out after {timeout} seconds"
    if awaited:
        parts = [f"batch {b} ({ix}) from worker {w} (pid {p})" if b is not None
                 else f"worker {w} (pid {p})" for w, p, b, ix in awaited]
        head += " waiting for " + "; ".join(parts)
    lines = [head + "."]
    for worker_id, pid, _, _ in awaited:
        dump = dumps.get(worker_id)
        if dump:
            lines.append(f"Python stacks of worker {worker_id} (pid {pid}) when the timeout "
                         f"expired, most recent call first:\n{_trim(dump)}")
        else:
            lines.append(f"Worker {worker_id} (pid {pid}) did not answer the request for its "
                         f"stacks ({DUMP_SIGNAL.name}) within {FIRST_BYTE_WAIT:g} s; it may be "
                         "stuck with signals blocked, or have replaced the handler.")
    lines.append(f"Hint: the stacks show where each worker was when the timeout expired: a "
                 f"deadlock, a read from disk or network that never returns, or a sample that "
                 f"takes longer than timeout={timeout} to load. Fix the code at the top of the "
                 f"stack, or raise timeout.")
    return "\n".join(lines)


def collect_dumps(requests: dict[int, tuple[StackPipe, int]]) -> dict[int, str | None]:
    """Signal every worker first, then read the answers, so N stuck workers
    cost one wait, not N."""
    asked = {w: pipe for w, (pipe, pid) in requests.items() if pipe.request(pid)}
    deadline = time.monotonic() + FIRST_BYTE_WAIT
    return {w: pipe.collect(deadline) for w, pipe in asked.items()}
