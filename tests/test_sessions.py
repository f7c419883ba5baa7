import pytest
from conftest import Clock, until

from specsplit.serving.sessions import SessionEnded, SessionExists, SessionNotFound, SessionTable, TableFull


def test_put_get_pop():
    table = SessionTable[str](max_sessions=2, idle_timeout_s=10)
    table.put("a", "A")
    assert table.get("a") == "A"
    with pytest.raises(SessionExists):
        table.put("a", "again")
    assert table.pop("a") == "A"
    assert table.pop("a") is None
    with pytest.raises(SessionNotFound):
        table.get("a")


def test_full_table_evicts_only_idle_sessions():
    clock = Clock()
    table = SessionTable[str](max_sessions=2, idle_timeout_s=10, clock=clock)
    table.put("a", "A")
    clock.now = 5
    table.put("b", "B")
    with pytest.raises(TableFull):
        table.put("c", "C")  # nobody idle long enough
    clock.now = 12
    table.put("c", "C")  # "a" idle for 12 s is evicted
    assert "a" not in table and "b" in table and "c" in table


def test_evicted_states_go_to_their_owners_callback_and_released_ones_do_not():
    """An evicted session's state must be ended as a release ends it (its KV budget, its segment,
    its drafter's session): the table hands each one to the callback, once; pop leaves it to the
    caller."""
    clock = Clock()
    table = SessionTable[str](max_sessions=2, idle_timeout_s=10, clock=clock)
    ended = []
    table.when_evicted(lambda sid, state: ended.append((sid, state)))
    table.put("a", "A")
    table.put("b", "B")
    assert table.pop("b") == "B" and ended == []
    table.put("b", "B2")
    clock.now = 11
    table.get("b")
    table.put("c", "C")  # room needed: "a" idle for 11 s goes
    assert ended == [("a", "A")]
    clock.now = 30
    assert table.evict_idle() == ["b", "c"] and ended == [("a", "A"), ("b", "B2"), ("c", "C")]
    assert table.evict_idle() == [] and len(ended) == 3


def test_use_refreshes_idle_time():
    clock = Clock()
    table = SessionTable[str](max_sessions=4, idle_timeout_s=10, clock=clock)
    table.put("a", "A")
    clock.now = 8
    table.get("a")
    clock.now = 15
    assert table.evict_idle() == []
    clock.now = 19
    assert table.evict_idle() == ["a"]


async def test_sweep_evicts_idle_sessions_in_the_background():
    import asyncio

    clock = Clock()
    table = SessionTable[str](max_sessions=4, idle_timeout_s=10, clock=clock)
    table.put("a", "A")
    sweeper = asyncio.create_task(table.sweep(0.01))
    clock.now = 11
    await until(lambda: "a" not in table, "the sweeper ending the idle session", 30, every_s=0.01)
    sweeper.cancel()
    assert "a" not in table


def test_a_start_that_arrives_after_its_end_is_refused():
    """A caller that gave up on a slow start ends the session; the start may still arrive later
    (a stalled service resumes) and must not leave an orphan behind."""
    from specsplit.serving import sessions

    table = SessionTable(max_sessions=4, idle_timeout_s=60)
    assert table.pop("late") is None  # ended before it started
    with pytest.raises(SessionEnded):
        table.put("late", "state")
    assert len(table) == 0
    table.put("late", "state")  # refused once only: the id is forgotten after that
    assert table.pop("late") == "state"
    for i in range(sessions.ENDED_MEMORY + 1):  # the memory is bounded
        table.pop(f"gone-{i}")
    table.put("gone-0", "state")  # the oldest was forgotten
    with pytest.raises(SessionEnded):
        table.put(f"gone-{sessions.ENDED_MEMORY}", "state")
