"""Helpers shared by the fault tests: run a loader until it fails, and measure when."""
from __future__ import annotations

import time

import pytest

SURFACE_WITHIN = 5.0  # the bound between a fault and its error


class Failure:
    """What a failed iteration left us: the exception's type and text (never
    the exception itself, whose traceback would keep the iterator alive), when
    it was raised and how many batches came before it."""

    def __init__(self, exc: BaseException, raised_at: float, batches: int):
        self.type = type(exc)
        self.message = str(exc)
        self.raised_at = raised_at
        self.batches = batches

    def __repr__(self):
        return f"{self.type.__name__}: {self.message}"


def iterate_until_failure(loader, epochs: int = 1) -> Failure:
    """Iterate ``epochs`` epochs; return the Failure, or fail the test if none came."""
    batches = 0
    try:
        for _ in range(epochs):
            for batch in loader:
                del batch
                batches += 1
    except Exception as exc:
        return Failure(exc, time.time(), batches)
    pytest.fail(f"the loader ran {epochs} epoch(s) ({batches} batches) without an error")


def epochs_for(config) -> int:
    """Persistent workers get the fault in their second epoch (see FaultyMap's
    ``visit``), so it hits a worker that went through ResumeIteration."""
    return 2 if config.persistent else 1
