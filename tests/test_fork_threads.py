"""torchfeed never forks a worker from a main process that carries threads
torch's loader would not carry at its forks (issue 25).

Python 3.12+ warns ("This process ... is multi-threaded, use of fork() may
lead to deadlocks in the child") at every fork of a multi-threaded process, and
such a fork can deadlock a child that needs a lock another thread held.  The
threads that matter are the loader's own: its pin-memory thread, the feeder
threads of its queues.  ``_fork_threads_child.py`` records the Python threads
alive at every fork of a fresh interpreter, for torch's loader and for
torchfeed's in the same scenarios (the pin thread runs for real where there is
an accelerator), and for torchfeed's worker restart, which torch has not,
batches dropped as they arrive: once as it is, and once with page-locked slots
(CUDA stubbed by ``cuda_stubs.py`` where there is none), whose releases run
in a thread of their own right up to the replacement's fork.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.mark.long
@pytest.mark.timeout(180)
def test_torchfeed_forks_with_no_more_threads_than_torch(tmp_path):
    proc = subprocess.run([sys.executable, str(HERE / "_fork_threads_child.py"), str(tmp_path)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-6000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    locked = result.pop("restart_page_locked", None)
    for name, forks in result.items():
        ours, theirs = forks["torchfeed"], forks.get("torch")
        assert len(ours) >= 2, (name, forks)  # it did fork its workers
        assert all("MainThread" in threads for threads in ours)
        if theirs is not None:  # the same forks, each with no more threads than torch's
            assert len(ours) == len(theirs), (name, forks)
            assert all(len(o) <= len(t) for o, t in zip(ours, theirs)), (name, forks)
    # Where torch forks with MainThread alone, so does torchfeed: on 3.11, everywhere.
    assert all(threads == ["MainThread"] for threads in result["fresh"]["torchfeed"])
    assert all(threads == ["MainThread"] for threads in result["restart"]["torchfeed"])
    assert len(result["reading"]["torchfeed"]) == 3, result["reading"]  # 1 worker, then 2
    assert all(threads == ["MainThread"] for threads in result["reading"]["torchfeed"])
    # The restart again with page-locked slots (CUDA stubbed where absent): the
    # dead worker's slots went to the releaser's thread just before the fork
    # of its replacement, and that thread was ended first (issue 35, finding 2).
    if locked is not None:
        assert locked["registered"] > 0 and "torchfeed-slot-releaser" in locked["released_by"], \
            locked
        assert len(locked["torchfeed"]) >= 3, locked  # two workers, then the replacement
        assert all(threads == ["MainThread"] for threads in locked["torchfeed"]), locked
