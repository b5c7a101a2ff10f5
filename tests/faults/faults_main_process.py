"""A training script's main process, for the tests that kill or interrupt it.

    python faults_main_process.py KIND PERSISTENT PIN ACTION

``run`` iterates a slow dataset (so workers are busy) epoch after epoch, and
once the workers are busy mid-epoch reports their pids (``WORKERS <pid> <pid>``
on stdout when run as a script).  Then:

* ``sigkill``: SIGKILLs itself, as the OOM killer would;
* ``wait``: keeps iterating until the test interrupts it (SIGINT, SIGTERM).
"""
import os
import signal
import sys
import warnings

import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from faults_datasets import make_dataset  # noqa: E402

from torchfeed import DataLoader  # noqa: E402


def run(kind: str, persistent: bool, pin: bool, action: str, report) -> None:
    warnings.filterwarnings("ignore", message=".*no accelerator is found.*")
    if pin:
        os.environ["TORCHFEED_PIN_THREAD_WITHOUT_ACCELERATOR"] = "1"
    dataset = make_dataset(kind, n=10_000, delay=0.01)
    loader = DataLoader(dataset, batch_size=4, num_workers=2, persistent_workers=persistent,
                        pin_memory=pin)
    epochs = 2 if persistent else 1  # with persistent workers, act in the second epoch
    for epoch in range(1_000_000):
        for step, batch in enumerate(loader):
            if epoch + 1 >= epochs and step == 3:
                report(sorted(p.pid for p in psutil.Process().children()))
                if action == "sigkill":
                    os.kill(os.getpid(), signal.SIGKILL)
            if epoch + 1 < epochs and step == 5:
                break  # a short first epoch


def _print_workers(pids):
    print("WORKERS", *pids, flush=True)


if __name__ == "__main__":
    # The premise of the tests that interrupt this script: Ctrl-C raises
    # KeyboardInterrupt and SIGTERM ends it, as in a terminal, even when whoever
    # started pytest ignored them (a job started with & from a script ignores SIGINT,
    # and a child inherits what its parent ignores).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    kind, persistent, pin, action = sys.argv[1:]
    run(kind, persistent == "1", pin == "1", action, _print_workers)
