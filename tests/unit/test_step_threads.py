"""The thread count of one-row steps, learned from the intervals between steps as they are served."""
from __future__ import annotations

import logging

import pytest

from llama_engine.backends.step_threads import OneRowThreadTuner


class Serving:
    """Steps through a tuner on a fake clock: a one-row step on ``threads`` lasts ``costs[threads]``."""

    def __init__(self, costs, **tuner_args):
        self.costs, self.now = costs, 0.0
        self.tuner = OneRowThreadTuner(tuple(costs), clock=lambda: self.now, **tuner_args)
        self.ran = []

    def step(self, one_row=True, cost=None):
        threads = self.tuner.threads_for_step(one_row)
        self.ran.append(threads)
        self.now += self.costs[threads] if cost is None else cost
        return threads


@pytest.mark.parametrize("costs,kept", [({2: 8e-3, 1: 10e-3}, 2), ({2: 10e-3, 1: 8e-3}, 1)])
def test_keeps_the_count_whose_steps_came_faster(costs, kept, caplog):
    serving = Serving(costs, block=3, rounds=2)
    with caplog.at_level(logging.INFO, logger="llama_engine"):
        for _ in range(13):  # 12 intervals: 2 rounds of a block of 3 on each count
            serving.step()
    assert serving.ran[:12] == [2, 2, 2, 1, 1, 1, 2, 2, 2, 1, 1, 1], "blocks alternate, the first count first"
    assert not serving.tuner.trying and serving.tuner.current == kept
    assert serving.tuner.decisions == [(kept, pytest.approx(costs))]
    assert serving.step() == kept
    # the bench keeps the lines that start this way as each worker's choices (scripts/bench/choices.py)
    assert (f"decode_threads auto: one-row steps as served came every {1e3 * costs[2]:.2f} ms on 2 threads, "
            f"{1e3 * costs[1]:.2f} ms on 1 thread (medians of 6); {kept} for one token") in caplog.text


def test_a_count_clearly_slower_after_one_block_each_ends_the_trial_early(caplog):
    serving = Serving({2: 8e-3, 1: 14e-3}, block=3, rounds=3)  # one thread 1.75x as long a step
    with caplog.at_level(logging.INFO, logger="llama_engine"):
        for _ in range(7):  # 6 intervals: one block on each count
            serving.step()
    assert not serving.tuner.trying and serving.tuner.current == 2
    assert serving.ran == [2, 2, 2, 1, 1, 1, 2], "after one block each, not the 3 rounds planned"
    assert serving.tuner.decisions == [(2, {2: pytest.approx(8e-3), 1: pytest.approx(14e-3)})]
    assert "(medians of 3); 2 for one token" in caplog.text
    close = Serving({2: 8e-3, 1: 11e-3}, block=3, rounds=3)  # 1.375x: under clear_ratio, every round runs
    for _ in range(19):
        close.step()
    assert close.ran[:18] == [2, 2, 2, 1, 1, 1] * 3 and close.tuner.decisions[0][0] == 2


def test_the_trial_ends_early_only_at_the_end_of_a_round():
    """Every count has had as many blocks when it stops, so each median is of as many steps."""
    serving = Serving({2: 10e-3, 1: 8e-3}, block=3, rounds=3)  # 1.25x: no early stop after round 1
    for _ in range(6):
        serving.step()
    serving.costs = {2: 30e-3, 1: 8e-3}  # round 2's block on 2 threads: its median 2.5x the other's
    for _ in range(6):
        serving.step()
    assert serving.tuner.trying, "not in the middle of round 2"
    serving.step()
    assert not serving.tuner.trying and serving.ran == [2, 2, 2, 1, 1, 1] * 2 + [1]
    assert {t: len(times) for t, times in serving.tuner._samples.items()} == {2: 6, 1: 6}


def test_only_a_one_row_step_followed_by_another_counts():
    serving = Serving({2: 5e-3, 1: 6e-3}, block=2, rounds=1)
    serving.step()
    serving.step(one_row=False, cost=1.0)  # a prompt or a step of several rows: neither interval counts
    serving.step(cost=2.0)  # the first of a run of one-row steps: counted as the next starts (a stall)
    serving.step()
    serving.step()
    assert serving.tuner._samples[2] == [2.0, pytest.approx(5e-3)]
    serving.step(one_row=False)
    serving.now += 30.0  # idle: nothing to serve
    for _ in range(3):
        serving.step()
    assert serving.tuner._samples[1] == [pytest.approx(6e-3)] * 2, "nor the idle gap after a prompt"
    assert serving.tuner.decisions == [(1, {2: pytest.approx(1.0025), 1: pytest.approx(6e-3)})]


def test_compares_again_after_recheck_after_steps_starting_with_the_count_it_kept():
    serving = Serving({2: 10e-3, 1: 8e-3}, block=2, rounds=1, recheck_after=5)
    for _ in range(5):
        serving.step()
    assert serving.tuner.current == 1 and not serving.tuner.trying
    serving.costs = {2: 6e-3, 1: 8e-3}  # the host's load moved
    for _ in range(5):
        serving.step()
    assert serving.tuner.trying and serving.ran[-1] == 1
    for _ in range(4):
        serving.step()
    assert serving.ran[-5:] == [1, 1, 2, 2, 2], "the kept count first, then the other; 2 kept"
    assert [kept for kept, _ in serving.tuner.decisions] == [1, 2]


@pytest.mark.parametrize("candidates,args,message", [
    ((2,), {}, "candidates: need two different thread counts"),
    ((2, 2), {}, "candidates: need two different thread counts"),
    ((2, 1), {"block": 0}, "must be >= 1"),
    ((2, 1), {"clear_ratio": 1.0}, "clear_ratio must be > 1"),
])
def test_bad_arguments_say_which(candidates, args, message):
    with pytest.raises(ValueError, match=message):
        OneRowThreadTuner(candidates, **args)
