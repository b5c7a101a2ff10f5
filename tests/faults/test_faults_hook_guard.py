"""The test-only fault hook (``torchfeed/_fault_hook.py``) cannot fire by accident
(issue 35, finding 6).

A worker it kills reads exactly like one the OOM killer took, and uses up
``max_worker_restarts``: so ``TORCHFEED_TEST_DIE_HOLDING`` alone does nothing,
and says so once; a malformed value does nothing and says what is wrong, once;
and an armed hook names itself on stderr before it kills.
"""
from __future__ import annotations

import warnings

import pytest
import torch

from torchfeed import DataLoader, _fault_hook
from torchfeed._fault_hook import ARMED_ENV
from torchfeed._fault_hook import ENV as HOOK_ENV

SAMPLES = 8


def _loader(**options):
    return DataLoader(torch.utils.data.TensorDataset(torch.arange(float(SAMPLES))),
                      batch_size=1, num_workers=2, **options)


def _epoch_with_warnings(loader) -> tuple[list, list]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [batch[0].item() for batch in loader]
    return got, [str(w.message) for w in caught if HOOK_ENV in str(w.message)]


@pytest.fixture
def fresh_report(monkeypatch):
    """This process has not reported the hook yet (it reports once per process)."""
    monkeypatch.setattr(_fault_hook, "_reported", [False])
    monkeypatch.delenv(ARMED_ENV, raising=False)


@pytest.mark.timeout(60)
def test_the_hook_alone_kills_nothing_and_says_so_once(monkeypatch, fresh_report):
    monkeypatch.setenv(HOOK_ENV, "slot:1:1")  # set by mistake, without the tests' switch
    got, said = _epoch_with_warnings(_loader())
    assert got == list(range(SAMPLES))  # worker 1 lived
    assert len(said) == 1, said
    assert f"{HOOK_ENV}='slot:1:1' is ignored" in said[0] and ARMED_ENV in said[0], said
    got, said = _epoch_with_warnings(_loader())
    assert got == list(range(SAMPLES)) and said == []  # once per process


@pytest.mark.timeout(60)
@pytest.mark.parametrize("value, words", [
    ("slot:one", "the worker id 'one' is not a number"),
    ("bogus:1:2", "the fault 'bogus' is not one of stop-flag"),
    ("slot:1:0", "the count '0' is not a positive number"),
])
def test_a_malformed_hook_kills_nothing_and_says_what_is_wrong_once(monkeypatch, fresh_report,
                                                                   value, words):
    monkeypatch.setenv(HOOK_ENV, value)
    monkeypatch.setenv(ARMED_ENV, "1")
    got, said = _epoch_with_warnings(_loader())
    assert got == list(range(SAMPLES))
    assert len(said) == 1 and words in said[0] and "<fault>:<worker id>" in said[0], said
    assert _epoch_with_warnings(_loader())[1] == []


@pytest.mark.timeout(60)
def test_an_armed_hook_names_itself_on_stderr_before_it_kills(monkeypatch, capfd, fresh_report):
    monkeypatch.setenv(HOOK_ENV, "slot:1:1")
    monkeypatch.setenv(ARMED_ENV, "1")
    with pytest.raises(RuntimeError, match="exited unexpectedly"):
        list(_loader(transport="shm"))
    err = capfd.readouterr().err  # the worker writes to the stderr it inherited
    assert (f"kills itself with SIGKILL: the test-only fault hook {HOOK_ENV}='slot:1:1' "
            f"({ARMED_ENV}=1) fired at 'slot'") in err, err
