"""The num_workers / prefetch_factor tuner: ``torchfeed.tune(dataset_or_loader, ...)``.

Owns the sweep and the advice.  It times the user's own data at
``num_workers`` 0, 1, 2, ... up to the usable core count, each worker count at
a few ``prefetch_factor`` values, and recommends the cheapest setting within a
small margin of the best throughput, saying why.  Timing goes through the
bench's :func:`~torchfeed.bench.measure.time_loader`, so a tuner figure and a
bench figure mean the same thing.  ``python -m torchfeed.tune`` is the
command-line front end (:mod:`torchfeed.tune.__main__`).
"""
from __future__ import annotations

import inspect
import os
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import torch.utils.data
from torch.utils.data import DataLoader, IterableDataset

from ._progress import Progress
from ._stats_report import START_DOMINATES
from .bench.measure import cpu_count, time_loader

# Within this fraction of the best, fewer workers (less memory, fewer
# processes competing with the training loop) win.  Run-to-run noise on a
# quiet machine is a few percent.
TOLERANCE = 0.05
_FEW_BATCHES = 5
_PLOT_INSTALL = "pip install 'torchfeed[plot]'   (or: pip install matplotlib)"


@dataclass
class TuneRow:
    """One measured setting."""

    num_workers: int
    prefetch_factor: int | None
    batches_per_s: float | None = None
    first_batch_s: float | None = None
    cpu_us_per_batch: float | None = None
    peak_mem_bytes: int | None = None
    batches: int = 0
    error: str | None = None
    # Workers started anew at each epoch: seconds one start took (the last
    # epoch's, from stats()), and the share of the run that all starts took.
    worker_start_s: float | None = None
    worker_start_fraction: float | None = None


@dataclass
class TuneResult:
    """The measured settings, the recommended one and the reason for it."""

    rows: list[TuneRow]
    num_workers: int
    prefetch_factor: int | None
    reason: str
    seconds: float
    batch_size: int | None
    cores: int
    notes: list[str] = field(default_factory=list)

    @property
    def loader_kwargs(self) -> dict[str, Any]:
        """The recommendation as DataLoader keyword arguments."""
        kwargs: dict[str, Any] = {"num_workers": self.num_workers}
        if self.num_workers > 0:
            kwargs["prefetch_factor"] = self.prefetch_factor
        return kwargs

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["loader_kwargs"] = self.loader_kwargs
        return data

    def table(self) -> str:
        header = ["num_workers", "prefetch_factor", "batches/s", "vs best",
                  "first batch ms", "main CPU us/batch", "peak MiB", "batches", ""]
        best = max((r.batches_per_s or 0.0 for r in self.rows), default=0.0)
        body = []
        for r in self.rows:
            picked = (r.num_workers, r.prefetch_factor) == (self.num_workers, self.prefetch_factor)
            if r.error:
                cells = ["error"] + [""] * 5 + [r.error.splitlines()[0][:60]]
            else:
                cells = [f"{r.batches_per_s:.1f}",
                         f"{r.batches_per_s / best:.2f}x" if best else "-",
                         f"{r.first_batch_s * 1e3:.0f}", f"{r.cpu_us_per_batch:.0f}",
                         f"{(r.peak_mem_bytes or 0) / (1 << 20):.0f}", str(r.batches),
                         "<- recommended" if picked else ""]
            body.append([str(r.num_workers), "-" if r.prefetch_factor is None
                         else str(r.prefetch_factor)] + cells)
        widths = [max(len(row[i]) for row in [header] + body) for i in range(len(header))]
        lines = ["  ".join(c.rjust(w) if i < len(header) - 1 else c
                           for i, (c, w) in enumerate(zip(row, widths))).rstrip()
                 for row in [header] + body]
        lines.insert(1, "-" * len(lines[0]))
        return "\n".join(lines)

    def __str__(self) -> str:
        batch = "" if self.batch_size is None else f", batch_size={self.batch_size}"
        lines = [f"torchfeed.tune: {self.seconds:g} s per setting{batch}, "
                 f"{self.cores} usable cores", "", self.table(), "",
                 "recommended: " + ", ".join(f"{k}={v}" for k, v in self.loader_kwargs.items()),
                 f"why: {self.reason}"]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def plot(self, path: str) -> None:
        """Write batches/s against num_workers, one line per prefetch_factor, to ``path``."""
        plt = _pyplot()
        fig, ax = plt.subplots(figsize=(7, 4.5))
        ok = [r for r in self.rows if r.error is None]
        zero = [r for r in ok if r.num_workers == 0]
        for pf in sorted({r.prefetch_factor for r in ok if r.prefetch_factor is not None}):
            line = zero + [r for r in ok if r.prefetch_factor == pf]
            ax.plot([r.num_workers for r in line], [r.batches_per_s for r in line],
                    marker="o", label=f"prefetch_factor={pf}")
        if not any(r.num_workers for r in ok):
            ax.plot([r.num_workers for r in zero], [r.batches_per_s for r in zero], marker="o")
        picked = [r for r in ok if (r.num_workers, r.prefetch_factor)
                  == (self.num_workers, self.prefetch_factor)]
        ax.plot([r.num_workers for r in picked], [r.batches_per_s for r in picked], marker="*",
                markersize=16, linestyle="none", color="black", label="recommended")
        ax.set_xlabel("num_workers")
        ax.set_ylabel("batches/s")
        ax.set_xticks(sorted({r.num_workers for r in self.rows}))
        ax.set_ylim(bottom=0)
        ax.set_title(f"torchfeed.tune ({self.seconds:g} s per setting, {self.cores} cores)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ImportError("plotting needs matplotlib, an optional extra of torchfeed. "
                          f"Install it with: {_PLOT_INSTALL}") from None
    matplotlib.use("Agg")  # files only; never open a window or need a display
    import matplotlib.pyplot as plt

    return plt


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
        import torchfeed

        return torchfeed.DataLoader, {"dataset": source,
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
        "in_order": getattr(dl, "in_order", True),
    }
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


