"""A num_workers sweep of both loaders, against torch's in-process loading.

Owns the experiment behind ``benchmarks/loader_throughput.py``: every workload
through each chosen loader at each chosen ``num_workers``, runs alternating
between loaders, medians over repeats.  Each row is also compared with torch
at ``num_workers=0``, the baseline a user gives up by turning workers on
(on a small machine torch's workers often lose to it on light workloads).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Sequence

from .._progress import Progress
from .compare import LOADERS, TORCH, describe_error, loader_class
from .measure import Timing, time_loader
from .workloads import WORKLOADS, Workload


@dataclass
class SweepRow:
    workload: str
    loader: str
    num_workers: int
    runs: list[Timing] = field(default_factory=list)
    error: str | None = None

    def median(self, metric: str) -> float | None:
        return statistics.median(getattr(r, metric) for r in self.runs) if self.runs else None

    def to_dict(self) -> dict[str, Any]:
        return {"workload": self.workload, "loader": self.loader,
                "num_workers": self.num_workers, "error": self.error,
                "batches_per_s": self.median("batches_per_s"),
                "first_batch_s": self.median("first_batch_s"),
                "cpu_us_per_batch": self.median("cpu_us_per_batch"),
                "peak_mem_bytes": self.median("peak_mem_bytes"),
                "runs": [r.to_dict() for r in self.runs]}


def _kwargs(workload: Workload, loader: str, workers: int,
            transport: str | None) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"batch_size": workload.batch_size, "num_workers": workers}
    if workload.collate_fn is not None:
        kwargs["collate_fn"] = workload.collate_fn
    if loader != TORCH and transport is not None:
        kwargs["transport"] = transport  # only torchfeed has it, and only when asked
    return kwargs


def run_sweep(workloads: Sequence[str], loaders: Sequence[str] = LOADERS,
              num_workers: Sequence[int] = (0, 1, 2), batches: int | None = None,
              repeats: int = 3, transport: str | None = None,
              progress: bool = True) -> list[SweepRow]:
    """Time each (workload, num_workers, loader); ``batches`` None means each workload's own."""
    for name in workloads:
        if name not in WORKLOADS:
            raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
        note = WORKLOADS[name].skip_note()
        if note is not None:
            raise ValueError(note)
    for name in loaders:
        if name not in LOADERS:
            raise ValueError(f"unknown loader {name!r}; choose from {', '.join(LOADERS)}")
    # The baseline column needs torch in-process even when not asked for.
    baseline = [] if (TORCH in loaders and 0 in num_workers) else [(TORCH, 0)]
    cells = baseline + [(loader, n) for n in num_workers for loader in loaders]
    rows: list[SweepRow] = []
    loaders_used = sorted({loader for loader, _ in cells})
    steps = len(workloads) * (repeats * len(cells) + len(loaders_used))
    with Progress(steps, "loader_throughput", enabled=progress) as bar:
        for name in workloads:
            workload = WORKLOADS[name]
            count = batches if batches is not None else workload.batches
            in_flight = 4 * max([1, *num_workers])
            dataset = workload.dataset((count + 1 + in_flight) * workload.batch_size)
            mine = {cell: SweepRow(name, *cell) for cell in cells}
            # Untimed, so that one-off first-run costs land on no cell (see compare.py).
            for loader in loaders_used:
                bar.step(f"{name} {loader} warm-up")
                try:
                    time_loader(lambda: loader_class(loader)(
                        dataset, **_kwargs(workload, loader, max(num_workers), transport)),
                        batches=min(3, count))
                except Exception:
                    pass  # the timed cells report it
            for repeat in range(repeats):
                # Reversed on odd repeats, so that drift over a run hits every cell alike.
                for cell in (cells if repeat % 2 == 0 else cells[::-1]):
                    loader, workers = cell
                    bar.step(f"{name} {loader} num_workers={workers} run {repeat + 1}/{repeats}")
                    row = mine[cell]
                    if row.error is not None:
                        continue
                    kwargs = _kwargs(workload, loader, workers, transport)
                    try:
                        cls = loader_class(loader)
                        row.runs.append(time_loader(lambda: cls(dataset, **kwargs),
                                                    batches=count))
                    except Exception as exc:  # reported in its row; the sweep goes on
                        row.error = describe_error(exc)
            rows += list(mine.values())
    return rows


def format_sweep(rows: Sequence[SweepRow]) -> str:
    """One line per (workload, loader, num_workers), with the ratio to torch in-process."""
    base = {r.workload: r.median("batches_per_s") for r in rows
            if r.loader == TORCH and r.num_workers == 0}
    header = ["workload", "loader", "num_workers", "batches/s", "vs torch nw=0",
              "first batch ms", "main CPU us/batch", "peak MiB"]
    body = []
    for r in sorted(rows, key=lambda r: (list(WORKLOADS).index(r.workload), r.loader,
                                         r.num_workers)):
        if r.error or not r.runs:
            body.append([r.workload, r.loader, str(r.num_workers), "error", "-", "-", "-", "-"])
            continue
        rate = r.median("batches_per_s")
        ref = base.get(r.workload)
        body.append([r.workload, r.loader, str(r.num_workers), f"{rate:.1f}",
                     f"{rate / ref:.2f}x" if ref else "-",
                     f"{r.median('first_batch_s') * 1e3:.0f}",
                     f"{r.median('cpu_us_per_batch'):.0f}",
                     f"{r.median('peak_mem_bytes') / (1 << 20):.0f}"])
    widths = [max(len(row[i]) for row in [header] + body) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(row, widths))).rstrip()
             for row in [header] + body]
    lines.insert(1, "-" * len(lines[0]))
    lines += [f"error: {r.loader} num_workers={r.num_workers} on {r.workload}: {r.error}"
              for r in rows if r.error]
    return "\n".join(lines)
