"""The num_workers / prefetch_factor / worker_method tuner: ``torchfeed.tune(dataset_or_loader, ...)``.

Owns the sweep and its notes.  It times the user's own data at
``num_workers`` 0, 1, 2, ... up to the usable core count, each worker count at
a few ``prefetch_factor`` values and with both kinds of worker (processes and
threads, ``worker_method``), and recommends the cheapest setting within a
small margin of the best throughput, saying why (the rows, the result and the
rule that picks, threads or processes included, are ``_tuner_report.py``'s).  Timing goes through the
bench's :func:`~torchfeed.bench.measure.time_loader`, so a tuner figure and a
bench figure mean the same thing.  ``python -m torchfeed.tune`` is the
command-line front end (:mod:`torchfeed.tune.__main__`).
"""
from __future__ import annotations

import inspect
import traceback
from typing import Any, Sequence

import torch.utils.data
from torch.utils.data import DataLoader, IterableDataset

from ._options import WORKER_METHODS
from ._progress import Progress
from ._stats_report import START_DOMINATES
from ._torch_compat import TAKES_IN_ORDER
from ._tuner_report import TuneResult, TuneRow, pyplot, recommend, workers_text
from .bench.measure import cpu_count, load_average, time_loader
from .dataloader import DataLoader as TorchfeedDataLoader

_FEW_BATCHES = 5  # fewer batches than this in a setting's window: suggest more seconds


def _is_default_collate(fn: Any) -> bool:
    # torch picks default_collate or default_convert from the batching mode; a
    # tuned loader whose batch_size changes must get to pick again.
    return (getattr(fn, "__name__", None) in ("default_collate", "default_convert")
            and getattr(fn, "__module__", "").startswith(("torch.utils.data", "torchfeed")))


def _extra_options(dl: DataLoader) -> dict[str, Any]:
    """Constructor options that torch lacks (torchfeed's transport, say), read back.

    torchfeed stores each of its own keyword-only options under its own name,
    so reading the attribute of the same name gives back what was passed.
    """
    torch_params = set(inspect.signature(torch.utils.data.DataLoader.__init__).parameters)
    extra = {}
    for name, param in inspect.signature(type(dl).__init__).parameters.items():
        if (name not in torch_params and param.kind == param.KEYWORD_ONLY
                and hasattr(dl, name)):
            extra[name] = getattr(dl, name)
    return extra


def loader_arguments(source: Any, batch_size: int | None = None) -> tuple[type, dict[str, Any]]:
    """The loader class and keyword arguments that reproduce ``source`` at any num_workers.

    ``source`` is a Dataset (then torchfeed's DataLoader is used) or a
    DataLoader, whose dataset, batching, sampler, collate_fn, pinning,
    timeout, worker_init_fn, context, generator, persistence and the
    keyword-only options of its own class (torchfeed's ``transport``, say) are
    kept.
    ``num_workers`` and ``prefetch_factor`` are left for the caller.
    """
    if not isinstance(source, DataLoader):
        return TorchfeedDataLoader, {"dataset": source,
                                     "batch_size": 1 if batch_size is None else batch_size}
    dl = source
    kwargs: dict[str, Any] = {
        "dataset": dl.dataset,
        "pin_memory": dl.pin_memory,
        "timeout": dl.timeout,
        "worker_init_fn": dl.worker_init_fn,
        "multiprocessing_context": dl.multiprocessing_context,
        "generator": dl.generator,
        "persistent_workers": dl.persistent_workers,
        "pin_memory_device": dl.pin_memory_device,
    }
    if TAKES_IN_ORDER:  # torch 2.6 on
        kwargs["in_order"] = dl.in_order
    if not _is_default_collate(dl.collate_fn):
        kwargs["collate_fn"] = dl.collate_fn
    kwargs.update(_extra_options(dl))
    iterable = isinstance(dl.dataset, IterableDataset)
    if batch_size is not None or dl.batch_size is not None:
        if batch_size is not None and dl.batch_size is None and dl.batch_sampler is not None:
            raise ValueError("this DataLoader batches with a custom batch_sampler, so its batch "
                             "size cannot be changed; leave batch_size out to keep it")
        kwargs["batch_size"] = batch_size if batch_size is not None else dl.batch_size
        kwargs["drop_last"] = dl.drop_last
        if not iterable:
            kwargs["sampler"] = dl.sampler
    elif dl.batch_sampler is not None:
        kwargs["batch_sampler"] = dl.batch_sampler
    else:
        kwargs["batch_size"] = None
        if not iterable:
            kwargs["sampler"] = dl.sampler
    return type(dl), kwargs