def _workers(n: int) -> str:
    return f"{n} worker{'' if n == 1 else 's'}"


def _describe(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)[-1:]
    where = f" (at {frames[0].filename}:{frames[0].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def recommend(rows: Sequence[TuneRow], cores: int,
              tolerance: float = TOLERANCE) -> tuple[TuneRow, str]:
    """The cheapest setting within ``tolerance`` of the best, and why."""
    ok = [r for r in rows if r.error is None and r.batches_per_s]
    if not ok:
        errors = "; ".join(f"num_workers={r.num_workers}: {r.error}" for r in rows if r.error)
        raise RuntimeError(f"no setting produced a batch: {errors or 'no batches'}")
    best = max(ok, key=lambda r: r.batches_per_s)
    floor = best.batches_per_s * (1 - tolerance)
    pick = min((r for r in ok if r.batches_per_s >= floor),
               key=lambda r: (r.num_workers, r.prefetch_factor or 0))
    by_workers: dict[int, TuneRow] = {}
    for r in ok:
        known = by_workers.get(r.num_workers)
        if known is None or r.batches_per_s > known.batches_per_s:
            by_workers[r.num_workers] = r
    margin = f"{tolerance:.0%}"

    def versus(r: TuneRow) -> str:
        change = r.batches_per_s / pick.batches_per_s - 1
        if change > 0:
            return f"is only {change:.0%} faster, within the {margin} margin"
        return f"is {-change:.0%} slower"

    more = [by_workers[n] for n in sorted(by_workers) if n > pick.num_workers]
    if pick.num_workers == 0:
        if more:
            top = max(more, key=lambda r: r.batches_per_s)
            reason = (f"num_workers=0 ({pick.batches_per_s:.1f} batches/s) is as fast as any "
                      f"worker count: the best with workers ({_workers(top.num_workers)}) "
                      f"{versus(top)}. Loading a batch in-process costs less than moving it "
                      "from a worker")
        elif any(r.num_workers for r in rows):
            reason = "num_workers=0 was the only setting that worked"
        else:
            reason = "num_workers=0 was the only setting tried"
    elif not more:
        if pick.num_workers >= cores:
            advice = ("all usable cores): loading is CPU-bound, so more cores or cheaper "
                      "samples would help")
        else:
            advice = "the most tried): try a larger max_workers"
        reason = f"throughput still grows up to {_workers(pick.num_workers)} ({advice}"
    else:
        nxt = more[0]
        verb = "drops" if nxt.batches_per_s < pick.batches_per_s else "stops growing"
        reason = (f"throughput {verb} after {_workers(pick.num_workers)}: with "
                  f"{_workers(nxt.num_workers)} it {versus(nxt)}")
    zero = by_workers.get(0)
    if zero is not None and pick.num_workers > 0:
        speedup = pick.batches_per_s / zero.batches_per_s
        reason += f"; {speedup:.1f}x the throughput of num_workers=0"
    if pick.num_workers > 0:
        others = [r for r in ok if r.num_workers == pick.num_workers and r is not pick]
        if others:
            top = max(others, key=lambda r: r.batches_per_s)
            reason += (f". prefetch_factor={pick.prefetch_factor}, as "
                       f"prefetch_factor={top.prefetch_factor} {versus(top)}")
    return pick, reason + "."


