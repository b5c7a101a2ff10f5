"""The side-by-side run: each workload through torch's DataLoader and torchfeed's.

Owns the experiment design: both loaders get the same dataset object and the
same arguments; their runs alternate (torch first on even repeats, torchfeed
first on odd ones) so that a noisy neighbour or a warming cache hits both;
each figure is the median over repeats; a loader that fails is reported, not
fatal to the other rows.
"""
from __future__ import annotations

import statistics
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch.utils.data

from .._progress import Progress
from .measure import Timing, time_loader
from .workloads import WORKLOADS, Workload

TORCH = "torch"
TORCHFEED = "torchfeed"
LOADERS = (TORCH, TORCHFEED)

# The figures that get a median and a ratio, with the direction that is better.
METRICS: dict[str, str] = {
    "batches_per_s": "higher",
    "first_batch_s": "lower",
    "cpu_us_per_batch": "lower",
    "peak_mem_bytes": "lower",
    "peak_rss_bytes": "lower",
    "peak_shm_bytes": "lower",
}


@dataclass
class LoaderFigures:
    """One loader on one workload: every run, and the median of each metric."""

    runs: list[Timing] = field(default_factory=list)
    error: str | None = None

    def median(self, metric: str) -> float | None:
        if not self.runs:
            return None
        return statistics.median(getattr(r, metric) for r in self.runs)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {m: self.median(m) for m in METRICS}
        data["runs"] = [r.to_dict() for r in self.runs]
        data["leftover_processes"] = max((r.leftover_processes for r in self.runs), default=0)
        data["error"] = self.error
        return data


@dataclass
class WorkloadResult:
    workload: Workload
    batches: int
    figures: dict[str, LoaderFigures]

    def ratio(self, metric: str) -> float | None:
        """torchfeed / torch for ``metric``, or None when either side has no figure."""
        ours = self.figures[TORCHFEED].median(metric)
        theirs = self.figures[TORCH].median(metric)
        if ours is None or theirs is None or theirs == 0:
            return None
        return ours / theirs

    def to_dict(self) -> dict[str, Any]:
        return {
            "workload": self.workload.name,
            "description": self.workload.description,
            "batch_size": self.workload.batch_size,
            "batches": self.batches,
            TORCH: self.figures[TORCH].to_dict(),
            TORCHFEED: self.figures[TORCHFEED].to_dict(),
            "ratio": {m: self.ratio(m) for m in METRICS},
        }


@dataclass
class BenchConfig:
    workloads: Sequence[str]
    num_workers: int = 2
    batches: int | None = None  # None: each workload's own default
    repeats: int = 3
    transport: str | None = None
    progress: bool = True
    quick: bool = False  # a tenth of each workload's default batches

    def loader_kwargs(self, name: str, workload: Workload) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"batch_size": workload.batch_size,
                                  "num_workers": self.num_workers}
        # Only when asked: an unknown keyword must not reach a loader that lacks it.
        if name == TORCHFEED and self.transport is not None:
            kwargs["transport"] = self.transport
        return kwargs

    def batches_for(self, workload: Workload) -> int:
        if self.batches is not None:
            return self.batches
        return max(3, workload.batches // 10) if self.quick else workload.batches


def loader_class(name: str) -> Callable[..., Any]:
    if name == TORCH:
        return torch.utils.data.DataLoader
    import torchfeed  # late: a broken torchfeed must not stop torch's rows

    return torchfeed.DataLoader


def describe_error(exc: BaseException) -> str:
    last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f" (at {last[0].filename}:{last[0].lineno})" if last else ""
    return f"{type(exc).__name__}: {exc}{where}"


def run_comparison(config: BenchConfig) -> list[WorkloadResult]:
    """Run every workload through both loaders ``config.repeats`` times each."""
    unknown = [w for w in config.workloads if w not in WORKLOADS]
    if unknown:
        raise ValueError(f"unknown workload(s) {', '.join(unknown)}; "
                         f"choose from {', '.join(WORKLOADS)}")
    results = []
    steps = len(config.workloads) * (config.repeats + 1) * len(LOADERS)
    with Progress(steps, "torchfeed.bench", enabled=config.progress) as bar:
        for name in config.workloads:
            results.append(_run_workload(WORKLOADS[name], config, bar))
    return results


def _run_workload(workload: Workload, config: BenchConfig, bar: Progress) -> WorkloadResult:
    batches = config.batches_for(workload)
    # Room for the first batch, the timed ones and everything still in flight
    # when the run stops: the run ends mid-epoch, as a training step does.
    in_flight = 4 * max(1, config.num_workers)
    dataset = workload.dataset((batches + 1 + in_flight) * workload.batch_size)
    figures = {name: LoaderFigures() for name in LOADERS}
    # An untimed short run of each loader first: the first run in a process
    # pays one-off costs (allocator growth, lazy imports, the dataset's pages)
    # that would otherwise land on whichever loader happens to go first.
    for name in LOADERS:
        bar.step(f"{workload.name} {name} warm-up")
        try:
            cls = loader_class(name)
            kwargs = config.loader_kwargs(name, workload)
            time_loader(lambda: cls(dataset, **kwargs), batches=min(3, batches))
        except Exception:
            pass  # the timed runs below fail the same way and report it
    for repeat in range(config.repeats):
        order = LOADERS if repeat % 2 == 0 else LOADERS[::-1]
        for name in order:
            bar.step(f"{workload.name} {name} run {repeat + 1}/{config.repeats}")
            if figures[name].error is not None:
                continue  # it failed once; failing again says nothing new
            try:
                cls = loader_class(name)
                kwargs = config.loader_kwargs(name, workload)
                timing = time_loader(lambda: cls(dataset, **kwargs), batches=batches)
            except Exception as exc:  # reported in the table, the other rows go on
                figures[name].error = describe_error(exc)
                continue
            figures[name].runs.append(timing)
    return WorkloadResult(workload, batches, figures)
