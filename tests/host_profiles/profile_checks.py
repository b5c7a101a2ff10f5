"""What must hold on macOS and Windows, run under a simulated host (issue 51).

Run by ``.ci/run``, once per profile, never by the README's test command (the
file name keeps pytest from collecting it there)::

    TORCHFEED_HOST_PROFILE=windows PYTHONPATH=tests/host_profiles:$PWD \\
        python -m pytest -q -n 0 -p no:cacheprovider tests/host_profiles/profile_checks.py

Each check first makes sure the profile is in effect (the host it names, the
capabilities that host lacks, the backend it must use); the checks themselves:
import, a ``num_workers=0`` loop, a 2-worker loop under spawn whose batches
equal torch's, exact resume, a worker's exception in torch's words, a dead
worker's error within 10 s, and the clear error (or the one-time notice) for
each option the host cannot honour.  ``torchfeed_host_profile.py`` says what
the simulation covers and what it cannot.
"""
from __future__ import annotations

import multiprocessing
import os
import random
import time
import warnings

import numpy as np
import pytest
import torch
from profile_datasets import Dying, Failing, Samples, Slow

import torchfeed
from torchfeed import _host

PROFILE = os.environ.get("TORCHFEED_HOST_PROFILE")
PLATFORM = {"macos": "macOS", "windows": "Windows"}.get(PROFILE or "")

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(autouse=True, scope="module")
def _profile_in_effect():
    assert PLATFORM, "run with TORCHFEED_HOST_PROFILE=macos or windows (see the docstring)"
    assert _host.PLATFORM == PLATFORM
    assert torch.multiprocessing.get_start_method() == "spawn"
    assert torch.multiprocessing.get_sharing_strategy() == "file_system"


def _torch_batches(dataset, **kwargs):
    return [b for b in torch.utils.data.DataLoader(dataset, **kwargs)]


def _equal(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])
                                   for x, y in zip(a, b))


def test_the_host_lacks_what_the_real_one_does():
    assert not _host.HAS_MEMFD and not _host.SHM_SLOTS and not _host.SHARED_CONTAINERS
    assert not _host.HAS_PUNCH_HOLE and not _host.HAS_PROC
    if PROFILE == "windows":
        assert not (_host.HAS_POLL or _host.HAS_RAW_FD_PIPES or _host.HAS_FORK
                    or _host.HAS_POSIX_SIGNALS or _host.HAS_STACK_DUMPS or _host.HAS_RESOURCE
                    or _host.HAS_REGISTER_AT_FORK or _host.HAS_LIBC or _host.HAS_FD_PASSING)
        assert multiprocessing.get_all_start_methods() == ["spawn"]
        assert not _host.fd_backend()
        with pytest.raises(ImportError):
            exec("import fcntl", {"__name__": "torchfeed._probe"})  # torchfeed's view
    else:
        assert _host.HAS_POLL and _host.HAS_POSIX_SIGNALS and _host.HAS_STACK_DUMPS
        assert _host.fd_backend()


def test_single_process_loop():
    dataset = Samples(20)
    loader = torchfeed.DataLoader(dataset, batch_size=4, shuffle=True,
                                  generator=torch.Generator().manual_seed(3))
    assert loader.transport == "torch"
    ours = list(loader)
    theirs = _torch_batches(dataset, batch_size=4, shuffle=True,
                            generator=torch.Generator().manual_seed(3))
    assert _equal(ours, theirs)


