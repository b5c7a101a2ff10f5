"""``torchfeed.DataLoader``: torch's constructor, torchfeed's iterators.

The class subclasses ``torch.utils.data.DataLoader`` and lets torch's own
``__init__`` validate and store every argument, so the exception types,
messages, defaults and public attributes are torch's by construction, and
``isinstance`` checks and frameworks that rebuild a loader from its attributes
(Lightning's sampler injection, Accelerate's ``prepare``) keep working.  What
changes is the iterator behind ``iter()``.

torchfeed's own options are keyword-only and stored under their own names, so a
loader rebuilt from its attributes keeps them too.
"""
from __future__ import annotations

import inspect
import warnings
from typing import Any, TypeVar, cast

import torch.utils.data

from . import _share_job, _state
from ._device import validate_device
from ._errors import explain_start_method, nested_worker_error
from ._iterator_base import BaseIterator
from ._multiprocess import MultiProcessIterator
from ._options import (
    resolve_log_every,
    resolve_transport,
    validate_max_worker_restarts,
    validate_options,
    validate_worker_method,
)
from ._prepared import (
    accelerate_rebuilds,
    framework_snapshot,
    frameworks_warning,
    loaded,
    prepared_engine,
    read_ahead_state,
)
from ._single_process import SingleProcessIterator
from ._stats import empty_stats
from ._stats_report import LoaderStats
from ._thread_iterator import ThreadIterator
from ._torch_compat import TAKES_IN_ORDER, TAKES_WORKER_METHOD

T_co = TypeVar("T_co", covariant=True)

# ``in_order`` left out by the caller (torch's own default then applies, where the
# installed release has the argument at all).
_NOT_GIVEN: Any = object()


