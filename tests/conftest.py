"""The order the suite runs in, for pytest-xdist (setup.cfg runs it in parallel).

Workers take the next test as they come free, in collection order, so:

* tests marked ``long`` (ten seconds or more on two cores: they start
  interpreters, torchrun jobs, or thousands of batches) come first, so that a run
  does not end with one worker busy on a long test while the others sit idle;
* tests marked ``big_imports`` (they import Lightning, Accelerate, Hugging Face
  datasets or matplotlib into the test process, each 100 MiB or more) come last: every fork
  after them in that process (a loader's workers) copies their page tables,
  which made each fork about 2.5 times as costly;
* tests marked ``waits`` (they mostly sleep: a worker stuck until a timeout
  fires, workers kept busy by a slow dataset while the loader is dropped, the
  stall clock's known timings; each, with its children, spends a tenth of its
  time or less on a CPU) are dealt evenly through the rest, each test
  function's cases apart.  In pytest's order the 32 cases of the two fault
  tests among them came one after another, every worker reached them at once,
  and the two cores sat idle: side by side on 2 cores (2026-11-28), the
  cores were idle 18 to 22 core-seconds of a run with them in order, most of
  it in those 20 s, and 8 to 13 with them dealt out.  Dealt out by position,
  not by time: where the tests around them are quick, a few still meet.
  ``tests/test_suite_order.py`` checks the dealing on the run's own items.

Everything else keeps pytest's order.  ``xdist_group`` marks keep tests that
share a costly module-scoped fixture on one worker (``--dist loadgroup``); a
group goes where its first test is in this order.  That needs xdist's
``--no-loadscope-reorder``, which ``pytest_configure`` sets where the option
exists (pytest-xdist 3.6 on): by default it sends the groups before every
single test, the largest first, so the ``lightning`` and
``hf_datasets`` groups started the run and their workers forked from 100 to
170 MiB more heap for the rest of it (a run went from 204 s and 361 CPU-seconds
to 178 s and 324 beside it, then 236 and 424 to 193 and 354).

Once collected, what collection built (torch, the test modules: some 170,000
objects) goes into the collector's permanent generation, which CPython made
for this: every ``gc.collect()`` a test or a leak check runs, and every
automatic full collection, then walks only what the tests made since.  Each
one took about 0.1 s before, most of the fault tests' time.  After a test that
imported a hundred modules or more, what it imported is frozen the same way.

Each loader worker a test starts is a fork of its pytest worker, and the
kernel copies that process's page tables at every fork and tears the copy down
at every exit, some 2,300 times a run: about 150 MiB of anonymous memory right
after collection, most of it torch's, one entry per 4 KiB page.  So after
collection the worker asks the kernel to back that memory with 2 MiB pages
(``madvise(MADV_COLLAPSE)``, Linux 6.1 on; a no-op elsewhere), one entry for
512.  The pages and their contents stay the same, as does what a forked
worker copies when it writes to one (4 KiB: the kernel splits the huge page in
that process first).  A loader worker's fork and exit then cost about a third
less, and side by side on 2 cores (2026-11-28; docs/contributing.md has the
suite's times) the pytest workers and their forked loader workers spent 12 to
19% less CPU, and the suite 0 to 10% less time.  Where the worker writes while children
share the memory, the kernel splits the huge page back: within ten seconds
only 40 to 65 MiB of the 170 were still huge.  So between tests, at most every
``COLLAPSE_AGAIN_AFTER`` seconds, the worker asks again (in one run 25 to 56
times per pytest process, 2.7 CPU-seconds in all).  Side by side,
alternating, six pairs of runs took 289 and 281 CPU-seconds on average, less
with it in five pairs; the machine's own speed moved more than that between
pairs.  Only the tests' own processes do this, never torchfeed: a process
that forks loaders in a test is as a user's would be.

pytest rewrites each test module's asserts when it imports it (about 3.5 s of
CPU for this suite) and keeps the result in ``__pycache__`` beside it, unless
``PYTHONDONTWRITEBYTECODE`` is set, as it is on some CI images: then each
worker rewrote everything again at every run.  So the controller rewrites
them once, in a thread while the workers start, and writes them where pytest
looks (``tests/__pycache__``, ignored by git); the workers only read them.
For the same reason it compiles torchfeed and the tests' helper modules
(``__pycache__`` too): some sixty fresh interpreters import them in a run
(spawned workers, torchrun ranks, scripts), each compiling torchfeed's modules
again, 0.1 s apiece.

Every descriptor a test opens is numbered 1024 or more, wherever the host
allows that many (``ulimit -n`` of 4096 or more): after
collection each worker fills the numbers below 1024 with descriptors of
``/dev/null`` (``tests/host_fds.py``; not inheritable, so no spawned or
exec'd process gets them).
``select.select`` cannot take a descriptor above 1023, and on a host whose
limit is high a worker that kept enough files open (mosaicml-streaming's
mappings did) passed 1023 by itself and failed two tests with "filedescriptor
out of range in select()" (issue 51); with the low numbers taken, any such
call fails in every run, not only on that host.  ``tests/test_host_fds.py``
checks the premise.

``TORCHFEED_TEST_START_METHOD=forkserver`` makes that the default start method
of every test process (``multiprocessing.set_start_method``), as it is on
Python 3.14's Linux: ``.ci/run`` runs the core tests so, where a loader given
no ``multiprocessing_context`` starts its workers the way the default says,
torch's and torchfeed's alike.  The fork server then preloads torch and
torchfeed, as torchfeed's own preload does where its loader starts the server
(NOTE [ Forkserver preload ] in torchfeed/_processes.py): where torch's loader
started it first (the parity tests run torch's loader first), every worker
imported torch again, a second or more each, and the run took 13 minutes.
"""
from __future__ import annotations

