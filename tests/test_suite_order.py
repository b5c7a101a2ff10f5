"""The suite's own order (tests/conftest.py), read from the items this run
collected: the tests that mostly sleep (``waits``) are dealt out through the
middle of the run, never two side by side and each test function's cases
apart, so that the pytest workers do not all sleep at once while the cores
idle.  It checks what the run's selection holds: run alone, there is nothing
to deal out."""
from collections import defaultdict


def _middle(items) -> list:
    return [item for item in items
            if not item.get_closest_marker("long") and not item.get_closest_marker("big_imports")]


def test_tests_that_mostly_sleep_are_dealt_out_through_the_run(request):
    middle = _middle(request.session.items)
    at = [i for i, item in enumerate(middle) if item.get_closest_marker("waits")]
    if len(at) < 2:
        return  # a selection with at most one of them: nothing to deal out
    others = len(middle) - len(at)
    gaps = [later - earlier - 1 for earlier, later in zip(at, at[1:])]
    # each sleeping test is its share of the others away from the last one
    assert min(gaps) >= others // len(at) - 1, (gaps, others, len(at))
    assert at[0] <= others // len(at) + 1 and at[-1] >= len(middle) - others // len(at) - 2, at


def test_each_sleeping_function_has_its_cases_dealt_among_the_others(request):
    waiting = [item for item in _middle(request.session.items) if item.get_closest_marker("waits")]
    cases = defaultdict(list)
    for position, item in enumerate(waiting):
        cases[item.path, item.originalname].append(position)
    for (_, name), positions in cases.items():
        # a function holding 1/k of the cases has its first within the first k places
        assert positions[0] <= len(waiting) / len(positions), (name, positions, len(waiting))
