"""torchfeed's own loader options: their defaults, environment overrides and
validation.  torch's options are validated by torch's own constructor; these
are checked here, at construction time, so a typo fails before training starts.
"""
from __future__ import annotations

import os

from . import _host

TRANSPORTS = ("shm", "torch")
WORKER_METHODS = ("multiprocessing", "thread")  # torch's names (pytorch PR 161044)
TRANSPORT_ENV = "TORCHFEED_TRANSPORT"
LOG_EVERY_ENV = "TORCHFEED_LOG_EVERY"


def resolve_transport(transport: str | None = None, num_workers: int = 0) -> str:
    """The transport to use: ``transport``, else ``$TORCHFEED_TRANSPORT``, else
    ``"shm"`` where the host has the slots (``_host.SHM_SLOTS``: Linux) and
    ``"torch"`` elsewhere, which a loader with workers says once.  ``"shm"``
    asked for where the slots cannot exist is an error that names the host."""
    source = "transport"
    if transport is None:
        transport = os.environ.get(TRANSPORT_ENV) or None
        source = f"the {TRANSPORT_ENV} environment variable"
    if transport is None:
        if _host.SHM_SLOTS:
            return "shm"
        if num_workers:
            _host.tell_once("transport", _TORCH_HERE, stacklevel=5)
        return "torch"
    if transport not in TRANSPORTS:
        raise ValueError(
            f"{source} must be one of {', '.join(map(repr, TRANSPORTS))}, but got "
            f"{transport!r}. Use 'shm' (the default, shared-memory slots) or 'torch' "
            "(torch's own transport, for comparison and debugging).")
    if transport == "shm" and not _host.SHM_SLOTS:
        raise _host.unsupported(
            f"{source}='shm'", "its shared-memory slots need Linux's memfd_create, fallocate "
            "and MADV_REMOVE",
            "Leave it unset (batches then go through torch's transport, as with torch's "
            "DataLoader) or use 'torch'.")
    return transport


_TORCH_HERE = ("batches go through torch's own transport (transport='torch'), as with torch's "
               "DataLoader: torchfeed's shared-memory slots need Linux's memfd_create, "
               "fallocate and MADV_REMOVE. loader.transport and stats()['transport'] say "
               "'torch'; everything else (resume, errors, stats) is torchfeed's.")


def validate_options(*, seed_per_batch, snapshot_every_n_steps, share_dataset=False) -> None:
    if not isinstance(seed_per_batch, bool):
        raise TypeError(f"seed_per_batch must be True or False, but got {seed_per_batch!r}")
    if not isinstance(share_dataset, bool):
        raise TypeError(f"share_dataset must be True or False, but got {share_dataset!r}")
    # torchdata's StatefulDataLoader takes any int (0 or None: no snapshots) and
    # checks nothing; torchfeed ignores it, so only a non-number is refused.
    if snapshot_every_n_steps is not None and (
            isinstance(snapshot_every_n_steps, bool)
            or not isinstance(snapshot_every_n_steps, int)):
        raise ValueError(
            "snapshot_every_n_steps must be an int or None, but got "
            f"{snapshot_every_n_steps!r} (torchfeed ignores it: state_dict() is exact at "
            "every step)")


def validate_worker_method(worker_method) -> None:
    """``worker_method``: torch's two values.  Where the installed torch takes
    the argument its constructor has checked it already, in its own words."""
    if not isinstance(worker_method, str) or worker_method not in WORKER_METHODS:
        raise ValueError(
            f"worker_method must be one of {', '.join(map(repr, WORKER_METHODS))}, but got "
            f"{worker_method!r}. 'multiprocessing' (the default) loads in worker processes; "
            "'thread' loads in threads of this process, which suits a __getitem__ that releases "
            "the GIL (file and network reads, image decoding, numpy).")


def resolve_log_every(log_every: int | None) -> int | None:
    """Batches between stats log lines, or None for no line.

    ``None`` defers to the ``TORCHFEED_LOG_EVERY`` environment variable, where
    empty or ``0`` means off."""
    if log_every is None:
        raw = os.environ.get(LOG_EVERY_ENV, "").strip()
        if raw in ("", "0"):
            return None
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if value < 1:
            raise ValueError(
                f"the {LOG_EVERY_ENV} environment variable must be a positive number of "
                f"batches between stats log lines (or 0 for none), but got {raw!r}")
        return value
    if isinstance(log_every, bool) or not isinstance(log_every, int):
        raise TypeError(f"log_every must be a positive int or None, but got {log_every!r}")
    if log_every < 1:
        raise ValueError(
            f"log_every must be a positive number of batches between stats log lines, or None "
            f"for no log line, but got {log_every!r}")
    return log_every
def validate_max_worker_restarts(max_worker_restarts, dataset) -> None:
    """``max_worker_restarts`` (see ``_restart.py``): a non-negative int, and
    only for map-style datasets."""
    from torch.utils.data import IterableDataset

    if isinstance(max_worker_restarts, bool) or not isinstance(max_worker_restarts, int):
        raise TypeError(f"max_worker_restarts must be a non-negative int, but got "
                        f"{max_worker_restarts!r}")
    if max_worker_restarts < 0:
        raise ValueError(f"max_worker_restarts must be a non-negative int, but got "
                         f"{max_worker_restarts!r}. Use 0 (the default) for torch's behaviour: "
                         "a dead worker is an error.")
    if max_worker_restarts and not _host.HAS_POSIX_SIGNALS:
        raise _host.unsupported(
            f"max_worker_restarts={max_worker_restarts}",
            "it restarts workers killed by a signal (the OOM killer's SIGKILL, a segfault), and "
            "here a process ends with an exit code, never a signal, so a crash cannot be told "
            "from a worker that chose to exit",
            "Use max_worker_restarts=0 (torch's behaviour: a dead worker is an error).")
    if max_worker_restarts and isinstance(dataset, IterableDataset):
        raise ValueError(
            f"max_worker_restarts={max_worker_restarts} cannot be used with an IterableDataset: "
            "a restarted worker would start its stream over and deliver batches twice. Use "
            "max_worker_restarts=0, or a map-style dataset.")
