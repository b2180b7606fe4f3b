"""shared/progress_watch.py on its own clock: when work in hand without progress counts as hung.
The services' reaction to it (NOT_SERVING, exit 1, relaunch) is tested against real processes in
tests/test_lifecycle.py."""

from __future__ import annotations

import asyncio

from shared.progress_watch import ProgressWatch, stall_limit


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_an_idle_compute_is_never_stalled_and_work_after_a_long_idle_starts_the_clock_afresh() -> None:
    clock = Clock()
    watch = ProgressWatch("the engine", 5, clock)
    clock.now += 3600
    assert watch.stalled() is None
    with watch.working():
        clock.now += 4.9
        assert watch.stalled() is None
        clock.now += 0.2
        reason = watch.stalled()
    assert reason is not None and "the engine made no progress for 5.1s of work in hand (1 piece(s) now" in reason
    assert watch.stalled() is None  # the work left: nothing is owed


def test_progress_restarts_the_wait_and_overlapping_work_counts_until_the_last_piece_ends() -> None:
    clock = Clock()
    watch = ProgressWatch("the vision tower", 5, clock)
    with watch.working():
        with watch.working():
            clock.now += 4
            watch.progressed()
            clock.now += 4
            assert watch.stalled() is None
        clock.now += 2  # the first piece is still in hand, 6 s after the last progress
        assert watch.stalled() is not None


def test_a_limit_of_zero_turns_the_watch_off() -> None:
    clock = Clock()
    watch = ProgressWatch("the engine", 0, clock)
    with watch.working():
        clock.now += 10**6
        assert watch.stalled() is None


def test_until_stalled_returns_the_reason_once_the_limit_passes() -> None:
    watch = ProgressWatch("the engine", 0.05)

    async def hang() -> str:
        with watch.working():
            return await asyncio.wait_for(watch.until_stalled(0.01), timeout=5)

    assert "made no progress" in asyncio.run(hang())


def test_waits_that_clients_gave_up_add_up_until_progress_comes() -> None:
    """Each client leaves after 2 s (its deadline) without a token; idle gaps between them do not
    count, but their waits do: a hung engine behind sparse traffic is caught all the same."""
    clock = Clock()
    watch = ProgressWatch("the engine", 5, clock)
    for _ in range(2):
        with watch.working():
            clock.now += 2
            assert watch.stalled() is None
        clock.now += 100
    with watch.working():
        clock.now += 1.5
        assert watch.stalled() is not None  # 5.5 s of waiting in all
        watch.progressed()
        assert watch.stalled() is None


def test_a_limit_sized_from_the_longest_step_is_ten_times_it_and_never_under_a_minute() -> None:
    assert stall_limit(0.1) == 60  # a GPU's or a tiny model's step: timing noise is no hung engine
    assert stall_limit(6.0) == 60
    assert stall_limit(30.0) == 300  # a long prefill chunk on CPU
