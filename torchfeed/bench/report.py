"""What the bench prints and writes: the machine, the command, the table, the JSON.

Owns presentation only; every figure comes from :mod:`torchfeed.bench.compare`.
"""
from __future__ import annotations

import json
import os
import platform
import shlex
import sys
from typing import Any, Sequence

import numpy
import torch

from .compare import BASELINE, METRICS, PEERS, TORCH, TORCHFEED, BenchConfig, WorkloadResult
from .measure import cpu_count, load_average

_MIB = 1 << 20

# (metric, group title, direction note, how to show one value)
_COLUMNS = [
    ("batches_per_s", "batches/s", "higher is better", lambda v: _num(v)),
    ("first_batch_s", "first batch, ms", "lower is better", lambda v: _num(v * 1e3)),
    ("cpu_us_per_batch", "main CPU us/batch", "lower is better", lambda v: _num(v)),
    ("peak_mem_bytes", "peak MiB RSS+shm", "lower is better", lambda v: _num(v / _MIB)),
]


def _num(value: float) -> str:
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def machine_info() -> dict[str, Any]:
    load = load_average()
    return {
        "cores_usable": cpu_count(),
        "cores_total": os.cpu_count(),
        "cpu_model": cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "load_average_1min": load,
    }


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command as a person would retype it, whether run with -m or as a script."""
    argv = list(sys.argv if argv is None else argv)
    prog = argv[0] if argv else ""
    if prog.endswith(os.path.join("torchfeed", "bench", "__main__.py")):
        head = ["python", "-m", "torchfeed.bench"]
    else:
        head = ["python", os.path.relpath(prog) if prog else "?"]
    return shlex.join(head + argv[1:])


def describe_machine(info: dict[str, Any]) -> str:
    load = info.get("load_average_1min")
    load_text = f", 1-min load average {load:.2f}" if load is not None else ""
    return (f"{info['cores_usable']} usable cores ({info['cores_total']} online), "
            f"{info['cpu_model']}; torch {info['torch']}, numpy {info['numpy']}, "
            f"Python {info['python']}, {info['platform']}{load_text}")


def _cell(result: WorkloadResult, name: str, metric: str, show) -> str:
    figures = result.figures.get(name)
    if figures is None:
        return "-"
    value = figures.median(metric)
    return "error" if figures.error and value is None else "-" if value is None else show(value)


def _ratio_cell(result: WorkloadResult, metric: str, ours: str, versus: str) -> str:
    ratio = result.ratio(metric, ours, versus)
    return "-" if ratio is None else f"{ratio:.2f}x"


def _groups(results: Sequence[WorkloadResult]):
    """(title, column heads, one list of cells per result) for each group of columns."""
    groups = []
    for metric, title, direction, show in _COLUMNS:
        rows = [[_cell(r, TORCH, metric, show), _cell(r, TORCHFEED, metric, show),
                 _ratio_cell(r, metric, TORCHFEED, TORCH)] for r in results]
        groups.append((f"{title} ({direction.split()[0]}=better)",
                       [TORCH, TORCHFEED, "tf/torch"], rows))
    if any(BASELINE in r.figures for r in results):
        show = _COLUMNS[0][3]
        rows = [[_cell(r, BASELINE, "batches_per_s", show),
                 _ratio_cell(r, "batches_per_s", TORCH, BASELINE),
                 _ratio_cell(r, "batches_per_s", TORCHFEED, BASELINE)] for r in results]
        groups.append(("vs num_workers=0, batches/s", [BASELINE, "torch/@0", "tf/@0"], rows))
    return groups


def _peer_groups(results: Sequence[WorkloadResult], peers: Sequence[str]):
    """The peer table's groups: for each figure, each peer's and torchfeed/peer."""
    groups = []
    for metric, title, direction, show in _COLUMNS:
        heads: list = []
        rows: list[list] = [[] for _ in results]
        for peer in peers:
            heads += [peer, f"tf/{peer}"]
            for row, r in zip(rows, results):
                row += [_cell(r, peer, metric, show), _ratio_cell(r, metric, TORCHFEED, peer)]
        groups.append((f"{title} ({direction.split()[0]}=better)", heads, rows))
    return groups


def _render(results: Sequence[WorkloadResult], groups) -> str:
    """One row per workload, the groups' columns side by side under their titles."""
    head2 = ["workload", "batch"] + [h for _, heads, _ in groups for h in heads]
    body = [[r.workload.name, str(r.workload.batch_size)]
            + [c for _, _, rows in groups for c in rows[i]] for i, r in enumerate(results)]
    widths = [max(len(row[i]) for row in [head2] + body) for i in range(len(head2))]
    spans, first = [], 2
    for title, heads, _ in groups:
        cols = list(range(first, first + len(heads)))
        need = len(title) - (sum(widths[c] for c in cols) + 2 * (len(cols) - 1))
        if need > 0:  # the group's title spreads over its columns
            widths[cols[-1]] += need
        spans.append(cols)
        first += len(heads)

    def line(cells: list[str]) -> str:
        parts = [cells[0].ljust(widths[0]), cells[1].rjust(widths[1])]
        parts += ["  ".join(cells[c].rjust(widths[c]) for c in cols) for cols in spans]
        return (parts[0] + "  " + parts[1] + " | " + " | ".join(parts[2:])).rstrip()

    titles = [title.ljust(sum(widths[c] for c in cols) + 2 * (len(cols) - 1))
              for (title, _, _), cols in zip(groups, spans)]
    lead = " " * (widths[0] + 2 + widths[1])
    lines = [(lead + " | " + " | ".join(titles)).rstrip(), line(head2)]
    lines.append("-" * len(lines[1]))
    lines += [line(r) for r in body]
    return "\n".join(lines)


