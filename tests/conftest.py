"""The order the suite runs in, for pytest-xdist (setup.cfg runs it in parallel).

Workers take the next test as they come free, in collection order, so:

* tests marked ``long`` (ten seconds or more on two cores: they start
  interpreters, torchrun jobs, or thousands of batches) come first, so that a run
  does not end with one worker busy on a long test while the others sit idle;
* tests marked ``big_imports`` (they import Lightning, Ray or Hugging Face
  datasets into the test process, each 100 MiB or more) come last: every fork
  after them in that process (a loader's workers) copies their page tables,
  which made each fork about 2.5 times as costly.

Everything else keeps pytest's order.  ``xdist_group`` marks keep tests that
share a costly module-scoped fixture on one worker (``--dist loadgroup``).

Once collected, what collection built (torch, the test modules: some 170,000
objects) goes into the collector's permanent generation, which CPython made
for this: every ``gc.collect()`` a test or a leak check runs, and every
automatic full collection, then walks only what the tests made since.  Each
one took about 0.1 s before, most of the fault tests' time.
"""
from __future__ import annotations

import gc


def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        if item.get_closest_marker("long"):
            return 0
        return 2 if item.get_closest_marker("big_imports") else 1

    items.sort(key=rank)  # stable: pytest's order within each rank
