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

import operator
import pickle
import signal
import traceback


def _index_list(indices):
    """A task's sample indices as a list.  Without automatic batching
    (``batch_size=None``) a task holds one index, which may be an int or any
    other key the sampler yields; a batch sampler may yield arrays or tensors."""
    if indices is None:
        return None
    if hasattr(indices, "tolist") and not isinstance(indices, (str, bytes)):
        indices = indices.tolist()
    if isinstance(indices, (list, tuple, range)):
        return list(indices)
    return [indices]


def _format_indices(indices, limit: int = 16) -> str:
    if indices is None:
        return "none"
    indices = _index_list(indices)
    shown = ", ".join(repr(i) for i in indices[:limit])
    more = f", ... ({len(indices)} in all)" if len(indices) > limit else ""
    return f"[{shown}{more}]"


def describe_samples(indices) -> str:
    indices = _index_list(indices)
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
                 batch_index: int | None = None, kind: str = "process"):
        self.worker_id = worker_id
        self.kind = kind  # "process" or "thread": torch's sentence names which
        self.where = where
        self.indices = _index_list(indices)
        self.batch_index = batch_index
        self.in_setup = False  # raised before any task: see ``answering``
        self.exc_name = type(exc).__name__
        self.traceback = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        # The type crosses only if it can be rebuilt on the other side; else
        # the main process raises torch's fallback, RuntimeError.
        try:
            self.exc_type = pickle.loads(pickle.dumps(type(exc)))
        except Exception:
            self.exc_type = None

    def answering(self, indices, batch_index: int) -> "WorkerFailure":
        """A failure in the worker's set-up (``worker_init_fn``, loading a
        resumed state) is sent as the answer to its first task, as torch does:
        name that task's batch and samples, which the user never gets."""
        self.indices = _index_list(indices)
        self.batch_index = batch_index
        self.in_setup = True
        return self

    def message(self) -> str:
        """torch's ``ExceptionWrapper`` message, word for word ("Caught X in
        DataLoader worker process k.", or "worker thread k." for a thread
        worker, as pytorch PR 161044 words it; then "Original Traceback ..."),
        with one line of torchfeed's between them: the batch and its sample
        indices."""
        if self.worker_id < 0:  # raised in the main process's own threads
            return f"Caught {self.exc_name} in {self.where}.\nOriginal {self.traceback}"
        head = f"Caught {self.exc_name} in DataLoader worker {self.kind} {self.worker_id}."
        samples = ""
        if self.indices is not None and any(i is not None for i in self.indices):
            samples = f" (sample indices {_format_indices(self.indices)})"
        if self.batch_index is not None and self.in_setup:
            detail = (f"It was raised in {self.where}, so it could not load batch "
                      f"{self.batch_index}{samples}.")
        elif self.batch_index is not None:
            detail = f"It was raised while {self.where} batch {self.batch_index}{samples}."
        elif self.where:
            detail = f"It was raised in {self.where}."
        else:
            return f"{head}\nOriginal {self.traceback}"
        return f"{head}\n{detail}\nOriginal {self.traceback}"

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


# Python 3.11 added BaseException.add_note, whose notes the traceback prints
# under the message; 3.10 (which we support) has no such thing.
_NATIVE_NOTES = hasattr(BaseException, "add_note")


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)`` where the interpreter has it; elsewhere append the
    note to the exception's message, the only text a 3.10 traceback shows.

    The fallback makes the exception's one argument its message so far (what
    ``str(exc)`` gave) plus the note (for an OSError, its ``strerror``), so the
    traceback shows what it would have shown, with the note under it.  ``args``
    change with it, on 3.10 only.  An exception whose own ``__str__`` ignores
    both cannot carry the note; it is left as it was.
    """
    if _NATIVE_NOTES:
        exc.add_note(note)  # type: ignore[attr-defined]  # 3.11+: _NATIVE_NOTES says it is there
        return
    _append_to_message(exc, note)


def _append_to_message(exc: BaseException, note: str) -> None:
    saved = exc.args, getattr(exc, "strerror", None)
    try:
        if isinstance(exc, OSError) and exc.strerror:
            # "[Errno 28] No space left on device" is built from errno and
            # strerror, not from args.
            exc.strerror = f"{exc.strerror}\n{note}"
        else:
            shown = str(exc)
            # KeyError shows the repr of its argument: KeyErrorMessage keeps
            # the note from turning into one long quoted line.
            exc.args = (KeyErrorMessage(f"{shown}\n{note}" if shown else note),)
        if note in str(exc):
            return
    except Exception:
        pass
    exc.args = saved[0]
    if saved[1] is not None:
        exc.strerror = saved[1]  # type: ignore[attr-defined]  # it had one: an OSError's, or its own


def _as_int(index):
    try:
        return operator.index(index)
    except TypeError:
        return None


def explain_lookup_error(exc: LookupError, dataset, index, batched: bool = False) -> None:
    """Add a note naming the index and ``len(dataset)`` to an IndexError or
    KeyError raised by the dataset, when the sampler asked for an index out of
    ``range(len(dataset))``: a sampler (or batch_sampler) that yields indices
    out of range is the usual cause.  An index in range gets no note: the
    lookup that failed may be the dataset's own (a dict inside
    ``__getitem__``), which says nothing about the sampler or ``__len__``.
    The exception's type and message are kept."""
    try:
        n = len(dataset)
    except Exception:
        return
    if not isinstance(n, int):
        return
    indices = index if batched else [index]
    try:
        bad = [i for i in map(_as_int, indices) if i is not None and not -n <= i < n]
    except TypeError:  # a batch of keys that is not a sequence
        return
    if not bad:
        return
    many = f" ({len(bad)} such in this batch)" if batched else ""
    add_note(exc, f"The sampler asked for index {bad[0]}, but len(dataset) is {n}: out of "
                 f"range{many}. Check the sampler (or batch_sampler): it must yield indices "
                 f"in [0, {n}).")