class DataLoader(torch.utils.data.DataLoader[T_co]):
    """A drop-in replacement for `torch.utils.data.DataLoader`.

    Takes exactly the installed torch's arguments (`dataset`, `batch_size`,
    `shuffle`, `sampler`, `batch_sampler`, `num_workers`, `collate_fn`,
    `pin_memory`, `drop_last`, `timeout`, `worker_init_fn`,
    `multiprocessing_context`, `generator`, `prefetch_factor`,
    `persistent_workers`, `pin_memory_device`, and `in_order` from torch 2.6
    on), with torch's defaults, meanings and validation: torch's own
    constructor checks and stores them, so a bad one raises torch's exception
    with torch's message. It yields the batches torch's loader yields, and adds
    `state_dict()` / `load_state_dict()` (an exact mid-epoch position) and
    `stats()`. torchfeed's own options are keyword-only and default to torch's
    behaviour (all but `transport`):

    Args:
        transport (str): how batches cross from workers to the main process.
            ``"shm"`` (default) sends whole batches through reusable
            shared-memory slots; ``"torch"`` uses torch's own path, for
            comparison and debugging.  The ``TORCHFEED_TRANSPORT`` environment
            variable sets the default.
        seed_per_batch (bool): reseed torch, ``random`` and numpy before each
            batch from ``(base seed, epoch, batch index)``, so random
            augmentations are the same for any ``num_workers`` and are restored
            exactly on resume.  Default ``False`` (torch's per-worker seeding).
        max_worker_restarts (int): how many times, over one iterator's lifetime,
            a worker killed by a signal (the OOM killer's SIGKILL, a segfault) is
            replaced by a new process that is sent the same batches again, so
            the epoch comes out as it would have without the crash.  Default
            ``0``: a dead worker is an error, as in torch.  Map-style datasets
            only; each restart warns.  See Troubleshooting, "Opt-in recovery".
        snapshot_every_n_steps (int): accepted for drop-in compatibility with
            torchdata's ``StatefulDataLoader`` and ignored: ``state_dict()`` is
            exact and cheap at every step.
        log_every (int): log one line of `stats()` (data-stall %, slowest
            worker) every ``log_every`` batches through
            ``logging.getLogger("torchfeed")`` at INFO.  Default ``None``: no
            line, unless the ``TORCHFEED_LOG_EVERY`` environment variable sets
            a number of batches.
        device (str, torch.device or int): hand batches over already on this
            CUDA device (``"cuda"``: the current device when ``iter()`` is
            called).  Each batch is copied on the loader's own stream while the
            training loop computes on the one before, and the loop's current
            stream waits for the copy on the GPU.  Default ``None``: batches
            stay on the CPU, as in torch.  See "Feeding a GPU".
        worker_method (str): torch's argument (pytorch PR 161044), on every
            release: ``"multiprocessing"`` (the default) loads in
            ``num_workers`` worker processes; ``"thread"`` in ``num_workers``
            threads of this process, each with its own ``get_worker_info()``
            (``worker_method="thread"``, and ``rng``: generators seeded from
            ``base_seed + id``, which ``torch.thread_safe_generator()``
            returns).  Batches are handed over by reference, workers start at
            once and share the loader's dataset.  The same batches, order and
            ``state_dict()`` as processes.  See "Threads or processes".
        share_dataset (bool): from construction on, in a thread (the first
            ``iter()`` that starts workers waits for it), replace the
            dataset's large attributes (a ``list``, ``tuple``, ``dict`` or
            ``defaultdict`` of 1 MiB or more, and under ``spawn`` and
            ``forkserver`` numpy arrays, on the dataset, on the plain objects
            it holds, two levels deep, and on the datasets a ``Subset`` or
            ``ConcatDataset`` wraps) by shared versions
            (`torchfeed.share`), in place, all in one memfd: the main
            process and every worker then hold one copy between them, read
            without copy-on-read under ``fork`` and sent as a handle under
            ``spawn`` and ``forkserver``.  Each read builds a fresh object; a
            write to a container raises ``TypeError``, one to an array stays
            in the process that makes it.  Done once per loader; nothing is
            shared with ``num_workers=0``, nor with ``worker_method="thread"``,
            whose workers read the dataset itself.  Default ``False``.  See
            "Sharing data".

    Raises:
        TypeError: ``seed_per_batch`` or ``share_dataset`` is not a bool;
            ``log_every`` or ``max_worker_restarts`` is not an int.  torch's
            arguments raise what torch's constructor raises.
        ValueError: ``transport`` (or ``TORCHFEED_TRANSPORT``) is neither
            ``"shm"`` nor ``"torch"``; ``log_every`` (or
            ``TORCHFEED_LOG_EVERY``) is not a positive number of batches;
            ``max_worker_restarts`` is negative, or not 0 with an
            ``IterableDataset``; ``snapshot_every_n_steps`` is not an int;
            ``device`` is neither a CUDA device nor ``"cpu"``;
            ``worker_method`` is neither ``"multiprocessing"`` nor
            ``"thread"``.

    Iterating raises what torch's iterator raises (a worker that died, a
    timeout, an exception in the dataset or ``collate_fn``), with torch's type
    and first line; Troubleshooting lists each by that line.
    """

    # One definition for every supported release.  ``in_order`` is forwarded to
    # torch's constructor only when given, so before torch 2.6 passing it is
    # torch's own TypeError, and from 2.6 torch's default applies.  The signature
    # that ``inspect`` (and frameworks rebuilding the loader) sees is the
    # installed torch's: ``_signature_like_torchs`` below drops or fills in
    # ``in_order``.
    def __init__(self, dataset, batch_size=1, shuffle=None, sampler=None, batch_sampler=None,
                 num_workers=0, collate_fn=None, pin_memory=False, drop_last=False, timeout=0,
                 worker_init_fn=None, multiprocessing_context=None, generator=None, *,
                 prefetch_factor=None, persistent_workers=False, pin_memory_device="",
                 in_order=_NOT_GIVEN, worker_method="multiprocessing", transport=None,
                 seed_per_batch=False, snapshot_every_n_steps=None, log_every=None,
                 max_worker_restarts=0, device=None, share_dataset=False):
        releases_only = {} if in_order is _NOT_GIVEN else {"in_order": in_order}
        if TAKES_WORKER_METHOD:  # torch checks it, in its own words
            releases_only["worker_method"] = worker_method
        try:
            super().__init__(
                dataset, batch_size=batch_size, shuffle=shuffle, sampler=sampler,
                batch_sampler=batch_sampler, num_workers=num_workers, collate_fn=collate_fn,
                pin_memory=pin_memory, drop_last=drop_last, timeout=timeout,
                worker_init_fn=worker_init_fn, multiprocessing_context=multiprocessing_context,
                generator=generator, prefetch_factor=prefetch_factor,
                persistent_workers=persistent_workers, pin_memory_device=pin_memory_device,
                **releases_only)
        except ValueError as exc:
            explain_start_method(exc, multiprocessing_context)
            raise
        self._set_options(dataset, transport, seed_per_batch, snapshot_every_n_steps,
                          log_every, max_worker_restarts, device, share_dataset, worker_method)

    def _set_options(self, dataset, transport, seed_per_batch, snapshot_every_n_steps,
                     log_every, max_worker_restarts, device, share_dataset,
                     worker_method) -> None:
        validate_options(seed_per_batch=seed_per_batch,
                         snapshot_every_n_steps=snapshot_every_n_steps,
                         share_dataset=share_dataset)
        validate_worker_method(worker_method)
        self.worker_method = worker_method
        if share_dataset and worker_method == "thread":
            warnings.warn(
                "share_dataset=True is not needed with worker_method='thread': worker threads "
                "read the loader's dataset itself, with no copy to share. It is accepted and "
                "does nothing here.", UserWarning, stacklevel=3)
        self.share_dataset = share_dataset
        self.transport = resolve_transport(transport, self.num_workers)
        self.seed_per_batch = seed_per_batch
        self.snapshot_every_n_steps = snapshot_every_n_steps
        validate_max_worker_restarts(max_worker_restarts, dataset)
        self.max_worker_restarts = max_worker_restarts
        self.log_every = resolve_log_every(log_every)
        validate_device(device)
        self.device = device
        _share_job.start(self)  # share_dataset=True: the pass over the data begins now, in a thread

    def __iter__(self):
        kept = self.__dict__.get("_iterator")
        if kept is not None and kept.shut_down:
            # A persistent iterator whose workers were stopped by an error (a
            # worker died, the pin thread failed) that the user caught: torch
            # would re-raise that error at every later iter(); start fresh workers.
            self._iterator = None
        with _state.starting(self):
            iterator = cast(BaseIterator, super().__iter__())  # torch's __iter__ returns our _get_iterator's
        self._stats_source = iterator.hand_over()  # the stats, not the iterator: no worker kept alive
        return iterator

    def stats(self) -> LoaderStats:
        """Statistics of the current (most recent) iterator's epoch.

        Cheap to call at any time, also after the loop and with no iterator
        yet (zero counts then).  After `torchfeed.prepare`, the statistics of
        the loader the framework runs.  Raises nothing.

        Returns:
            LoaderStats: a plain ``dict`` (batches yielded, the time the loop
                was blocked waiting for data and as a fraction, each worker's
                batches, busy fraction, start time and private memory, queue
                depths, shared-memory slots); ``str()`` of it is a readable
                summary with a verdict.  The keys are listed under
                `LoaderStats`.
        """
        engine = prepared_engine(self)  # torchfeed.prepare: the loader that runs
        if engine is not None:
            return engine.stats()
        source = getattr(self, "_stats_source", None)
        return empty_stats(self) if source is None else source.snapshot()

    def state_dict(self) -> dict:
        """Where this loader is: a small dict of plain values.

        Exact at every step and cheap (no work proportional to the dataset):
        batches prefetched but not yet yielded are not counted as consumed.
        Survives ``json`` and ``torch.save``/``torch.load(weights_only=True)``.
        After `torchfeed.prepare`, the state of the loader the framework runs.
        Warns once when the epoch cannot be resumed exactly (a sampler that
        draws from a generator no checkpoint holds), and says why.

        Returns:
            dict: the state, for `load_state_dict()` of this loader or of a
                new one over the same data (with any ``num_workers``).

        Raises:
            Exception: whatever a Stateful dataset's or dataset iterator's own
                ``state_dict()`` raised in a worker, raised here, when the state
                is asked for.

        Warning:
            With a global-RNG sampler (``shuffle=True`` and no
            ``generator``), the first epoch after a restart is exact: the rest of
            the saved epoch, or, for a state at an epoch's end or before the first
            ``iter()``, the next epoch (the state keeps the RNG it draws from).
            Later epochs draw from torch's global RNG, which your own code also
            consumes, so they match the uninterrupted run only if it does.  Pass a
            ``generator``, or save ``torch.get_rng_state()`` with the checkpoint and
            restore it on restart, to make every epoch exact.
        """
        engine = prepared_engine(self)
        if engine is not None:
            received = framework_snapshot(engine)  # Accelerate's, taken before its look-ahead
            return received if received is not None else engine.state_dict()
        user_state = read_ahead_state(self)  # a wrapper holds a batch read ahead
        if user_state is not None:
            return dict(user_state)
        frameworks_warning(self)
        return _state.state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Continue from ``state_dict`` at the next ``iter()``.

        The next ``iter()`` yields the batches after the saved position, in
        the same order and with the same values, without loading the skipped
        data.  Map-style datasets resume with any ``num_workers``.  After
        `torchfeed.prepare`, loads into the loader the framework runs.

        Args:
            state_dict (dict): a state from `state_dict()`.

        Raises:
            ValueError: the state cannot apply to this loader (another
                dataset length, batch size, ``drop_last`` or sampler; a
                position past the end of the epoch; per-worker states for
                another ``num_workers``; a corrupted dict).  The message names
                the field and both values, and the loader is left as it was.
        """
        engine = prepared_engine(self)
        if engine is not None:
            return engine.load_state_dict(state_dict)
        _state.load_state_dict(self, state_dict)
        loaded(self)

    @property
    def _is_accelerate_prepared(self) -> bool:
        # Accelerate's Accelerator.prepare_data_loader reads this (default False) just before
        # it rebuilds the loader on torch's class: the one moment torchfeed can say so without
        # touching Accelerate or what torch's attributes show.  Accelerate also sets it.
        prepared = self.__dict__.get("_is_accelerate_prepared", False)
        if not prepared:
            accelerate_rebuilds(self)
        return prepared

    @_is_accelerate_prepared.setter
    def _is_accelerate_prepared(self, value: bool) -> None:
        self.__dict__["_is_accelerate_prepared"] = value

    def _get_iterator(self):
        if self.num_workers == 0:
            return SingleProcessIterator(self)
        if getattr(self, "worker_method", "multiprocessing") == "thread":
            self.check_worker_number_rationality()
            return ThreadIterator(self)
        error = nested_worker_error(self.num_workers)
        if error is not None:
            raise error
        self.check_worker_number_rationality()
        return MultiProcessIterator(self)


def _signature_like_torchs(init) -> inspect.Signature:
    """``init``'s signature with ``in_order`` as the installed torch has it:
    default ``True`` from torch 2.6, absent before (as torch's own)."""
    signature = inspect.signature(init)
    parameters = [p.replace(default=True) if p.name == "in_order" else p
                  for p in signature.parameters.values()
                  if p.name != "in_order" or TAKES_IN_ORDER]
    return signature.replace(parameters=parameters)


DataLoader.__init__.__signature__ = _signature_like_torchs(DataLoader.__init__)  # type: ignore[attr-defined]
