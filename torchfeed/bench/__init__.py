"""``python -m torchfeed.bench``: built-in workloads through torch's DataLoader and torchfeed's.

The package owns the side-by-side benchmark.  Its modules, in the order data
flows through them:

- :mod:`~torchfeed.bench.workloads`: the synthetic datasets and their sizes;
- :mod:`~torchfeed.bench.measure`: timing one loader run;
- :mod:`~torchfeed.bench.compare`: alternating runs of both loaders, medians;
- :mod:`~torchfeed.bench.report`: the table, the machine line and the JSON;
- ``__main__``: the command line.

The scripts in ``benchmarks/`` are thin wrappers over the same functions.
"""
from .compare import BenchConfig, WorkloadResult, run_comparison
from .measure import Timing, time_loader
from .workloads import WORKLOADS, Workload

__all__ = ["BenchConfig", "Timing", "WORKLOADS", "Workload", "WorkloadResult",
           "run_comparison", "time_loader"]