def tune(dataset_or_loader: Any, batch_size: int | None = None, seconds: float = 2.0,
         max_workers: int | None = None, prefetch_factors: Sequence[int] = (2, 4),
         plot: str | None = None, progress: bool = True, verbose: bool = True) -> TuneResult:
    """Measure batches/s over num_workers and prefetch_factor; recommend a setting.

    ``dataset_or_loader``: a Dataset, or a DataLoader whose arguments are
    reused (only num_workers and prefetch_factor vary).  ``batch_size``
    overrides the loader's; for a bare Dataset it defaults to torch's 1.
    ``seconds`` is the timed window per setting, after its first batch.
    ``max_workers`` defaults to the usable core count.  ``plot`` is a PNG path
    (needs matplotlib: ``pip install 'torchfeed[plot]'``).  ``progress`` shows a
    progress display on stderr; ``verbose`` prints the table and advice.
    """
    if seconds <= 0:
        raise ValueError(f"seconds must be positive, got {seconds}")
    if plot is not None:
        _pyplot()  # fail before minutes of measuring, not after
    cores = cpu_count()
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = 0.0
    max_workers = cores if max_workers is None else max_workers
    if max_workers < 0:
        raise ValueError(f"max_workers must be 0 or more, got {max_workers}")
    factors = sorted({int(p) for p in prefetch_factors})
    if not factors or factors[0] < 1:
        raise ValueError(f"prefetch_factors must be at least 1, got {list(prefetch_factors)}")
    cls, base = loader_arguments(dataset_or_loader, batch_size)
    notes = []
    if load >= 0.5 * cores:
        # Workers need idle cores; on a busy machine the sweep measures the
        # other programs as much as the loader.
        notes.append(f"the machine was busy when the tuner started (1-min load average "
                     f"{load:.1f} on {cores} cores): worker settings are understated; "
                     "tune again on a quiet machine")
    if not isinstance(dataset_or_loader, DataLoader) and batch_size is None:
        notes.append("batch_size not given: measured with torch's default of 1")

    settings = [(0, None)] + [(n, p) for n in range(1, max_workers + 1) for p in factors]
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
        for workers, factor in settings:
            bar.step(f"num_workers={workers}" + (f" prefetch_factor={factor}" if factor else ""))
            kwargs = dict(base, num_workers=workers)
            if workers == 0:
                # torch rejects these without workers; they only govern workers anyway.
                kwargs["persistent_workers"] = False
                kwargs["timeout"] = 0
                kwargs["multiprocessing_context"] = None
            else:
                kwargs["prefetch_factor"] = factor
            row = TuneRow(workers, factor)
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
                     f"{_workers(worst.num_workers)}: {worst.worker_start_s:.2f} s at each epoch, "
                     f"{100 * worst.worker_start_fraction:.0f}% of the run), as the loader "
                     "starts them anew every epoch: pass persistent_workers=True to start them "
                     "once, and tune again")
    if any(r.error is None and r.batches < _FEW_BATCHES for r in rows):
        notes.append(f"some settings produced fewer than {_FEW_BATCHES} batches in {seconds:g} s; "
                     "raise seconds for a steadier measurement")
    result = TuneResult(rows, pick.num_workers, pick.prefetch_factor, reason, seconds,
                        base.get("batch_size"), cores, notes)
    if verbose:
        print(result, flush=True)
    if plot is not None:
        result.plot(plot)
        if verbose:
            print(f"plot written to {plot}")
    return result
