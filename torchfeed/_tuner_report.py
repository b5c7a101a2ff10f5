"""What the tuner found, and what it recommends: ``TuneResult`` and ``recommend``.

``_tuner.py`` measures; this module holds the measured rows (``TuneRow``), the
result that ``torchfeed.tune`` returns (its table, its ``str()``, its plot and
the recommended loader arguments), and the rule that picks the recommended
setting and says why: the cheapest setting within ``TOLERANCE`` of the best
throughput.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

# Within this fraction of the best, fewer workers (less memory, fewer
# processes competing with the training loop) win.  Run-to-run noise on a
# quiet machine is a few percent.
TOLERANCE = 0.05
_PLOT_INSTALL = "pip install 'torchfeed[plot]'   (or: pip install matplotlib)"


@dataclass
class TuneRow:
    """One measured setting of `torchfeed.tune`.

    Attributes:
        num_workers (int): the setting's ``num_workers``.
        prefetch_factor (int | None): its ``prefetch_factor`` (``None`` at 0 workers).
        batches_per_s (float | None): the throughput; ``None`` if it failed.
        first_batch_s (float | None): seconds from ``iter()`` to the first batch.
        cpu_us_per_batch (float | None): the main process's CPU per batch, in µs.
        peak_mem_bytes (int | None): the peak memory of the main process and its workers.
        batches (int): batches timed.
        error (str | None): why the setting failed, if it did.
        worker_start_s (float | None): seconds one start of the workers took.
        worker_start_fraction (float | None): the share of the run spent starting workers.
    """

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
    """What `torchfeed.tune` returns: the measured settings, the recommended one and why.

    ``str()`` of it is the table and the advice the tuner prints.

    Attributes:
        rows (list[TuneRow]): one per setting measured.
        num_workers (int): the recommended ``num_workers``.
        prefetch_factor (int | None): the recommended ``prefetch_factor``.
        reason (str): why that setting.
        seconds (float): the timed window per setting.
        batch_size (int | None): the batch size measured.
        cores (int): the usable cores.
        notes (list[str]): what may make the figures less reliable (a busy
            machine, failed settings, few batches, slow worker start).
    """

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
        """Everything above as plain values (what ``--json`` writes), with ``loader_kwargs``."""
        data = asdict(self)
        data["loader_kwargs"] = self.loader_kwargs
        return data

    def table(self) -> str:
        """The measured rows as a text table, the recommended one marked."""
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
        """Write batches/s against num_workers, one line per prefetch_factor, to ``path``.

        Args:
            path (str): the PNG file to write.

        Raises:
            ImportError: matplotlib is not installed (``pip install 'torchfeed[plot]'``).
        """
        plt = pyplot()
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


def pyplot():
    """matplotlib's pyplot for files (Agg), or an ImportError saying how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError("plotting needs matplotlib, an optional extra of torchfeed. "
                          f"Install it with: {_PLOT_INSTALL}") from None
    matplotlib.use("Agg")  # files only; never open a window or need a display
    import matplotlib.pyplot as plt

    return plt


def workers_text(n: int) -> str:
    return f"{n} worker{'' if n == 1 else 's'}"


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
                      f"worker count: the best with workers ({workers_text(top.num_workers)}) "
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
        reason = f"throughput still grows up to {workers_text(pick.num_workers)} ({advice}"
    else:
        nxt = more[0]
        verb = "drops" if nxt.batches_per_s < pick.batches_per_s else "stops growing"
        reason = (f"throughput {verb} after {workers_text(pick.num_workers)}: with "
                  f"{workers_text(nxt.num_workers)} it {versus(nxt)}")
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
