"""``python -m torchfeed.bench``: built-in workloads through torch's DataLoader, torchfeed's
and the peer loaders users compare us with.

The package owns the side-by-side benchmark.  Its modules, in the order data
flows through them:

- :mod:`~torchfeed.bench.workloads`: the synthetic datasets, and every workload's sizes;
- :mod:`~torchfeed.bench.pipelines`: the real pipelines (JPEG files, padded text,
  Hugging Face datasets) and the cache folder they write;
- :mod:`~torchfeed.bench.loaders`: each column's loader, and the optional peers;
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
