"""``torchfeed/_ipc`` on its own: both queues' direct writers and the reader
against ``multiprocessing.Queue``'s own ``get`` and feeder threads, in real
processes under every start method (``ipc_roundtrip.py``)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(120)
def test_round_trip_through_both_queues_under_every_start_method():
    script = os.path.join(ROOT, "tests", "ipc_roundtrip.py")
    done = subprocess.run([sys.executable, script, ROOT], capture_output=True, text=True,
                          timeout=110)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("round trip ok"), done.stdout
