"""Exceptions that cross from a worker to the main process, and explanations of
workers that died.

A worker never lets an exception escape: it wraps it in a ``WorkerFailure``
(the original type when it can be pickled, the traceback text, the worker id
and the batch's sample indices) and sends that in place of the batch.  The main
process re-raises it with torch's wording, so code that matches on torch's
messages keeps working, plus the context torch leaves out.

A worker that vanishes without a word (SIGKILL, a segfault, ``os._exit``) is
explained by ``describe_dead_worker``: which worker, which pid, which signal or
exit code, what it had in flight, and what usually causes that.
"""
from __future__ import annotations

import pickle
import signal
import traceback



def _format_indices(indices, limit: int = 16) -> str:
    if indices is None:
        return "none"
    indices = list(indices)
    shown = ", ".join(repr(i) for i in indices[:limit])
    more = f", ... ({len(indices)} in all)" if len(indices) > limit else ""
    return f"[{shown}{more}]"


def describe_samples(indices) -> str:
    if indices is None or all(i is None for i in indices):
        return "an iterable dataset's batch: its samples have no indices"
    return f"sample indices {_format_indices(indices)}"


class KeyErrorMessage(str):
    """A str whose repr is itself, so a re-raised KeyError prints its message
    readably instead of as one long quoted line (torch does the same)."""

    def __repr__(self):
        return self


class WorkerFailure:
    """An exception raised inside a worker, ready to be re-raised in the main process."""

    def __init__(self, exc: BaseException, worker_id: int, where: str, indices=None,
                 batch_index: int | None = None):
        self.worker_id = worker_id
        self.where = where
        self.indices = None if indices is None else list(indices)
        self.batch_index = batch_index
        self.exc_name = type(exc).__name__
        self.traceback = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        # The type crosses only if it can be rebuilt on the other side; else
        # the main process raises torch's fallback, RuntimeError.
        try:
            self.exc_type = pickle.loads(pickle.dumps(type(exc)))
        except Exception:
            self.exc_type = None

    def message(self) -> str:
        if self.worker_id < 0:  # raised in the main process's own threads
            return f"Caught {self.exc_name} in {self.where}.\nOriginal {self.traceback}"
        context = f"in DataLoader worker process {self.worker_id}"
        if self.batch_index is not None:
            context += f" while {self.where} batch {self.batch_index}"
            if self.indices is not None and any(i is not None for i in self.indices):
                context += f" (sample indices {_format_indices(self.indices)})"
        elif self.where:
            context += f" in {self.where}"
        return f"Caught {self.exc_name} {context}.\nOriginal {self.traceback}"

    def reraise(self):
        msg = self.message()
        exc_type = self.exc_type
        if exc_type is None:
            raise RuntimeError(msg)
        if exc_type is KeyError:
            msg = KeyErrorMessage(msg)
        try:
            if getattr(exc_type, "message", None):
                exc = exc_type(message=msg)
            else:
                exc = exc_type(msg)
        except Exception:
            # Types whose constructor wants other arguments cannot be rebuilt
            # from a message; torch falls back to RuntimeError too.
            raise RuntimeError(msg) from None
        try:
            raise exc
        finally:
            # A local holding the exception whose traceback holds this frame
            # is a reference cycle: it would keep the iterator (and its
            # workers) alive until the next garbage collection.
            del exc


_SIGNAL_HINTS = {
    signal.SIGKILL: (
        "SIGKILL is almost always the kernel's out-of-memory killer. Check `dmesg` "
        "(or `journalctl -k`) for 'Out of memory: Killed process', then lower "
        "batch_size, num_workers or prefetch_factor, or make samples smaller."
    ),
    signal.SIGSEGV: (
        "SIGSEGV is a crash inside native code (a C extension, a corrupt file handed "
        "to a decoder, or a library that is not fork-safe). Run with num_workers=0 "
        "to get the crash in the main process, or try multiprocessing_context='spawn'."
    ),
    signal.SIGBUS: (
        "SIGBUS usually means shared memory ran out: /dev/shm is too small "
        "(Docker's default is 64 MB). Start the container with --shm-size=8g, "
        "or lower batch_size or prefetch_factor."
    ),
    signal.SIGABRT: (
        "SIGABRT is an abort() in native code, often a failed assertion in a C "
        "library; the worker's stderr above usually says which."
    ),
    signal.SIGTERM: "SIGTERM means something outside the loader asked the worker to stop.",
}


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by signal {name} ({-exitcode})"
    return f"exited with code {exitcode}"


def describe_dead_worker(worker_id: int, pid: int | None, exitcode: int | None,
                         in_flight: list[tuple[int, object]]) -> str:
    """The message for a worker that died without reporting an error."""
    lines = [f"DataLoader worker {worker_id} (pid {pid}) exited unexpectedly: it "
             f"{describe_exit(exitcode)}."]
    if in_flight:
        shown = "; ".join(f"batch {b} ({describe_samples(ix)})" for b, ix in in_flight[:4])
        more = f"; and {len(in_flight) - 4} more" if len(in_flight) > 4 else ""
        lines.append(f"It had in flight: {shown}{more}.")
    else:
        lines.append("It had no batch in flight.")
    if exitcode is not None and exitcode < 0:
        hint = _SIGNAL_HINTS.get(-exitcode)
        if hint:
            lines.append(f"Hint: {hint}")
    elif exitcode is not None:
        lines.append("Hint: code in the dataset, collate_fn or worker_init_fn ended the "
                     "process (os._exit or sys.exit in a worker, or a library that calls "
                     "exit()). Run with num_workers=0 to see where.")
    return "\n".join(lines)