def _made(made: list, loader, keep: bool):
    if keep:
        made.append(loader)
    return loader


def _worker_start(row: TuneRow, made: list, timing) -> None:
    """How long starting workers took at each epoch, from a torchfeed loader's
    stats() of its last epoch; the run may have ended while that epoch's workers
    were still starting, and then the first batch, which waited for the first
    epoch's workers, tells instead."""
    stats = getattr(made[-1], "stats", None) if made else None
    s = stats() if stats is not None else None
    if s is None or s.get("worker_start_seconds") is None:
        return
    start = s["worker_start_seconds"]
    if any(w.get("start_seconds") is None for w in s["workers"]):
        per_batch = 1.0 / timing.batches_per_s if timing.batches_per_s > 0 else 0.0
        start = max(start, timing.first_batch_s - per_batch)
    row.worker_start_s = start
    run = timing.seconds + timing.first_batch_s
    row.worker_start_fraction = min(1.0, start * timing.epochs_started / max(run, 1e-9))


def _methods(cls: type, wanted: Sequence[str]) -> list[str]:
    """The kinds of worker to measure: those asked for that ``cls`` takes (torch's
    own DataLoader takes no worker_method before a release that has thread workers)."""
    for method in wanted:
        if method not in WORKER_METHODS:
            raise ValueError(f"worker_methods must be taken from {', '.join(map(repr, WORKER_METHODS))}, "
                             f"got {method!r}")
    if not wanted:
        raise ValueError("worker_methods must name at least one kind of worker")
    takes = "worker_method" in inspect.signature(cls).parameters
    return list(dict.fromkeys(wanted)) if takes else ["multiprocessing"]


