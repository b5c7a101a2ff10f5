"""Items 7 and 8: the main process dies or is interrupted mid-epoch.

* SIGKILL of the main process: every worker exits within 5 s (its watchdog
  notices the parent is gone), and no /dev/shm entry remains.
* SIGTERM to the main process only (``kill PID``), or to the whole process
  group (``docker stop``, Slurm): everything is gone within 5 s, and the workers
  print nothing.
* Ctrl-C (SIGINT to the whole process group): KeyboardInterrupt in the main
  process, workers ignore it, everything is gone within 5 s, and stderr holds
  the main process's one traceback and nothing from the workers.

SIGKILL and SIGTERM (no handler) end the main process with no clean-up of its
own, so a fork of this test process is as good a "training script" as a fresh
interpreter, and costs milliseconds instead of seconds of importing torch.
Ctrl-C does run the interpreter's exit path (atexit hooks, multiprocessing's
clean-up of daemonic children), so it runs a real script, ``faults_main_process.py``,
over fewer configurations: as ``__main__`` in a child that one server
interpreter (``--serve``, which imported torch once) forks for each case, and
which leaves by that same exit path.

A fork cannot use CUDA once its parent has (and on a CUDA build, this test
process has, or has at least asked the driver for its devices, which is as
bad): so on a torch built with an accelerator, the pin-thread cases, whose
main process pins batches for real, run the real script too (``start_main``).
"""
import multiprocessing.connection
import os
import signal
import subprocess
import sys
import time

import faults_main_process
import psutil
import pytest
import torch
from faults_helpers import SURFACE_WITHIN, foreign_shm, shm_entries

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "faults_main_process.py")

# (kind, persistent, pin thread): the whole matrix
CONFIGS = [(kind, persistent, pin) for kind in ("map", "iterable")
           for persistent in (False, True) for pin in (False, True)]


def _ids(config):
    kind, persistent, pin = config
    return f"{kind}-{'persistent' if persistent else 'fresh'}{'-pin' if pin else ''}"


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


_started = []


def _script_env() -> dict:
    """A fresh interpreter's environment: this process's imports, unbuffered output."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), PYTHONUNBUFFERED="1")


@pytest.fixture(autouse=True)
def _finish_every_main():
    """Kill whatever a failed test left running, before the leak check looks."""
    yield
    while _started:
        _started.pop().finish()


class _Main:
    """The pids of a "main process" and its two workers, and how to wait for them."""

    workers = ()

    def wait_all_gone(self, since: float) -> float:
        """Seconds from ``since`` until the main process and every worker are gone."""
        deadline = since + 30
        while time.time() < deadline:
            if self._main_exited() and all(_gone(p) for p in self.workers):
                return time.time() - since
            time.sleep(0.02)
        return float("inf")

    def stuck(self, took: float) -> str:
        """After ``wait_all_gone`` gave up (``took`` is inf): who still runs. The
        main process, if it does, first writes its threads' stacks to its stderr."""
        if took != float("inf"):
            return ""
        main = not self._main_exited() and not _gone(self.pid)
        if main:
            os.kill(self.pid, signal.SIGUSR1)
            time.sleep(0.5)
        workers = [pid for pid in self.workers if not _gone(pid)]
        return f"; still running: main process {main}, workers {workers}"

    def _cleanup_workers(self):
        for pid in self.workers:  # never leave a worker behind, even on failure
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)


class Script(_Main):
    """``faults_main_process.py`` in a fresh interpreter, in its own session."""

    def __init__(self, config, action):
        kind, persistent, pin = config
        env = _script_env()
        self.proc = subprocess.Popen(
            [sys.executable, SCRIPT, kind, str(int(persistent)), str(int(pin)), action],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
            start_new_session=True)
        self.pid = self.proc.pid
        _started.append(self)
        line = self.proc.stdout.readline()
        if not line.startswith("WORKERS"):
            self.proc.kill()
            out, err = self.proc.communicate()
            pytest.fail(f"the script did not start its workers: {line}{out}\n{err}")
        self.workers = [int(p) for p in line.split()[1:]]
        assert len(self.workers) == 2

    def _main_exited(self):
        return self.proc.poll() is not None

    def finish(self):
        if self.proc.poll() is None:
            self.proc.kill()
        out, err = self.proc.communicate()
        self._cleanup_workers()
        return self.proc.returncode, err


class Forked(_Main):
    """A fork of this test process running ``faults_main_process.run``, in its own
    session, its stderr (and its workers') going to a file."""

    def __init__(self, config, action, stderr_path):
        kind, persistent, pin = config
        self.stderr_path = stderr_path
        self.returncode = None
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never return into pytest
            code = 1
            try:
                os.close(r)
                os.setsid()
                signal.setitimer(signal.ITIMER_REAL, 0)  # pytest-timeout's alarm
                for sig in (signal.SIGTERM, signal.SIGALRM, signal.SIGINT):
                    signal.signal(sig, signal.SIG_DFL)
                fd = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(fd, 2)

                def report(pids):
                    os.write(w, (" ".join(map(str, pids)) + "\n").encode())

                faults_main_process.run(kind, persistent, pin, action, report)
                code = 0
            except BaseException:
                import traceback
                traceback.print_exc()
            finally:
                os._exit(code)
        os.close(w)
        self.pid = pid
        _started.append(self)
        with os.fdopen(r) as f:
            line = f.readline()
        if not line.strip():
            self._reap(block=True)
            pytest.fail(f"the forked main did not start its workers:\n{self.stderr()}")
        self.workers = [int(p) for p in line.split()]
        assert len(self.workers) == 2

    def _reap(self, block=False):
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, 0 if block else os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def _main_exited(self):
        return self._reap() is not None

    def stderr(self):
        with open(self.stderr_path) as f:
            return f.read()

    def finish(self):
        if self._reap() is None:
            os.kill(self.pid, signal.SIGKILL)
            self._reap(block=True)
        self._cleanup_workers()
        return self.returncode, self.stderr()


