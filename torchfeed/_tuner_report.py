"""What the tuner found, and what it recommends: ``TuneResult`` and ``recommend``.

``_tuner.py`` measures; this module holds the measured rows (``TuneRow``), the
result that ``torchfeed.tune`` returns (its table, its ``str()``, its plot and
the recommended loader arguments), and the rule that picks the recommended
setting and says why: the cheapest setting within ``TOLERANCE`` of the best
throughput.

Threads or processes, when both were measured: each kind gets its own pick
by that rule, and threads win unless they fall more than ``TOLERANCE`` short
of processes, since within it they cost less (no worker processes, no copy
of the dataset, nothing pickled, no start-up).  The reason says how much of
its time ``__getitem__`` holds the GIL, read off the threads' own scaling
(``gil_share``): with ``k`` threads ``S`` times as fast as one, Amdahl's law
puts the serialised share at ``(k / S - 1) / (k - 1)``.
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
    # "multiprocessing" or "thread"; None without workers
    worker_method: str | None = None


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
    # the recommended kind of worker, when both kinds were measured
    worker_method: str | None = None

    @property
    def loader_kwargs(self) -> dict[str, Any]:
        """The recommendation as DataLoader keyword arguments."""
        kwargs: dict[str, Any] = {"num_workers": self.num_workers}
        if self.num_workers > 0:
            kwargs["prefetch_factor"] = self.prefetch_factor
            if self.worker_method is not None:
                kwargs["worker_method"] = self.worker_method
        return kwargs

    def _picked(self, r: TuneRow) -> bool:
        return ((r.num_workers, r.prefetch_factor) == (self.num_workers, self.prefetch_factor)
                and (self.worker_method is None or r.num_workers == 0
                     or r.worker_method == self.worker_method))

    def to_dict(self) -> dict[str, Any]:
        """Everything above as plain values (what ``--json`` writes), with ``loader_kwargs``."""
        data = asdict(self)
        data["loader_kwargs"] = self.loader_kwargs
        return data

    def table(self) -> str:
        """The measured rows as a text table, the recommended one marked."""
        header = ["num_workers", "prefetch_factor", "workers", "batches/s", "vs best",
                  "first batch ms", "main CPU us/batch", "peak MiB", "batches", ""]
        best = max((r.batches_per_s or 0.0 for r in self.rows), default=0.0)
        body = []
        for r in self.rows:
            picked = self._picked(r)
            if r.error:
                cells = ["error"] + [""] * 5 + [r.error.splitlines()[0][:60]]
            else:
                cells = [f"{r.batches_per_s:.1f}",
                         f"{r.batches_per_s / best:.2f}x" if best else "-",
                         f"{r.first_batch_s * 1e3:.0f}", f"{r.cpu_us_per_batch:.0f}",
                         f"{(r.peak_mem_bytes or 0) / (1 << 20):.0f}", str(r.batches),
                         "<- recommended" if picked else ""]
            kind = {"thread": "threads", "multiprocessing": "processes"}.get(r.worker_method or "", "-")
            body.append([str(r.num_workers), "-" if r.prefetch_factor is None
                         else str(r.prefetch_factor), kind] + cells)
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
        kinds = sorted({r.worker_method for r in ok if r.num_workers}, key=str)
        for kind in kinds:
            for pf in sorted({r.prefetch_factor for r in ok if r.prefetch_factor is not None}):
                line = zero + [r for r in ok if r.prefetch_factor == pf and r.worker_method == kind]
                label = f"prefetch_factor={pf}" + (f", {kind}" if len(kinds) > 1 else "")
                ax.plot([r.num_workers for r in line], [r.batches_per_s for r in line],
                        marker="o", linestyle="--" if kind == "thread" else "-", label=label)
        if not any(r.num_workers for r in ok):
            ax.plot([r.num_workers for r in zero], [r.batches_per_s for r in zero], marker="o")
        picked = [r for r in ok if self._picked(r)]
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
    """The cheapest setting within ``tolerance`` of the best, and why; with both
    kinds of worker measured, the kind too (threads unless processes are more
    than ``tolerance`` faster)."""
    kinds = {r.worker_method for r in rows if r.num_workers and r.error is None and r.batches_per_s}
    if kinds != {"multiprocessing", "thread"}:
        return _recommend_workers(rows, cores, tolerance)
    processes, why_processes = _recommend_workers(
        [r for r in rows if r.worker_method != "thread"], cores, tolerance)
    threads, why_threads = _recommend_workers(
        [r for r in rows if r.worker_method != "multiprocessing"], cores, tolerance)
    gil = gil_share(rows, cores)
    held = ("" if gil is None else
            f"`__getitem__` holds the GIL about {gil[0]:.0%} of its time ({workers_text(gil[1])} "
            f"as threads loaded {gil[2]:.2f}x as fast as 1)")
    if threads.num_workers == 0 and processes.num_workers == 0:
        return _recommend_workers(rows, cores, tolerance)  # no workers of either kind pay off
    if threads.num_workers == 0:  # processes pay off, threads do not
        return processes, ("worker_method='multiprocessing': threads never loaded faster than "
                           "num_workers=0" + (f"; {held}" if held else "") + f". {why_processes}")
    if processes.num_workers == 0:
        return threads, (f"worker_method='thread': threads load faster than num_workers=0, "
                         f"processes do not. {why_threads}")
    if threads.batches_per_s >= processes.batches_per_s * (1 - tolerance):
        change = threads.batches_per_s / processes.batches_per_s - 1
        versus = (f"{change:.0%} faster than" if change > 0 else
                  f"within the {tolerance:.0%} margin of" if change > -0.005 else
                  f"only {-change:.0%} slower than, within the {tolerance:.0%} margin of")
        reason = (f"worker_method='thread': {workers_text(threads.num_workers)} as threads load "
                  f"{threads.batches_per_s:.1f} batches/s, {versus} processes "
                  f"({processes.batches_per_s:.1f} with {workers_text(processes.num_workers)}), "
                  "and threads start at once, copy no dataset and pickle no batch"
                  + (f"; {held}" if held and gil is not None and gil[0] >= 0.5 else "")
                  + f". {why_threads}")
        return threads, reason
    slower = 1 - threads.batches_per_s / processes.batches_per_s
    reason = (f"worker_method='multiprocessing': threads load only {threads.batches_per_s:.1f} "
              f"batches/s, {slower:.0%} slower than processes ({processes.batches_per_s:.1f})"
              + (f": {held}" if held else "") + f". {why_processes}")
    return processes, reason


def gil_share(rows: Sequence[TuneRow], cores: int) -> tuple[float, int, float] | None:
    """(the share of ``__getitem__``'s time spent holding the GIL, k, S), from the
    thread rows: S, how many times as fast ``k`` threads loaded as one (each
    at its best prefetch_factor, k the most threads tried, at most ``cores``).
    Amdahl's law for k workers of which a share g is serialised: S = 1 / (g +
    (1 - g) / k), so g = (k / S - 1) / (k - 1).  None without such rows."""
    best: dict[int, float] = {}
    for r in rows:
        if r.worker_method == "thread" and r.error is None and r.batches_per_s:
            best[r.num_workers] = max(best.get(r.num_workers, 0.0), r.batches_per_s)
    counts = [k for k in best if 2 <= k <= max(cores, 2)]
    if 1 not in best or not counts:
        return None
    k = max(counts)
    speedup = best[k] / best[1]
    share = (k / speedup - 1) / (k - 1)
    return min(1.0, max(0.0, share)), k, speedup


def _recommend_workers(rows: Sequence[TuneRow], cores: int,
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