def _describe(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)[-1:]
    where = f" (at {frames[0].filename}:{frames[0].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def tune(dataset_or_loader: Any, batch_size: int | None = None, seconds: float = 2.0,
         max_workers: int | None = None, prefetch_factors: Sequence[int] = (2, 4),
         plot: str | None = None, progress: bool = True, verbose: bool = True,
         worker_methods: Sequence[str] = WORKER_METHODS) -> TuneResult:
    """Measure batches/s over num_workers, prefetch_factor and worker_method; recommend a setting.

    Times the loader at ``num_workers`` 0, 1, 2, ... up to ``max_workers``,
    each worker count at every ``prefetch_factor`` given and with each kind of
    worker in ``worker_methods``, for ``seconds`` each after its first batch,
    and recommends the cheapest setting within 5% of the best throughput,
    saying why (threads unless processes are more than 5% faster, with the
    share of ``__getitem__`` that holds the GIL).  A setting that fails is left out and
    named in the notes.  Also ``python -m torchfeed.tune MODULE:FACTORY``.

    Args:
        dataset_or_loader: a Dataset, or a DataLoader whose arguments are
            reused (only ``num_workers`` and ``prefetch_factor`` vary).
        batch_size (int): overrides the loader's; for a bare Dataset it
            defaults to torch's 1.
        seconds (float): the timed window per setting, after its first batch.
        max_workers (int): the largest ``num_workers`` tried; default: the
            usable core count.
        prefetch_factors (Sequence[int]): the ``prefetch_factor`` values tried
            with each worker count.
        plot (str): a PNG path to draw the results to (needs matplotlib:
            ``pip install 'torchfeed[plot]'``).
        progress (bool): show a progress display on stderr.
        verbose (bool): print the table and the advice.
        worker_methods (Sequence[str]): the kinds of worker to measure,
            ``"multiprocessing"`` and ``"thread"`` by default (a loader class
            without ``worker_method``, torch's own, gets processes).

    Returns:
        TuneResult: the measured rows, the recommended ``num_workers``,
            ``prefetch_factor`` and ``worker_method`` (``loader_kwargs``), the
            reason and the notes.

    Raises:
        ValueError: ``seconds`` is not positive, ``max_workers`` is negative,
            a ``prefetch_factor`` is below 1, or ``batch_size`` is given for a
            loader that batches with a custom ``batch_sampler``.
        ImportError: ``plot`` is given and matplotlib is not installed.
    """
    if seconds <= 0:
        raise ValueError(f"seconds must be positive, got {seconds}")
    if plot is not None:
        pyplot()  # fail before minutes of measuring, not after
    cores = cpu_count()
    load = load_average() or 0.0
    max_workers = cores if max_workers is None else max_workers
    if max_workers < 0:
        raise ValueError(f"max_workers must be 0 or more, got {max_workers}")
    factors = sorted({int(p) for p in prefetch_factors})
    if not factors or factors[0] < 1:
        raise ValueError(f"prefetch_factors must be at least 1, got {list(prefetch_factors)}")
    cls, base = loader_arguments(dataset_or_loader, batch_size)
    methods = _methods(cls, worker_methods)
    notes = []
    if load >= 0.5 * cores:
        # Workers need idle cores; on a busy machine the sweep measures the
        # other programs as much as the loader.
        notes.append(f"the machine was busy when the tuner started (1-min load average "
                     f"{load:.1f} on {cores} cores): worker settings are understated; "
                     "tune again on a quiet machine")
    if not isinstance(dataset_or_loader, DataLoader) and batch_size is None:
        notes.append("batch_size not given: measured with torch's default of 1")

    settings = [(0, None, None)] + [(n, p, m) for n in range(1, max_workers + 1) for p in factors
                                    for m in methods]
    rows = []
    with Progress(len(settings) + 1, "torchfeed.tune", enabled=progress) as bar:
        # A couple of untimed in-process batches first: the first run in a
        # process pays one-off costs (lazy opens, allocator growth) that would
        # otherwise all count against num_workers=0.
        bar.step("warm-up")
        try:
            time_loader(lambda: cls(**dict(base, num_workers=0, persistent_workers=False,
                                           timeout=0, multiprocessing_context=None)),
                        batches=2, restart_epochs=True)
        except Exception:
            pass  # the num_workers=0 setting below fails the same way and reports it
        for workers, factor, method in settings:
            bar.step(f"num_workers={workers}" + (f" prefetch_factor={factor}" if factor else "")
                     + (" worker_method=thread" if method == "thread" else ""))
            kwargs = dict(base, num_workers=workers)
            if len(methods) > 1 or "worker_method" in base:
                kwargs["worker_method"] = method or "multiprocessing"
            if workers == 0:
                # torch rejects these without workers; they only govern workers anyway.
                kwargs["persistent_workers"] = False
                kwargs["timeout"] = 0
                kwargs["multiprocessing_context"] = None
            else:
                kwargs["prefetch_factor"] = factor
            row = TuneRow(workers, factor, worker_method=method)
            made: list = []  # without persistent workers a loader holds no process once iterated
            keep = workers > 0 and not kwargs.get("persistent_workers")
            try:
                timing = time_loader(lambda: _made(made, cls(**kwargs), keep), seconds=seconds,
                                     restart_epochs=True)
            except Exception as exc:  # one failing setting must not hide the others
                row.error = _describe(exc)
            else:
                row.batches_per_s = timing.batches_per_s
                row.first_batch_s = timing.first_batch_s
                row.cpu_us_per_batch = timing.cpu_us_per_batch
                row.peak_mem_bytes = timing.peak_mem_bytes
                row.batches = timing.batches
                _worker_start(row, made, timing)
            made.clear()
            rows.append(row)

    pick, reason = recommend(rows, cores)
    failed = [r for r in rows if r.error]
    if failed:
        notes.append(f"{len(failed)} setting(s) failed and were left out; the first: "
                     f"num_workers={failed[0].num_workers}: {failed[0].error}")
    slow_start = [r for r in rows if (r.worker_start_fraction or 0.0) >= START_DOMINATES]
    if slow_start:
        worst = max(slow_start, key=lambda r: r.worker_start_fraction)
        notes.append(f"starting workers dominated the settings with workers (with "
                     f"{workers_text(worst.num_workers)}: {worst.worker_start_s:.2f} s at each epoch, "
                     f"{100 * worst.worker_start_fraction:.0f}% of the run), as the loader "
                     "starts them anew every epoch: pass persistent_workers=True to start them "
                     "once, and tune again")
    if any(r.error is None and r.batches < _FEW_BATCHES for r in rows):
        notes.append(f"some settings produced fewer than {_FEW_BATCHES} batches in {seconds:g} s; "
                     "raise seconds for a steadier measurement")
    result = TuneResult(rows, pick.num_workers, pick.prefetch_factor, reason, seconds,
                        base.get("batch_size"), cores, notes,
                        worker_method=pick.worker_method if len(methods) > 1 else None)
    if verbose:
        print(result, flush=True)
    if plot is not None:
        result.plot(plot)
        if verbose:
            print(f"plot written to {plot}")
    return result