class ScriptServer:
    """``faults_main_process.py --serve``: one fresh interpreter that imports
    torch once and forks each Ctrl-C case's main process from there."""

    def __init__(self):
        env = _script_env()
        self.proc = subprocess.Popen([sys.executable, SCRIPT, "--serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        self.buffered = b""  # read from the pipe's fd, unbuffered, so a wait on it tells the truth

    def readline(self, timeout: float) -> str:
        """The next line, or "" if none is whole within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffered:
            left = deadline - time.monotonic()
            if not multiprocessing.connection.wait([self.proc.stdout.fileno()], max(left, 0)):
                return ""
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                return ""
            self.buffered += chunk
        line, self.buffered = self.buffered.split(b"\n", 1)
        return line.decode() + "\n"

    def close(self):
        self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Served(_Main):
    """``faults_main_process.py`` run as ``__main__`` in a child of the server, in
    its own session: the interpreter's whole exit path, without the import."""

    def __init__(self, server, config, action, stderr_path):
        kind, persistent, pin = config
        self.server, self.stderr_path, self.returncode = server, stderr_path, None
        server.proc.stdin.write(
            f"{kind} {int(persistent)} {int(pin)} {action} {stderr_path}\n")
        server.proc.stdin.flush()
        _started.append(self)
        line = server.readline(timeout=60)
        if not line.startswith("MAIN"):
            self._take_exit(line)
            pytest.fail(f"the script did not start its workers: {line}\n{self.stderr()}")
        words = line.split()
        self.pid, self.workers = int(words[1]), [int(p) for p in words[3:]]
        assert len(self.workers) == 2

    def _take_exit(self, line):
        if line.startswith("EXIT"):
            self.returncode = int(line.split()[1])

    def _main_exited(self):
        if self.returncode is None:
            self._take_exit(self.server.readline(timeout=0))
        return self.returncode is not None

    def stderr(self):
        with open(self.stderr_path) as f:
            return f.read()

    def finish(self):
        if self.returncode is None and not _gone(self.pid):
            os.kill(self.pid, signal.SIGKILL)
        while self.returncode is None:
            line = self.server.readline(timeout=30)
            if not line:
                raise RuntimeError("the script server reported no exit")
            self._take_exit(line)
        self._cleanup_workers()
        return self.returncode, self.stderr()


@pytest.fixture(scope="module")
def script_server():
    server = ScriptServer()
    yield server
    server.close()


# Read from the build, not the device: asking for the device would itself
# initialise the driver in this process.
ACCELERATOR_BUILD = torch.version.cuda is not None or torch.version.hip is not None


def start_main(config, action, tmp_path):
    """The "main process" for ``config``: a fork of this process, or where the
    fork would have to pin on an accelerator its parent already uses, the
    real script in a fresh interpreter."""
    pin = config[2]
    if pin and ACCELERATOR_BUILD:
        return Script(config, action)
    return Forked(config, action, tmp_path / "stderr")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("config", CONFIGS, ids=_ids)
def test_main_process_sigkill_leaves_nothing(config, tmp_path):
    shm_before = shm_entries()
    script = start_main(config, "sigkill", tmp_path)
    died = time.time()
    took = script.wait_all_gone(died)
    stuck = script.stuck(took)
    code, err = script.finish()
    assert code == -signal.SIGKILL, (code, err)
    assert took < SURFACE_WITHIN, f"workers outlived the main process by {took:.1f} s{stuck}"
    assert "Traceback" not in err, err
    # Another test run on the machine (pytest-xdist's other workers, say) may
    # make entries meanwhile: only those of this main process and its workers count.
    ours = {os.getpid(), script.pid, *script.workers}
    left = {e for e in shm_entries() - shm_before if not foreign_shm(e, ours)}
    assert not left, left


@pytest.mark.timeout(60)
@pytest.mark.xdist_group("ctrl_c_script_server")
@pytest.mark.parametrize("config", CONFIGS, ids=_ids)
def test_ctrl_c_exits_cleanly(config, script_server, tmp_path):
    script = Served(script_server, config, "wait", tmp_path / "stderr")
    sent = time.time()
    os.killpg(script.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    took = script.wait_all_gone(sent)
    stuck = script.stuck(took)
    code, err = script.finish()
    assert took < SURFACE_WITHIN, f"exit took {took:.1f} s{stuck}\n{err[-6000:]}"
    assert code in (-signal.SIGINT, 1), (code, err)
    # One clear error: the main process's KeyboardInterrupt, nothing from workers.
    assert err.count("Traceback (most recent call last)") == 1, err
    assert err.rstrip().endswith("KeyboardInterrupt"), err
    for noise in ("Exception ignored", "Exception in thread", "torchfeed/_worker.py"):
        assert noise not in err, err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("target", ["main", "group"])
@pytest.mark.parametrize("config", CONFIGS, ids=_ids)
def test_sigterm_exits_cleanly(config, target, tmp_path):
    script = start_main(config, "wait", tmp_path)
    sent = time.time()
    if target == "main":
        os.kill(script.pid, signal.SIGTERM)
    else:
        os.killpg(script.pid, signal.SIGTERM)
    took = script.wait_all_gone(sent)
    stuck = script.stuck(took)
    code, err = script.finish()
    assert code == -signal.SIGTERM, (code, err)
    assert took < SURFACE_WITHIN, f"exit took {took:.1f} s{stuck}"
    assert "Traceback" not in err, err