def test_two_workers_equal_torch_and_resume_exactly():
    """One loader does three checks, to spawn as few workers as it can: its
    batches equal torch's, a state taken part-way resumes exactly in a new
    loader, and what the host lacks is said once and named in ``stats()``."""
    dataset = Samples(48)
    kwargs = dict(batch_size=4, num_workers=2, shuffle=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = torchfeed.DataLoader(dataset, generator=torch.Generator().manual_seed(7),
                                      share_dataset=True, **kwargs)
        it = iter(loader)
        backend = type(it._receiver.messages).__name__
        ours, state = [], None
        for i, batch in enumerate(it):
            ours.append(batch)
            if i == 4:
                state = loader.state_dict()
        stats = loader.stats()
        torchfeed.DataLoader(dataset, **kwargs)  # a second loader is not told again
    told = [str(w.message) for w in caught if issubclass(w.category, _host.PlatformFallbackWarning)]
    assert backend == ("RelayReader" if PROFILE == "windows" else "MessageReader")
    assert loader.transport == "torch" and stats["transport"] == "torch"
    assert len(told) == 2, told  # the transport, and share_dataset: once each
    assert any(f"torchfeed on {PLATFORM}: batches go through torch's own transport" in t
               for t in told)
    assert any("share_dataset=True shares nothing here" in t for t in told)
    assert stats["large_attributes"] and stats["large_attributes"][0]["shared"] is False
    theirs = _torch_batches(dataset, generator=torch.Generator().manual_seed(7), **kwargs)
    assert _equal(ours, theirs)

    torch.manual_seed(987654321)  # a resume that ignored its state would now differ
    np.random.seed(98765)
    random.seed(98765)
    resumed = torchfeed.DataLoader(dataset, generator=torch.Generator().manual_seed(123), **kwargs)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert _equal(rest, ours[5:])


def test_worker_exception_in_torchs_words():
    from torch.utils.data._utils import ExceptionWrapper

    loader = torchfeed.DataLoader(Failing(bad=2), batch_size=2, num_workers=1)
    with pytest.raises(ValueError) as raised:
        list(loader)
    try:  # torch's own words for the same failure, from torch's own wrapper
        try:
            raise ValueError("sample 2 is broken")
        except ValueError:
            ExceptionWrapper(where="in DataLoader worker process 0").reraise()
    except ValueError as torchs:
        torchs_first_line = str(torchs).splitlines()[0]
    message = str(raised.value)
    assert message.splitlines()[0] == torchs_first_line
    assert "Original Traceback (most recent call last):" in message
    assert "sample 2 is broken" in message


def test_dead_worker_raises_within_10_seconds(tmp_path):
    """Worker 1 sends batch 1, then dies at its second task (batch 3); batch 2,
    from worker 0, may come before the error or not."""
    mark = str(tmp_path / "died_at")
    loader = torchfeed.DataLoader(Dying(bad=3, mark=mark), batch_size=1, num_workers=2)
    got = []
    with pytest.raises(RuntimeError) as raised:
        for batch in loader:
            got.append(batch)
    took = time.time() - float(open(mark).read())
    assert [b.tolist() for b in got] == [[[i]] for i in range(len(got))] and len(got) <= 3
    message = str(raised.value)
    assert message.startswith("DataLoader worker (pid(s) "), message
    assert "exited unexpectedly with exit code 3" in message
    assert took < 10, f"the dead worker's error took {took:.1f} s"


def test_timeout_says_what_it_waited_for():
    loader = torchfeed.DataLoader(Slow(slow=2, seconds=6), batch_size=1, num_workers=1,
                                  timeout=2)
    with pytest.raises(RuntimeError) as raised:
        list(loader)
    message = str(raised.value)
    assert message.startswith("DataLoader timed out after 2 seconds")
    assert "It was waiting for batch 2" in message
    if PROFILE == "windows":  # no SIGUSR1: the stacks cannot be had, and it says so
        assert "are not available on Windows, which has no SIGUSR1" in message
    else:
        assert "Python stacks of worker 0" in message and "in __getitem__" in message


def test_options_the_host_cannot_honour():
    dataset = Samples(8)
    with pytest.raises(ValueError, match=f"transport='shm' cannot be used on this host "
                                         f"\\({PLATFORM}\\)"):
        torchfeed.DataLoader(dataset, num_workers=2, transport="shm")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records = list(range(10))
        assert torchfeed.share(records) is records  # unshared, as without torchfeed.share
    assert any("torchfeed.share returns what it is given, unshared" in str(w.message)
               for w in caught)
    if PROFILE == "windows":
        with pytest.raises(ValueError, match="max_worker_restarts=1 cannot be used on this host "
                                             r"\(Windows\)"):
            torchfeed.DataLoader(dataset, num_workers=2, max_worker_restarts=1)
        with pytest.raises(ValueError) as raised:
            torchfeed.DataLoader(dataset, num_workers=2, multiprocessing_context="fork")
        text = str(raised.value) + "".join(getattr(raised.value, "__notes__", []))
        assert "should specify a valid start method in ['spawn']" in text  # torch's words
        assert "torchfeed: Windows has the start methods spawn only" in text
    else:  # macOS has POSIX signals and fork: both are honoured
        torchfeed.DataLoader(dataset, num_workers=2, max_worker_restarts=1)
        torchfeed.DataLoader(dataset, num_workers=2, multiprocessing_context="fork")