def format_table(results: Sequence[WorkloadResult]) -> str:
    """One row per workload; for each figure torch's, torchfeed's and torchfeed/torch.

    With the num_workers=0 baseline measured, a last group shows torch's
    batches/s at num_workers=0 and what each loader's workers make of it.
    """
    return _render(results, _groups(results))


def peers_in(results: Sequence[WorkloadResult]) -> list[str]:
    return [p for p in PEERS if any(p in r.figures for r in results)]


def format_peer_table(results: Sequence[WorkloadResult]) -> str:
    """The same figures for each peer column, with torchfeed's over the peer's ("" when
    no peer ran)."""
    peers = peers_in(results)
    return _render(results, _peer_groups(results, peers)) if peers else ""


def format_report(results: Sequence[WorkloadResult], config: BenchConfig,
                  info: dict[str, Any], command: str, end_load: float | None) -> str:
    transport = f", transport={config.transport!r}" if config.transport else ""
    if config.torch_threads is not None:
        transport += f", torch.set_num_threads({config.torch_threads})"
    peers = peers_in(results)
    peer_text = "".join(f", {PEERS[p].title}" for p in peers)
    lines = [
        f"torchfeed.bench: torch.utils.data.DataLoader vs torchfeed.DataLoader{peer_text}, "
        f"num_workers={config.num_workers}{transport}, median of {config.repeats} run(s) each",
        f"machine: {describe_machine(info)}"
        + (f"; {end_load:.2f} at the end" if end_load is not None else ""),
        f"command: {command}",
        "",
        format_table(results),
        "",
    ]
    if peers:
        lines += [
            "peer loaders, in the same runs (tf/<peer> = torchfeed's figure / the peer's):",
            "",
            format_peer_table(results),
            "",
        ]
    lines += [
        "tf/torch = torchfeed's figure / torch's. batches/s: above 1.00x means torchfeed is "
        "faster; first batch, main CPU and memory: below 1.00x means torchfeed is better.",
        "first batch: iter() to the first batch, worker start included"
        + (f" (also over {config.first_batch_runs} runs per loader that stop there)"
           if config.first_batch_runs else "")
        + ". main CPU: "
        "process_time() of the consuming process per timed batch. peak MiB: RSS of the main "
        "process + its workers, plus /dev/shm growth.",
        "Figures are medians; on a shared or busy machine they move between runs.",
    ]
    if BASELINE in config.loaders():
        lines.insert(-1, f"vs num_workers=0: {BASELINE} is torch's DataLoader with num_workers=0 "
                         "in the same run; torch/@0 and tf/@0 are each loader's batches/s with "
                         f"num_workers={config.num_workers} over it (above 1.00x: the workers "
                         "pay off).")
    lines += [f"note: {note}" for note in config.notes()]
    lines += [f"note: {PEERS[p].caveat}" for p in peers if PEERS[p].caveat]
    for result in results:
        for name, figures in result.figures.items():
            if figures.error:
                lines.append(f"error: {name} on {result.workload.name}: {figures.error}")
            leftover = max((r.leftover_processes for r in figures.runs), default=0)
            if leftover:
                lines.append(f"warning: {name} on {result.workload.name} left {leftover} "
                             "process(es) running 5 s after its iterator was deleted")
    return "\n".join(lines)


def to_json(results: Sequence[WorkloadResult], config: BenchConfig,
            info: dict[str, Any], command: str) -> str:
    data = {
        "command": command,
        "machine": info,
        "config": {
            "workloads": list(config.workloads),
            "num_workers": config.num_workers,
            "batches": config.batches,
            "repeats": config.repeats,
            "first_batch_runs": config.first_batch_runs,
            "transport": config.transport,
            "torch_threads": config.torch_threads,
            "peers": [p for p in config.peers if p in config.compared()],
            "skipped": config.notes(),
            "baseline": BASELINE if BASELINE in config.loaders() else None,
        },
        "metrics": {m: f"{direction} is better" for m, direction in METRICS.items()},
        "results": [r.to_dict() for r in results],
    }
    return json.dumps(data, indent=2)
