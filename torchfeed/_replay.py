"""Rebuilding an epoch's index stream from a state, loading no data: what
``load_state_dict`` checks before it accepts a state, and what cannot be rebuilt.

``locate`` replays a state's epoch up to its checkpoint (a position past the end
of this loader's epoch is refused; an epoch with every batch yielded counts as
finished), ``replay_to_end`` runs a finished epoch's stream out so the
generators and a stateful sampler are where the uninterrupted run left them, a
sampler with ``set_epoch`` gets the saved epoch and keeps it until ``iter()``,
and ``inexact`` says why an epoch cannot be resumed exactly.  ``IndexStream``
(``_index_stream.py``) takes these as a mixin; the resume itself, at ``iter()``,
is its ``_resume``.
"""
from __future__ import annotations

import itertools
from typing import Any, Callable

from ._checkpoint import Checkpoint
from ._chunked_sampler import iterate
from ._rng import draw_base_seed, replaying
from ._sampler_state import saved_sampler_epoch, user_sampler


def _advance(iterator, n):
    """Take up to ``n`` items (all, for None) off ``iterator``; how many there were."""
    count = 0
    for _ in iterator if n is None else itertools.islice(iterator, n):
        count += 1
    return count


class Replay:
    """The replay half of ``IndexStream``; see the module docstring."""

    # What IndexStream sets and defines, read here (declarations for the type checker).
    sampler: Any
    index_sampler: Any
    generator: Any
    generators: list
    num_workers: int
    is_iterable: bool
    private: list
    lazy_draws: bool
    _draw_shared_seed: Callable[..., None]

    def _load_sampler(self, state) -> None:
        """The sampler's own ``load_state_dict``; its ValueError names the field it sits in."""
        try:
            self.sampler.load_state_dict(state)
        except ValueError as exc:
            raise ValueError(f"cannot load this DataLoader state: field 'sampler_state': "
                             f"{exc}") from exc

    def saved_sampler_epoch(self, cp: Checkpoint):
        """The epoch ``cp`` names for this loader's sampler with ``set_epoch``, or None."""
        return saved_sampler_epoch(cp.sampler_state, self.sampler)

    def restore_sampler_epoch(self, cp: Checkpoint) -> None:
        """Give a sampler with ``set_epoch`` the saved epoch, so a fresh one replays that
        epoch's order even if the user's loop does not call ``set_epoch`` first, and
        a later ``set_epoch`` to another epoch is seen (``_check_sampler_epoch``)."""
        saved = saved_sampler_epoch(cp.sampler_state, self.sampler)
        if saved is not None:
            self.sampler.set_epoch(saved)

    def _check_sampler_epoch(self, cp: Checkpoint) -> None:
        """A mid-epoch state continues one epoch of the sampler's order: refuse another."""
        saved = saved_sampler_epoch(cp.sampler_state, self.sampler)
        if saved is None:
            return
        now = self.sampler.epoch
        if now != saved:
            raise ValueError(
                f"this DataLoader resumes a checkpoint taken in epoch {saved} of its "
                f"{type(self.sampler).__name__}, but set_epoch({now}) was called after "
                f"load_state_dict, so the sampler would deal epoch {now}'s order and the "
                f"rest of epoch {saved} would be wrong. Call set_epoch({saved}) (or leave "
                "the epoch load_state_dict set) to finish the checkpoint's epoch first")

    def replay_to_end(self, cp: Checkpoint):
        """Run a finished epoch's index stream to its end, loading nothing.

        Leaves the loader's and the sampler's generators, and a stateful
        sampler, exactly as the uninterrupted run left them, so the next
        epoch draws the same shuffle.  Returns the epoch's number of batches,
        or None where the stream is not replayed (an IterableDataset, a
        ``"position"`` sampler).
        """
        with replaying(self.generator, self.generators, cp.epoch_start_rng):
            if cp.sampler_state is not None and cp.sampler_state.protocol == "epoch_start":
                self._load_sampler(cp.sampler_state.state)
            self._draw_shared_seed(keep=False)
            it = iterate(self.index_sampler)
            if cp.draws_base_seed:
                draw_base_seed(self.generator)
                if self.num_workers > 0:
                    self._draw_shared_seed(keep=False)
            if not self.is_iterable and cp.sampler_protocol != "position":
                return _advance(it, None)
        return None

    def locate(self, cp: Checkpoint) -> int:
        """Rebuild a map-style state's epoch up to its checkpoint, loading nothing.

        Returns ``found``: how many of the positions up to the last one it names
        (the frontier's next, or the last yielded out of order) the epoch actually
        has.  ``found == cp.frontier`` with nothing out of order: every batch was
        yielded, and the RNGs and the sampler are then where ``replay_to_end``
        leaves them.  ``found`` short of what the state names: the state points
        past the end of this loader's epoch.
        """
        ooo = sorted(p for p, _ in cp.out_of_order_yielded)
        frontier = cp.frontier
        last = ooo[-1] if ooo else frontier  # the last position the check needs
        protocol = cp.sampler_protocol
        with replaying(self.generator, self.generators, cp.epoch_start_rng):
            if cp.sampler_state is not None and protocol in ("position", "epoch_start"):
                self._load_sampler(cp.sampler_state.state)
            self._draw_shared_seed(keep=False)  # the draws replay_to_end makes, in its order
            it = iterate(self.index_sampler)
            if cp.draws_base_seed:
                draw_base_seed(self.generator)
                if self.num_workers > 0:
                    self._draw_shared_seed(keep=False)
            start = frontier if protocol == "position" else 0  # it resumes there itself
            return start + _advance(it, last + 1 - start)

    def inexact(self) -> str | None:
        """Why a resume of this epoch cannot be exact, or None."""
        name = type(user_sampler(self.index_sampler)).__name__
        if self.private:
            return (f"the sampler's own random generator ({', '.join(self.private)}) is not "
                    "in the checkpoint, so after a restart it starts over and the resumed "
                    f"order differs. Give {name} state_dict() and load_state_dict() that "
                    "save it, or draw from a torch.Generator it owns (the checkpoint keeps "
                    "those)")
        if self.lazy_draws:
            return (f"{name} drew from a global RNG (torch, numpy or random) while it "
                    "yielded batches, not only when its __iter__ started, so those draws "
                    "depend on what the training loop drew in between and a resume cannot "
                    f"replay them. Make the whole order in __iter__ before the first batch, "
                    "or give the sampler state_dict() and load_state_dict()")
        return None
