"""A training script's main process, for the tests that kill or interrupt it.

    python faults_main_process.py KIND PERSISTENT PIN ACTION

``run`` iterates a slow dataset (so workers are busy) epoch after epoch, and
once the workers are busy mid-epoch reports their pids (``WORKERS <pid> <pid>``
on stdout when run as a script).  Then:

* ``sigkill``: SIGKILLs itself, as the OOM killer would;
* ``wait``: keeps iterating until the test interrupts it (SIGINT, SIGTERM).

    python faults_main_process.py --serve

imports torch and torchfeed once, then for each line ``KIND PERSISTENT PIN
ACTION STDERR_PATH`` read from stdin forks a child that is this script run as
``__main__`` with those arguments, in its own session, its stderr going to
STDERR_PATH.  The child prints ``MAIN <pid> WORKERS <pid> <pid>``; when it has
exited the server prints ``EXIT <code>`` (``subprocess``'s returncode).  The
child leaves by the interpreter's own exit path, as the script does (an
uncaught KeyboardInterrupt's traceback, atexit hooks, multiprocessing's
clean-up, SIGINT's exit status), but costs a fork instead of an import of torch.
"""
import faulthandler
import os
import signal
import sys
import warnings

import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from faults_datasets import make_dataset  # noqa: E402

from torchfeed import DataLoader  # noqa: E402


def run(kind: str, persistent: bool, pin: bool, action: str, report) -> None:
    # A test that gives up waiting for this process to end asks for its stacks.
    faulthandler.register(signal.SIGUSR1, file=2, all_threads=True)
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


def _serve() -> None:
    for line in sys.stdin:
        kind, persistent, pin, action, stderr_path = line.split()
        pid = os.fork()
        if pid == 0:
            os.setsid()
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            fd = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 2)
            sys.argv[1:] = [kind, persistent, pin, action]
            return  # into __main__'s code below, as the script itself
        _, status = os.waitpid(pid, 0)
        print("EXIT", os.waitstatus_to_exitcode(status), flush=True)
    sys.exit(0)


def _print_main_and_workers(pids):
    print("MAIN", os.getpid(), "WORKERS", *pids, flush=True)


if __name__ == "__main__":
    serving = sys.argv[1:] == ["--serve"]
    if serving:
        _serve()  # returns only in a child
    # The premise of the tests that interrupt this script: Ctrl-C raises
    # KeyboardInterrupt and SIGTERM ends it, as in a terminal, even when whoever
    # started pytest ignored them (a job started with & from a script ignores SIGINT,
    # and a child inherits what its parent ignores).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    kind, persistent, pin, action = sys.argv[1:]
    run(kind, persistent == "1", pin == "1", action,
        _print_main_and_workers if serving else _print_workers)
