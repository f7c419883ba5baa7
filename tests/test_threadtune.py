"""The team size per forward follows the scheduler: a busy neighbour that parks the team's threads
halves it, the CPUs coming back restore it, and a short call or a noisy forward changes nothing."""

from __future__ import annotations

from conftest import Clock

from specsplit.serving.threadtune import ThreadTuner


def drive(tuner: ThreadTuner, clock: Clock, share: dict[int, float], forwards: int, wall_s: float = 0.02) -> list:
    """`forwards` forwards of wall_s each, whose leader runs share[size] of the time; the sizes used."""
    used = []
    for _ in range(forwards):
        size = tuner.size()
        tuner.record(size, wall_s, share[size] * wall_s)
        clock.now += wall_s
        used.append(size)
    return used


def test_sizes_halve_from_the_most():
    assert ThreadTuner(8, lambda n: None).sizes == [8, 4, 2, 1]
    assert ThreadTuner(6, lambda n: None).sizes == [6, 3, 1]
    assert ThreadTuner(1, lambda n: None).sizes == [1]


def test_a_busy_neighbour_halves_the_team_and_its_leaving_restores_it():
    clock, applied = Clock(), []
    tuner = ThreadTuner(2, applied.append, clock=clock)
    quiet, busy = {2: 1.0, 1: 1.0}, {2: 0.5, 1: 1.0}
    assert drive(tuner, clock, quiet, 100) == [2] * 100  # quiet: every forward on all, no tries
    used = drive(tuner, clock, busy, 200)  # 4 s busy
    assert used[:2] == [2, 2] and tuner.current == 1  # halved after two starved forwards
    tries = used[2:].count(2)
    assert 1 <= tries <= 3  # tries 1 s, then 2 s apart: each costs one slow forward
    used = drive(tuner, clock, quiet, 250)  # 5 s quiet: the next try (<= 4 s away) succeeds
    assert tuner.current == 2 and used[-1] == 2
    assert (tuner.halvings, tuner.raises) == (1, 1)
    assert applied[0] == 2 and applied[-1] == 2  # the first forward sets its size, then only changes do
    assert all(a != b for a, b in zip(applied, applied[1:]))


def test_contention_that_comes_and_goes_is_tried_less_and_less_often():
    """Each try succeeds (a quiet moment) and the team is starved again at once: the waits grow
    to max_probe_s instead of a round trip every first_probe_s."""
    clock = Clock()
    tuner = ThreadTuner(2, lambda n: None, clock=clock)
    raised_at = []
    for _ in range(4000):  # 80 s of forwards: a try runs quiet, the rest starved
        size = tuner.size()
        tuner.record(size, 0.02, 0.02 if size == 2 and tuner.current == 1 else 0.01 if size == 2 else 0.02)
        if tuner.raises > len(raised_at):
            raised_at.append(clock.now)
        clock.now += 0.02
    gaps = [b - a for a, b in zip(raised_at, raised_at[1:])]
    assert len(raised_at) <= 24 and gaps[-1] >= tuner.max_probe_s, raised_at  # not every second or two
    assert tuner.halvings in (len(raised_at), len(raised_at) + 1)


def test_short_calls_and_a_lone_slow_forward_change_nothing():
    clock = Clock()
    tuner = ThreadTuner(4, lambda n: None, clock=clock)
    drive(tuner, clock, {4: 0.1}, 50, wall_s=0.0005)  # no model work in these calls
    assert tuner.current == 4
    for share in (0.5, 1.0, 1.0, 0.5, 1.0, 1.0):  # one starved forward in three: noise
        tuner.record(tuner.size(), 0.02, share * 0.02)
    assert tuner.current == 4
    drive(tuner, clock, {4: 0.5, 2: 0.5, 1: 1.0}, 6)  # starved at 4, then at 2: down the ladder
    assert tuner.current == 1


def test_the_worker_runs_each_batch_on_the_tuners_size_and_reports_back(monkeypatch):
    """Through the worker: a batch runs on the size the tuner set (torch's own thread count in the
    worker thread, which the native kernels' team takes), and its wall and CPU time go back. The
    worker reads a clock the runner moves, so the leader's share is the runner's, not this
    machine's scheduling (a busy neighbour would preempt a real busy loop)."""
    import asyncio
    import types

    import torch

    from specsplit.serving import worker as worker_module
    from specsplit.serving.worker import ModelWorker

    clock = [0.0]
    monkeypatch.setattr(worker_module, "time", types.SimpleNamespace(perf_counter=lambda: clock[0],
                                                                     thread_time=lambda: clock[0]))
    before = torch.get_num_threads()  # the tuner sets torch's count: put back for the tests after this one
    tuner = ThreadTuner(2, torch.set_num_threads, first_probe_s=0)
    for _ in range(2):
        tuner.record(2, 0.02, 0.01)  # two starved forwards: halved, a try at 2 due at once
    assert tuner.current == 1
    worker = ModelWorker("test")
    worker.tuner = tuner

    def runner(items):
        clock[0] += 0.01  # 10 ms of forward, all of it run by the leader: a forward, not a short call
        return [torch.get_num_threads() for _ in items]

    async def one():
        return await worker.run_gathered(runner, 0)

    try:
        assert asyncio.run(one()) == 2  # the try ran on two threads
        assert tuner.current == 2 and tuner.raises == 1  # and its leader's full share came back
    finally:
        worker.shutdown()
        torch.set_num_threads(before)


def test_a_reduced_team_tries_again_as_soon_as_the_cpus_it_gave_up_sit_idle():
    """A co-located drafter computed beside the verifier and the team halved; the drafter stops and
    the other CPU sits idle: the try comes after one idle window (0.1 s), not after the wait (1 s,
    more after failed tries), which would outlast a whole request on half the team. A busy neighbour
    keeps that CPU busy, and tries stay on the wait."""
    for neighbour_busy in (False, True):
        clock, idle = Clock(), [0.0]
        tuner = ThreadTuner(2, lambda n: None, clock=clock, idle=lambda: idle[0])
        for _ in range(2):
            tuner.record(tuner.size(), 0.02, 0.01)  # two starved forwards: halved
            clock.now += 0.02
        assert tuner.current == 1
        used = []
        for _ in range(25):  # 0.5 s on one thread; the other CPU idle unless the neighbour is busy
            size = tuner.size()
            tuner.record(size, 0.02, 0.02)
            clock.now += 0.02
            idle[0] += 0.0 if neighbour_busy else 0.02
            used.append(size)
        if neighbour_busy:
            assert used.count(2) == 0 and tuner.current == 1  # the next try is 1 s away
        else:
            assert tuner.current == 2 and used.index(2) <= 8, used  # after one window of 0.1 s
