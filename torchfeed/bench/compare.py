"""The side-by-side run: each workload through torch's DataLoader, torchfeed's and the peers'.

Owns the experiment design: every loader gets the same dataset object and the
same arguments; the peer loaders (:mod:`~torchfeed.bench.loaders`) that are
installed run as more columns; torch with ``num_workers=0`` runs beside them as the baseline
that workers must beat; the runs rotate (a different loader goes first on
each repeat) so that a noisy neighbour or a warming cache hits all of them;
each figure is the median over repeats; a loader that fails is reported, not
fatal to the other rows.
"""
from __future__ import annotations

import statistics
import traceback
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from .._progress import Progress
from .loaders import BASELINE, LOADERS, PEERS, TORCH, TORCHFEED, build_loader, loader_class, peer_note
from .measure import Timing, time_loader
from .workloads import WORKLOADS, Workload

__all__ = ["BASELINE", "LOADERS", "METRICS", "PEERS", "TORCH", "TORCHFEED", "BenchConfig",
           "LoaderFigures", "WorkloadResult", "describe_error", "loader_class",
           "run_comparison"]

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
    """One loader on one workload: every run, and the median of each metric.

    The first-batch figure also takes ``first_batches``: runs that stop at the
    first batch. One per timed run is too few on a shared machine, where a
    single slow worker start moves the median of three."""

    runs: list[Timing] = field(default_factory=list)
    first_batches: list[float] = field(default_factory=list)
    error: str | None = None

    def median(self, metric: str) -> float | None:
        if not self.runs:
            return None
        values = [getattr(r, metric) for r in self.runs]
        if metric == "first_batch_s":
            values += self.first_batches
        return statistics.median(values)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {m: self.median(m) for m in METRICS}
        data["runs"] = [r.to_dict() for r in self.runs]
        data["first_batch_only_s"] = list(self.first_batches)
        data["leftover_processes"] = max((r.leftover_processes for r in self.runs), default=0)
        data["error"] = self.error
        return data


@dataclass
class WorkloadResult:
    workload: Workload
    batches: int
    figures: dict[str, LoaderFigures]

    def ratio(self, metric: str, ours: str = TORCHFEED, versus: str = TORCH) -> float | None:
        """``ours`` / ``versus`` for ``metric``, or None when either side has no figure."""
        if ours not in self.figures or versus not in self.figures:
            return None
        mine = self.figures[ours].median(metric)
        theirs = self.figures[versus].median(metric)
        if mine is None or theirs is None or theirs == 0:
            return None
        return mine / theirs

    def to_dict(self) -> dict[str, Any]:
        data = {
            "workload": self.workload.name,
            "description": self.workload.description,
            "batch_size": self.workload.batch_size,
            "batches": self.batches,
            **{name: figures.to_dict() for name, figures in self.figures.items()},
            "ratio": {m: self.ratio(m) for m in METRICS},
        }
        peers = [name for name in self.figures if name in PEERS]
        if peers:
            data["ratio_vs_peers"] = {
                peer: {m: self.ratio(m, TORCHFEED, peer) for m in METRICS} for peer in peers}
        if BASELINE in self.figures:
            data["batches_per_s_vs_num_workers_0"] = {
                name: self.ratio("batches_per_s", name, BASELINE)
                for name in self.figures if name != BASELINE}
        return data


