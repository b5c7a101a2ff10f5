"""Item 6: a worker stuck for good, with ``timeout=2``.

The error keeps torch's first words ("DataLoader timed out after 2 seconds"),
comes within timeout + 2 s, says which batch it waited for from which worker,
and shows that worker's Python stack, so the user sees where it hung.
"""
import time

import pytest
from faults_datasets import make_dataset, read_marker
from faults_helpers import ALL_CONFIGS, epochs_for, iterate_until_failure

from torchfeed import DataLoader

TIMEOUT = 2


@pytest.mark.waits
@pytest.mark.timeout(30)
@pytest.mark.parametrize("loader_config", ALL_CONFIGS, ids=lambda c: c.id, indirect=True)
def test_stuck_worker_timeout_shows_its_stack(loader_config, tmp_path, no_pin_warning):
    marker = str(tmp_path / "fired")
    visit = epochs_for(loader_config)
    dataset = make_dataset(loader_config.kind, fault="sleep", at=21, marker=marker, visit=visit)
    loader = DataLoader(dataset, batch_size=4, num_workers=2, timeout=TIMEOUT,
                        **loader_config.kwargs())
    started = time.time()
    failure = iterate_until_failure(loader, epochs=visit)
    fired_at, pid, worker_id = read_marker(marker)

    assert failure.type is RuntimeError, failure
    msg = failure.message
    assert msg.startswith(f"DataLoader timed out after {TIMEOUT} seconds"), msg
    assert "batch 5 (" in msg and f"from worker {worker_id} (pid {pid})" in msg, msg
    if loader_config.kind == "map":
        assert "sample indices [20, 21, 22, 23]" in msg, msg
    # The stack: where the worker sleeps, and how it got there.
    assert f"Python stacks of worker {worker_id} (pid {pid})" in msg, msg
    assert "in fire" in msg and "faults_datasets.py" in msg, msg
    assert "in worker_loop" in msg, msg
    assert "popen_fork" not in msg, msg  # the fork's bootstrap frames are trimmed
    # Bounds: the batch before the stuck one arrives at once, so the wait for
    # the stuck one starts at most a moment after the fault.
    assert failure.raised_at - fired_at < TIMEOUT + 2, failure.raised_at - fired_at
    if not loader_config.persistent:
        assert failure.raised_at - started < TIMEOUT + 2, failure.raised_at - started
    del loader
