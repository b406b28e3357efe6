"""The scheduling decision (cluster.fair_share.decide): fair share by weight, caps,
priority order and preemption, each with the exact slots and trials it must give."""

from __future__ import annotations

import dataclasses

from cluster.fair_share import JobDemand, decide, queue_order

MIN_RUNTIME_S = 30.0


def _settle(jobs: dict[str, JobDemand], capacity: int, now: float = 0.0) -> dict[str, int]:
    """Apply decisions until nothing changes; returns the slots each job holds."""
    for _ in range(20):
        decision = decide(list(jobs.values()), capacity, now, MIN_RUNTIME_S)
        if not decision.grants:
            break
        for key, trials in decision.grants.items():
            job = jobs[key]
            running = dict(job.running) | {t: now for t in trials}
            waiting = tuple(t for t in job.waiting if t not in trials)
            jobs[key] = dataclasses.replace(job, running=running, waiting=waiting)
    return {key: job.held for key, job in jobs.items()}


def test_weights_one_and_three_share_four_slots_as_one_and_three() -> None:
    jobs = {
        "a": JobDemand("a", weight=1, waiting=(1, 2, 3, 4), submitted=0),
        "b": JobDemand("b", weight=3, waiting=(1, 2, 3, 4), submitted=1),
    }
    assert _settle(jobs, capacity=4) == {"a": 1, "b": 3}


def test_every_freed_slot_goes_to_the_experiment_furthest_below_its_share() -> None:
    # a came first and holds all 4; b (weight 3) arrives: nobody is preempted within one
    # priority, and each slot a frees goes to b until b holds 3.
    a = JobDemand("a", weight=1, running={1: 0, 2: 0, 3: 0, 4: 0}, waiting=(5, 6, 7, 8))
    b = JobDemand("b", weight=3, waiting=(1, 2, 3, 4), submitted=1)
    decision = decide([a, b], 4, now=100, min_runtime_s=MIN_RUNTIME_S)
    assert decision.grants == {} and decision.preempt == {}
    assert "waiting for a slot" in decision.reasons["b"]
    held = []
    for finished in (1, 2, 3, 4):
        running = dict(a.running)
        del running[finished]
        a = dataclasses.replace(a, running=running)
        decision = decide([a, b], 4, now=100, min_runtime_s=MIN_RUNTIME_S)
        for key, trials in decision.grants.items():
            job = a if key == "a" else b
            job = dataclasses.replace(
                job,
                running=dict(job.running) | {t: 100.0 for t in trials},
                waiting=tuple(t for t in job.waiting if t not in trials),
            )
            a, b = (job, b) if key == "a" else (a, job)
        held.append((a.held, b.held))
    assert held == [(3, 1), (2, 2), (1, 3), (1, 3)]


def test_a_share_one_experiment_cannot_use_goes_to_the_others() -> None:
    jobs = {
        "capped": JobDemand("capped", max_slots=1, waiting=(1, 2, 3)),
        "small": JobDemand("small", waiting=(1,), submitted=1),
        "big": JobDemand("big", waiting=(1, 2, 3, 4), submitted=2),
    }
    assert _settle(jobs, capacity=5) == {"capped": 1, "small": 1, "big": 3}
    decision = decide(list(jobs.values()), 5, 0, MIN_RUNTIME_S)
    assert decision.reasons["capped"] == "at its resources.max_slots (1 slot(s) held)"


def test_more_urgent_work_takes_free_slots_first_whoever_came_first() -> None:
    early = JobDemand("early", priority=42, waiting=(1, 2), submitted=0)
    urgent = JobDemand("urgent", priority=1, waiting=(1,), submitted=5)
    decision = decide([early, urgent], 2, now=0, min_runtime_s=MIN_RUNTIME_S)
    assert decision.grants == {"urgent": [1], "early": [1]}


def test_urgent_work_preempts_the_newest_least_urgent_trial_after_the_minimum_runtime() -> None:
    low = JobDemand("low", priority=60, running={1: 0.0, 2: 10.0})
    mid = JobDemand("mid", priority=42, running={1: 0.0}, submitted=1)
    urgent = JobDemand("urgent", priority=1, waiting=(1,), submitted=2)
    # At 35 s, trial 2 of low has run 25 s: too soon; trial 1 (35 s) gives way.
    decision = decide([low, mid, urgent], 3, now=35.0, min_runtime_s=MIN_RUNTIME_S)
    assert decision.preempt == {"low": [1]}
    assert decision.grants == {}
    # At 45 s both of low's trials may go: the newest goes first.
    decision = decide([low, mid, urgent], 3, now=45.0, min_runtime_s=MIN_RUNTIME_S)
    assert decision.preempt == {"low": [2]}


def test_nothing_is_preempted_before_the_minimum_runtime_or_twice() -> None:
    low = JobDemand("low", priority=60, running={1: 0.0, 2: 0.0})
    urgent = JobDemand("urgent", priority=1, waiting=(1,), submitted=1)
    too_soon = decide([low, urgent], 2, now=29.0, min_runtime_s=MIN_RUNTIME_S)
    assert too_soon.preempt == {}
    assert too_soon.reasons["urgent"] == (
        "waiting for a slot: 0 experiment(s) ahead at priority 1 or more urgent; less "
        "urgent trials give way once they have run 30 s"
    )
    asked = dataclasses.replace(low, preempting=frozenset({2}))
    assert decide([asked, urgent], 2, now=60.0, min_runtime_s=MIN_RUNTIME_S).preempt == {}


def test_equal_priorities_never_preempt_each_other() -> None:
    a = JobDemand("a", running={1: 0.0, 2: 0.0})
    b = JobDemand("b", waiting=(1,), submitted=1)
    assert decide([a, b], 2, now=1000.0, min_runtime_s=MIN_RUNTIME_S).preempt == {}


def test_less_urgent_work_does_not_take_a_slot_more_urgent_work_waits_for() -> None:
    # The urgent trial needs 2 GPUs and 1 is free: the less urgent 1-GPU trial must not
    # take it, or the urgent one would wait behind it for good.
    holder = JobDemand("holder", priority=60, need=1, running={1: 0.0})
    urgent = JobDemand("urgent", priority=1, need=2, waiting=(1,), submitted=1)
    filler = JobDemand("filler", priority=42, need=1, waiting=(1,), submitted=2)
    decision = decide([holder, urgent, filler], 2, now=5.0, min_runtime_s=MIN_RUNTIME_S)
    assert decision.grants == {}
    assert "filler" in decision.reasons


def test_the_queue_order_is_priority_then_share_then_age() -> None:
    jobs = [
        JobDemand("late", priority=42, submitted=3),
        JobDemand("busy", priority=42, running={1: 0.0}, submitted=1),
        JobDemand("urgent", priority=5, submitted=4),
        JobDemand("early", priority=42, submitted=2),
    ]
    assert [j.key for j in queue_order(jobs)] == ["urgent", "early", "late", "busy"]