import ctypes
import gc
import multiprocessing
import os
import re
import sys
import threading
import time
from pathlib import Path

from host_fds import take_low_fds

_TESTS = Path(__file__).resolve().parent
_preparing: list[threading.Thread] = []
_frozen_with = [0]  # len(sys.modules) at the last gc.freeze()
_HUGE_PAGE = 2 << 20
_MADV_COLLAPSE = 25  # <linux/mman.h>; older kernels answer EINVAL
COLLAPSE_AGAIN_AFTER = 2.0  # seconds
_collapsed_at = [0.0]  # time.monotonic() of the last collapse (none yet: 0, the controller)


def _rewrite_test_modules(config) -> None:
    """What pytest's import hook does for each module it rewrites, ahead of time.

    These are pytest's private helpers; if a release renames them, the workers
    just rewrite for themselves as before."""
    try:
        from _pytest.assertion import rewrite
        state = config.stash[rewrite.assertstate_key]
        for source in sorted(_TESTS.rglob("*.py")):
            if not (source.name.startswith("test_") or source.name == "conftest.py"):
                continue
            cache = rewrite.get_cache_dir(source)
            if not rewrite.try_makedirs(cache):
                return
            pyc = cache / (source.name[:-3] + rewrite.PYC_TAIL)
            if rewrite._read_pyc(source, pyc) is None:
                stat, code = rewrite._rewrite_test(source, config)
                rewrite._write_pyc(state, code, stat, pyc)
    except (ImportError, AttributeError, KeyError, OSError, SyntaxError):
        pass


def _compile_imported_modules() -> None:
    """Bytecode for what fresh interpreters import by name: torchfeed, and the
    helpers beside the tests (the test modules are pytest's, above)."""
    import compileall
    test_module = re.compile(r"(^|[\\/])(test_[^\\/]*|conftest)\.py$")
    for folder in (_TESTS.parent / "torchfeed", _TESTS):
        compileall.compile_dir(str(folder), rx=test_module, quiet=2)