_START_METHODS = ("fork", "spawn", "forkserver")  # every start method some platform has


def explain_start_method(exc: ValueError, method) -> None:
    """torch's ValueError for a ``multiprocessing_context`` this host does not
    have ('fork' on Windows), with a note naming the host and what to use; a
    name that is no start method anywhere gets torch's error alone, which says
    so already."""
    import multiprocessing

    from . import _host

    methods = multiprocessing.get_all_start_methods()
    if not isinstance(method, str) or method in methods or method not in _START_METHODS:
        return
    add_note(exc, f"torchfeed: {_host.PLATFORM} has the start methods {', '.join(methods)} "
                  f"only; '{method}' cannot be used here. Use "
                  f"multiprocessing_context='{methods[0]}' (or leave it unset: the platform's "
                  "default).")


def nested_worker_error(num_workers: int) -> AssertionError | None:
    """A loader with workers, iterated in a process that cannot have children
    (a DataLoader worker is daemonic): torch fails with multiprocessing's
    AssertionError, "daemonic processes are not allowed to have children";
    keep it, and say what to do instead."""
    import multiprocessing

    from torch.utils.data import get_worker_info

    if num_workers == 0 or not multiprocessing.current_process().daemon:
        return None
    info = get_worker_info()
    where = (f"DataLoader worker process {info.id} of another loader" if info is not None
             else "a daemonic process")
    return AssertionError(
        "daemonic processes are not allowed to have children\n"
        f"This DataLoader has num_workers={num_workers}, but it is iterated inside {where}, "
        "which cannot start processes of its own. Give the inner loader num_workers=0: it then "
        "loads in this worker, which already runs in parallel with the others.")


_HINTS_BY_SIGNAL = {  # by name: Windows has no SIGKILL or SIGBUS
    "SIGKILL": (
        "SIGKILL is almost always the kernel's out-of-memory killer. Check `dmesg` "
        "(or `journalctl -k`) for 'Out of memory: Killed process', then lower "
        "batch_size, num_workers or prefetch_factor, or make samples smaller."
    ),
    "SIGSEGV": (
        "SIGSEGV is a crash inside native code (a C extension, a corrupt file handed "
        "to a decoder, or a library that is not fork-safe). Run with num_workers=0 "
        "to get the crash in the main process, or try multiprocessing_context='spawn'."
    ),
    "SIGBUS": (
        "SIGBUS usually means shared memory ran out. Batches sent through torch's "
        "transport (transport='torch', or those that fell back with a ShmFallbackWarning) "
        "live in /dev/shm: if it is too small (Docker's default is 64 MB), start the "
        "container with --shm-size=8g. torchfeed's own memfd slots do not use /dev/shm; "
        "for them memory itself ran out. Either way, lower batch_size or prefetch_factor "
        "helps."
    ),
    "SIGABRT": (
        "SIGABRT is an abort() in native code, often a failed assertion in a C "
        "library; the worker's stderr above usually says which."
    ),
    "SIGTERM": "SIGTERM means something outside the loader asked the worker to stop.",
}
# signal.Signals keys (IntEnum, equal to the int), for the signals this host has
_SIGNAL_HINTS: dict[int, str] = {getattr(signal, name): hint for name, hint in _HINTS_BY_SIGNAL.items()
                                 if hasattr(signal, name)}
_SIGBUS = getattr(signal, "SIGBUS", None)


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


def torch_exit_sentence(pid, exitcode: int | None) -> str | None:
    """What torch's SIGCHLD handler (``_error_if_any_worker_fails``) says of a
    worker that died: a signal, or an exit code other than 0."""
    if exitcode is None or exitcode == 0:
        return None
    if exitcode > 0:
        return (f"DataLoader worker (pid {pid}) exited unexpectedly with exit code {exitcode}. "
                "Details are lost due to multiprocessing. Rerunning with num_workers=0 may give "
                "better error trace.")
    try:
        name = signal.strsignal(-exitcode) or f"Unknown signal {-exitcode}"
    except ValueError:
        name = f"Unknown signal {-exitcode}"
    sentence = f"DataLoader worker (pid {pid}) is killed by signal: {name}. "
    if -exitcode == _SIGBUS:
        sentence += ("It is possible that dataloader's workers are out of shared memory. "
                     "Please try to raise your shared memory limit.")
    return sentence


def describe_dead_worker(worker_id: int, pid: int | None, exitcode: int | None,
                         in_flight: list[tuple[int, object]], dead_pids=None) -> str:
    """The message for a worker that died without reporting an error.

    torch's words first: its iterator's sentence, "DataLoader worker (pid(s)
    P) exited unexpectedly" (``dead_pids``: every worker found dead, in worker
    order), then the sentence of its SIGCHLD handler (a signal, or an exit
    code), which torch chains as the cause.  Then torchfeed's: which worker,
    the signal's name, the batches it had in flight, and a hint."""
    pids = ", ".join(str(p) for p in (dead_pids or [pid]))
    lines = [f"DataLoader worker (pid(s) {pids}) exited unexpectedly"]
    sentence = torch_exit_sentence(pid, exitcode)
    if sentence:
        lines.append(sentence)
    lines.append(f"Worker {worker_id} (pid {pid}) {describe_exit(exitcode)}.")
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
