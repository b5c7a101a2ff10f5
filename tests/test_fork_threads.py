"""torchfeed never forks a worker from a main process that carries threads
torch's loader would not carry at its forks (issue 25).

Python 3.12+ warns ("This process ... is multi-threaded, use of fork() may
lead to deadlocks in the child") at every fork of a multi-threaded process, and
such a fork can deadlock a child that needs a lock another thread held.  The
threads that matter are the loader's own: its pin-memory thread, the feeder
threads of its queues.  ``_fork_threads_child.py`` records the Python threads
alive at every fork of a fresh interpreter, for torch's loader and for
torchfeed's in the same scenarios (the pin thread runs for real where there is
an accelerator), and for torchfeed's worker restart, which torch has not.
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