def _prepare_bytecode(config) -> None:
    _rewrite_test_modules(config)
    _compile_imported_modules()


def pytest_configure(config):
    method = os.environ.get("TORCHFEED_TEST_START_METHOD")
    if method:  # the default start method for the whole run (the docstring's last paragraph)
        multiprocessing.set_start_method(method, force=True)
        if method == "forkserver":
            multiprocessing.set_forkserver_preload(["torch", "torchfeed"])
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False  # each group where our order puts it
    in_controller = not hasattr(config, "workerinput")
    if in_controller and config.getoption("numprocesses", None):
        thread = threading.Thread(target=_prepare_bytecode, args=(config,),
                                  name="prepare-bytecode", daemon=True)
        thread.start()
        _preparing.append(thread)


def pytest_unconfigure(config):
    for thread in _preparing:
        thread.join()


def _fork_from_huge_pages() -> None:
    """This process's anonymous memory in 2 MiB pages, where the kernel can
    (the docstring's fork paragraph); nothing where it cannot or is not Linux."""
    if not sys.platform.startswith("linux"):
        return
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        with open("/proc/self/maps") as f:
            regions = f.read().splitlines()
    except (OSError, AttributeError):
        return
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for region in regions:
        fields = region.split()
        name = fields[5] if len(fields) > 5 else ""
        if not fields[1].startswith("rw") or name not in ("", "[heap]"):
            continue  # files' pages, stacks: not what the fork note is about
        low, high = (int(x, 16) for x in fields[0].split("-"))
        start, end = -(-low // _HUGE_PAGE) * _HUGE_PAGE, high // _HUGE_PAGE * _HUGE_PAGE
        if end > start:
            madvise(start, end - start, _MADV_COLLAPSE)  # a region it refuses stays as it was
    _collapsed_at[0] = time.monotonic()


def pytest_collection_finish(session):
    take_low_fds()
    gc.collect()
    gc.freeze()
    _frozen_with[0] = len(sys.modules)
    _fork_from_huge_pages()


def pytest_runtest_logfinish(nodeid, location):
    # A test that imports a framework (Accelerate brings HF datasets, pandas and
    # pyarrow: ~950 modules) leaves its objects to every later collection in
    # this worker: freeze them too, as collection's were.
    if len(sys.modules) > _frozen_with[0] + 100:
        gc.collect()
        gc.freeze()
        _frozen_with[0] = len(sys.modules)
    # The huge pages the tests' forks have split since (the docstring's fork
    # paragraph), put back between tests, at most every COLLAPSE_AGAIN_AFTER s.
    if _collapsed_at[0] and time.monotonic() - _collapsed_at[0] >= COLLAPSE_AGAIN_AFTER:
        _fork_from_huge_pages()


def _spread_waiting(items: list) -> list:
    """``items`` in their order, with the tests marked ``waits`` dealt evenly
    through them: each test function's cases spread among the others' first,
    so that no two of one function run side by side (the docstring's order)."""
    waiting: list = []
    others: list = []
    for item in items:
        (waiting if item.get_closest_marker("waits") else others).append(item)
    cases: dict = {}
    for item in waiting:
        cases.setdefault((item.path, item.originalname), []).append(item)
    within = {item: (i + 0.5) / len(family)
              for family in cases.values() for i, item in enumerate(family)}
    waiting.sort(key=within.__getitem__)
    place = {item: i / len(others) for i, item in enumerate(others)}
    place.update({item: (i + 0.5) / len(waiting) for i, item in enumerate(waiting)})
    return sorted(items, key=place.__getitem__)


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        if item.get_closest_marker("long"):
            return 0
        return 2 if item.get_closest_marker("big_imports") else 1

    ranked: list[list] = [[], [], []]  # each in pytest's order
    for item in items:
        ranked[rank(item)].append(item)
    items[:] = ranked[0] + _spread_waiting(ranked[1]) + ranked[2]
