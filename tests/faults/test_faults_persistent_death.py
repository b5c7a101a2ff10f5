"""A persistent loader after one of its workers died and the user caught the error.

torch re-raises "DataLoader worker (pid(s) ...) exited unexpectedly" at every
later ``iter()``; torchfeed starts fresh workers instead, so the next epoch runs
whole, and the dead iterator's pipes and shared memory are gone with it.
"""
import gc

import pytest
from faults_datasets import make_dataset, read_marker

from torchfeed import DataLoader


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pin", [False, True])
def test_next_iter_after_a_caught_worker_death_starts_fresh_workers(pin, tmp_path,
                                                                    monkeypatch, no_pin_warning):
    if pin:  # the pin-memory thread's path, without an accelerator
        monkeypatch.setenv("TORCHFEED_PIN_THREAD_WITHOUT_ACCELERATOR", "1")
    marker = tmp_path / "fired"
    dataset = make_dataset("map", n=16, fault="sigkill", at=5, marker=str(marker), once=True)
    loader = DataLoader(dataset, batch_size=2, num_workers=2, persistent_workers=True,
                        pin_memory=pin)
    with pytest.raises(RuntimeError, match=r"DataLoader worker \(pid\(s\) \d+\) exited "
                                           r"unexpectedly"):
        for _ in loader:
            pass
    _, dead_pid, _ = read_marker(marker)
    for _ in range(2):  # fresh workers, then the same persistent ones again
        batches = [b[:, 0].tolist() for b in loader]
        assert batches == [[2 * k, 2 * k + 1] for k in range(8)]
        pids = [w.pid for w in loader._iterator._workers]
        assert dead_pid not in pids and all(w.is_alive() for w in loader._iterator._workers)
    loader._iterator._shutdown_workers()
    del loader
    gc.collect()
