"""The order the suite runs in, for pytest-xdist (setup.cfg runs it in parallel).

Workers take the next test as they come free, in collection order, so:

* tests marked ``long`` (ten seconds or more on two cores: they start
  interpreters, torchrun jobs, or thousands of batches) come first, so that a run
  does not end with one worker busy on a long test while the others sit idle;
* tests marked ``big_imports`` (they import Lightning, Accelerate, Hugging Face
  datasets or matplotlib into the test process, each 100 MiB or more) come last: every fork
  after them in that process (a loader's workers) copies their page tables,
  which made each fork about 2.5 times as costly.

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
"""
from __future__ import annotations

import gc
import re
import sys
import threading
from pathlib import Path

_TESTS = Path(__file__).resolve().parent
_preparing: list[threading.Thread] = []
_frozen_with = [0]  # len(sys.modules) at the last gc.freeze()


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


def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()
    _frozen_with[0] = len(sys.modules)


def pytest_runtest_logfinish(nodeid, location):
    # A test that imports a framework (Accelerate brings HF datasets, pandas and
    # pyarrow: ~950 modules) leaves its objects to every later collection in
    # this worker: freeze them too, as collection's were.
    if len(sys.modules) > _frozen_with[0] + 100:
        gc.collect()
        gc.freeze()
        _frozen_with[0] = len(sys.modules)


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        if item.get_closest_marker("long"):
            return 0
        return 2 if item.get_closest_marker("big_imports") else 1

    items.sort(key=rank)  # stable: pytest's order within each rank