@dataclass
class BenchConfig:
    workloads: Sequence[str]
    num_workers: int = 2
    batches: int | None = None  # None: each workload's own default
    repeats: int = 3
    transport: str | None = None
    progress: bool = True
    quick: bool = False  # a tenth of each workload's default batches
    baseline: bool = True  # also time torch at num_workers=0 (when num_workers > 0)
    first_batch_runs: int = 6  # more runs of each compared loader that stop at the first batch
    peers: Sequence[str] = ()  # peer columns to add where installed (names in PEERS)
    # torch.set_num_threads() for the run: with num_workers=0 the collate runs in
    # this process, and on a busy machine torch's spinning intra-op threads slowed
    # torch@0's image batches over 20-fold (None: torch's own choice).
    torch_threads: int | None = None

    def compared(self) -> tuple[str, ...]:
        """torch, torchfeed and the peers that can run here: the loaders compared
        at the bench's ``num_workers``."""
        return LOADERS + tuple(p for p in self.peers if peer_note(p, self.num_workers) is None)

    def loaders(self) -> tuple[str, ...]:
        if self.baseline and self.num_workers > 0:
            return self.compared() + (BASELINE,)
        return self.compared()

    def workloads_to_run(self) -> list[str]:
        return [w for w in self.workloads if WORKLOADS[w].skip_note() is None]

    def notes(self) -> list[str]:
        """One line per peer column and per workload that this run skips, and why."""
        notes = [note for p in self.peers if (note := peer_note(p, self.num_workers))]
        return notes + [note for w in self.workloads if (note := WORKLOADS[w].skip_note())]

    def loader_kwargs(self, name: str, workload: Workload) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"batch_size": workload.batch_size,
                                  "num_workers": 0 if name == BASELINE else self.num_workers}
        if workload.collate_fn is not None:
            kwargs["collate_fn"] = workload.collate_fn
        # Only when asked: an unknown keyword must not reach a loader that lacks it.
        if name == TORCHFEED and self.transport is not None:
            kwargs["transport"] = self.transport
        return kwargs

    def batches_for(self, workload: Workload) -> int:
        if self.batches is not None:
            return self.batches
        return max(3, workload.batches // 10) if self.quick else workload.batches


def describe_error(exc: BaseException) -> str:
    last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f" (at {last[0].filename}:{last[0].lineno})" if last else ""
    return f"{type(exc).__name__}: {exc}{where}"


def run_comparison(config: BenchConfig) -> list[WorkloadResult]:
    """Run every workload through every loader ``config.repeats`` times each.

    Workloads and peers whose packages are missing are left out;
    ``config.notes()`` says which."""
    unknown = [w for w in config.workloads if w not in WORKLOADS]
    unknown += [p for p in config.peers if p not in PEERS]
    if unknown:
        raise ValueError(f"unknown workload(s) or peer(s) {', '.join(unknown)}; "
                         f"choose from {', '.join(WORKLOADS)} and {', '.join(PEERS)}")
    results = []
    workloads = config.workloads_to_run()
    steps = len(workloads) * ((config.repeats + 1) * len(config.loaders())
                              + config.first_batch_runs * len(config.compared()))
    threads = torch.get_num_threads()
    if config.torch_threads is not None:
        torch.set_num_threads(config.torch_threads)
    try:
        with Progress(steps, "torchfeed.bench", enabled=config.progress) as bar:
            for name in workloads:
                results.append(_run_workload(WORKLOADS[name], config, bar))
    finally:
        torch.set_num_threads(threads)
    return results


def _time(name: str, config: BenchConfig, workload: Workload, dataset, batches: int) -> Timing:
    """One run of loader ``name`` on ``dataset``: its first batch, then ``batches`` more."""
    kwargs = config.loader_kwargs(name, workload)
    return time_loader(lambda: build_loader(name, dataset, kwargs), batches=batches)


def _time_unless_failed(figures: LoaderFigures, name: str, config: BenchConfig,
                        workload: Workload, dataset, batches: int) -> Timing | None:
    """``_time``, or None once the loader has failed: its first error is kept for
    the table (the other rows go on), and failing again says nothing new."""
    if figures.error is not None:
        return None
    try:
        return _time(name, config, workload, dataset, batches)
    except Exception as exc:
        figures.error = describe_error(exc)
        return None


def _run_workload(workload: Workload, config: BenchConfig, bar: Progress) -> WorkloadResult:
    batches = config.batches_for(workload)
    # Room for the first batch, the timed ones and everything still in flight
    # when the run stops: the run ends mid-epoch, as a training step does.
    in_flight = 4 * max(1, config.num_workers)
    dataset = workload.dataset((batches + 1 + in_flight) * workload.batch_size)
    loaders = config.loaders()
    figures = {name: LoaderFigures() for name in loaders}
    # An untimed short run of each loader first: the first run in a process
    # pays one-off costs (allocator growth, lazy imports, the dataset's pages)
    # that would otherwise land on whichever loader happens to go first.
    for name in loaders:
        bar.step(f"{workload.name} {name} warm-up")
        try:
            _time(name, config, workload, dataset, min(3, batches))
        except Exception:
            pass  # the timed runs below fail the same way and report it
    for repeat in range(config.repeats):
        # Each loader goes first on its share of the repeats.
        shift = repeat % len(loaders)
        order = loaders[shift:] + loaders[:shift]
        for name in order:
            bar.step(f"{workload.name} {name} run {repeat + 1}/{config.repeats}")
            timing = _time_unless_failed(figures[name], name, config, workload, dataset, batches)
            if timing is not None:
                figures[name].runs.append(timing)
    compared = config.compared()
    for run in range(config.first_batch_runs):
        shift = run % len(compared)
        for name in compared[shift:] + compared[:shift]:
            bar.step(f"{workload.name} {name} first batch {run + 1}/{config.first_batch_runs}")
            timing = _time_unless_failed(figures[name], name, config, workload, dataset, 0)
            if timing is not None:
                figures[name].first_batches.append(timing.first_batch_s)
    return WorkloadResult(workload, batches, figures)
