"""Planned device memory (trace, plan, serve, pin, retire) on a fake device: no GPU needed.

A run is simulated as the executor drives it: requests are made during steps (feeds before step
0), the holder drops each block after the step the program says, and the manager checks the run
when it ends. Every test also checks that no two blocks alive at the same time share a byte.
"""

from __future__ import annotations

import dataclasses
import gc

import pytest

from gradgen.executor.device_memory import (
    ARENA_GRANULE,
    FEED_STEP,
    ArenaHost,
    FreeList,
    MemoryManager,
    release_frames,
)
from gradgen.executor.memory_plan import aligned

POOL_BASE = 1 << 50


class FakeAllocation(int):
    def __new__(cls, address, nbytes, ledger):
        self = int.__new__(cls, address)
        self.nbytes, self.ledger = nbytes, ledger
        ledger[int(self)] = nbytes
        return self

    def __del__(self):
        self.ledger.pop(int(self), None)


class FakeDevice:
    """Arenas at distinct high addresses; the pool hands out fresh addresses and never reuses them."""

    def __init__(self):
        self.arenas: dict[int, int] = {}  # live reserved allocations: address -> bytes
        self.pool: dict[int, int] = {}
        self.next_arena = 1 << 40
        self.next_pool = POOL_BASE
        self.released = 0

    def reserve(self, nbytes):
        if nbytes <= 0:
            raise ValueError("cuMemAlloc failed: invalid argument")  # as the driver answers 0 bytes
        address, self.next_arena = self.next_arena, self.next_arena + (1 << 36)
        return FakeAllocation(address, nbytes, self.arenas)

    def pool_allocate(self, nbytes):
        address, self.next_pool = self.next_pool, self.next_pool + aligned(max(nbytes, 1))
        return FakeAllocation(address, nbytes, self.pool)

    def release_held(self):
        self.released += 1

    def pool_bytes(self):
        return sum(self.pool.values())


@dataclasses.dataclass
class Request:
    step: int  # FEED_STEP for a feed
    nbytes: int
    last: int  # the holder drops it after this step (num_steps: at the end of the run)


# A small training-like program over 6 steps: feeds, saved activations, temporaries, outputs.
PROGRAM = [
    Request(FEED_STEP, 4096, 0),  # a feed: planned to live all run whatever its holder does
    Request(0, 100_000, 4),  # activation saved for the backward
    Request(0, 3000, 0),  # scratch inside step 0
    Request(1, 50_000, 2),
    Request(1, 100_000, 3),
    Request(2, 20_000, 5),
    Request(3, 100_000, 4),
    Request(4, 100_000, 6),  # an output (lives to the end)
    Request(5, 256, 5),
]
STEPS = 6


class Holder:
    """Drives one run: allocates the program's requests and drops them on time; checks overlaps."""

    def __init__(self, manager, signature, program=PROGRAM, steps=STEPS, hold_longer=None, in_place=None):
        self.manager, self.signature = manager, signature
        self.program, self.steps = program, steps
        self.hold_longer = hold_longer or {}  # request index -> step after which it is really dropped
        self.in_place = in_place or {}  # request index -> the request index it may be written over
        self.addresses: dict[int, tuple[int, int]] = {}

    def _check_no_overlap(self, live):
        over = set(self.in_place.values())  # the step writing in place reads each element first
        spans = sorted((int(b), int(b) + aligned(self.program[i].nbytes)) for i, b in live.items() if i not in over)
        for (s1, e1), (s2, e2) in zip(spans, spans[1:]):
            assert e1 <= s2, f"blocks overlap: [{s1}, {e1}) and [{s2}, {e2})"

    def run(self, end=True):
        run = self.manager.begin(self.signature, self.steps)
        live = {}
        for step in [FEED_STEP] + list(range(self.steps)):
            if step >= 0:
                run.advance(step)
            for index, request in enumerate(self.program):
                if request.step == step:
                    live[index] = run.allocate(request.nbytes)
                    self.addresses[index] = (int(live[index]), request.nbytes)
                    source = self.in_place.get(index)
                    if source in live:
                        run.note_in_place([self.addresses[index]], [self.addresses[source]])
                    self._check_no_overlap(live)
            for index in [i for i in live if self.hold_longer.get(i, self.program[i].last) == step]:
                del live[index]
        run.end_of_steps()
        if end:
            live.clear()
            self.manager.end(run, self.signature)
        return run, live

    def in_arena(self, index) -> bool:
        arena = self.manager.host.arena
        address, nbytes = self.addresses[index]
        return arena is not None and arena.base <= address and address + nbytes <= arena.base + arena.nbytes


@pytest.fixture
def device():
    return FakeDevice()


@pytest.fixture
def manager(device):
    return MemoryManager(device, host=ArenaHost(device))


def test_first_run_is_traced_then_later_runs_are_served_from_the_plan(manager, device):
    run, _ = Holder(manager, "sig").run()
    assert run.tracing and run.arena is None  # no arena yet: the traced run used the pool
    assert len(device.arenas) == 1  # ...and sized one for its plan when it ended
    plan = manager.plans["sig"]
    assert plan.requests == len(PROGRAM)
    assert plan.peak_live <= plan.size < sum(aligned(r.nbytes) for r in PROGRAM)
    holder = Holder(manager, "sig")
    for _ in range(3):
        run, _ = holder.run()
        assert not run.tracing and run.fallbacks == 0 and run.served == len(PROGRAM)
        assert all(holder.in_arena(i) for i in range(len(PROGRAM)))
        assert not run.pinned and run.arena_blocks_alive() == 0
    assert manager.host.arena.nbytes == -(-plan.size // ARENA_GRANULE) * ARENA_GRANULE
    assert manager.leaks == 0


def test_feeds_are_planned_for_the_whole_run(manager):
    Holder(manager, "sig").run()
    (slot,) = [s for key, s in manager.plans["sig"].slots.items() if key[0] == FEED_STEP]
    assert slot.last == STEPS


def test_a_block_held_past_its_plan_is_pinned_and_nothing_is_served_over_it(manager):
    Holder(manager, "sig").run()
    # Request 2 (step-0 scratch) is still held until step 4: its bytes may be planned for later
    # requests, which must then come from the pool.
    holder = Holder(manager, "sig", hold_longer={2: 4, 3: 5})
    run, _ = holder.run()
    assert run.arena_blocks_alive() == 0 and manager.leaks == 0
    # No overlap was seen by the holder's checks, whatever was served from where.
    served = [i for i in range(len(PROGRAM)) if holder.in_arena(i)]
    assert len(served) + run.fallbacks == len(PROGRAM)


def test_pinning_sends_a_planned_request_to_the_pool(manager):
    program = [Request(0, 1000, 0), Request(1, 1000, 1)]  # the plan puts both at offset 0
    Holder(manager, "p", program, 2).run()
    slots = manager.plans["p"].slots
    assert slots[(0, 1000, 0)].offset == slots[(1, 1000, 0)].offset == 0
    holder = Holder(manager, "p", program, 2, hold_longer={0: 1})
    run, _ = holder.run()
    assert run.fallbacks == 1 and holder.in_arena(0) and not holder.in_arena(1)
    assert manager.leaks == 0  # both were dropped by the end


def test_a_block_alive_after_the_run_retires_the_arena(manager, device):
    Holder(manager, "sig").run()
    Holder(manager, "sig").run()
    arena = manager.host.arena
    run, live = Holder(manager, "sig").run(end=False)
    leaked = live.pop(7)  # the output: held past the end of the run
    live.clear()
    retired = []
    manager.on_arena_retired(lambda: retired.append(True))
    manager.end(run, "sig")
    assert manager.leaks == 1 and retired and manager.host.arena is None
    assert int(leaked) in range(arena.base, arena.base + arena.nbytes)
    assert arena.base in device.arenas  # the retired arena stays allocated while the block lives
    holder = Holder(manager, "sig")
    holder.run()  # a new arena serves the next run, away from the leaked block
    assert all(holder.in_arena(i) for i in range(len(PROGRAM)))
    assert manager.host.arena is not arena
    del leaked, arena, run  # the run's record holds its arena too
    gc.collect()
    assert len(device.arenas) == 1


def test_an_unknown_request_goes_to_the_pool(manager):
    Holder(manager, "sig").run()
    program = PROGRAM + [Request(2, 777, 3)]
    holder = Holder(manager, "sig", program)
    run, _ = holder.run()
    assert run.fallbacks == 1 and not holder.in_arena(len(PROGRAM))


def test_traced_runs_reuse_the_arena_once_there_is_one(manager, device):
    Holder(manager, "a").run()  # traced: its plan sizes the arena
    pool_before = device.next_pool
    small = [Request(0, 5000, 1), Request(1, 5000, 2)]
    holder = Holder(manager, "b", small, 3)
    run, _ = holder.run()
    assert run.tracing and holder.in_arena(0) and holder.in_arena(1)
    assert device.next_pool == pool_before  # nothing came from the pool


def test_two_sessions_share_one_arena_sized_for_the_larger(device):
    host = ArenaHost(device)
    small, big = MemoryManager(device, host=host), MemoryManager(device, host=host)
    Holder(small, "s", [Request(0, 10_000, 1)], 2).run()
    Holder(small, "s", [Request(0, 10_000, 1)], 2).run()
    first = host.arena
    dropped = []
    small.on_arena_retired(lambda: dropped.append("small"))
    big_program = [Request(0, 5 * ARENA_GRANULE, 1)]
    Holder(big, "b", big_program, 2).run()
    Holder(big, "b", big_program, 2).run()
    assert host.arena is not first and host.arena.nbytes == 5 * ARENA_GRANULE and dropped == ["small"]
    Holder(small, "s", [Request(0, 10_000, 1)], 2).run()
    assert host.arena.nbytes == 5 * ARENA_GRANULE  # the small one runs inside the big arena
    del first
    assert len(device.arenas) == 1  # the first arena is gone: the two never coexisted after the switch
    big.close()
    Holder(small, "s", [Request(0, 10_000, 1)], 2).run()
    assert host.arena.nbytes == ARENA_GRANULE  # shrunk once the big one left
    del big
    small.close()
    assert host.arena is None
    gc.collect()
    assert not device.arenas


def test_a_collected_manager_leaves_the_host(device):
    host = ArenaHost(device)
    manager = MemoryManager(device, host=host)
    Holder(manager, "s", [Request(0, 10_000, 1)], 2).run()
    Holder(manager, "s", [Request(0, 10_000, 1)], 2).run()
    assert host.arena is not None
    del manager
    gc.collect()
    assert host.arena is None and not host.needs
    gc.collect()
    assert not device.arenas


def test_plans_are_bounded(device):
    manager = MemoryManager(device, host=ArenaHost(device), max_plans=3)
    for length in range(5):
        Holder(manager, length, [Request(0, 1000 * (length + 1), 0)], 1).run()
    assert list(manager.plans) == [2, 3, 4]


def test_an_abandoned_run_keeps_no_plan(manager):
    holder = Holder(manager, "sig")
    run, live = holder.run(end=False)
    live.clear()
    manager.abandon(run)
    assert "sig" not in manager.plans and manager.leaks == 0


def test_release_frames_lets_a_failed_runs_blocks_go(manager):
    Holder(manager, "x", [Request(0, 1000, 1)], 2).run()
    run = manager.begin("x", 2)

    def failing_step():
        block = run.allocate(1000)  # noqa: F841 - held by this frame only
        raise RuntimeError("boom")

    run.advance(0)
    try:
        failing_step()
    except RuntimeError as exc:
        assert run.arena_blocks_alive() == 1
        release_frames(exc)
        assert run.arena_blocks_alive() == 0


def test_free_list_best_fit_and_coalescing():
    free = FreeList(1000)
    a, b, c = free.take(100), free.take(300), free.take(100)
    assert (a, b, c) == (0, 100, 400)
    free.give(0, 100)
    free.give(400, 500)
    assert free.take(80) == 0  # the 100-byte hole at 0 fits tighter than the 600 bytes from 400
    free.give(0, 80)
    free.give(100, 400)
    assert free.free == [[0, 1000]]
    assert free.take(2000) is None


def test_a_recorded_run_that_pinned_blocks_teaches_the_plan(manager):
    program = [Request(0, 1000, 0), Request(1, 1000, 1)]  # both planned at offset 0
    Holder(manager, "p", program, 2).run()
    # A recorded run: request 0 is kept (a deferred check holds it) until the run ends.
    run, live = Holder(manager, "p", program, 2, hold_longer={0: 2}).run(end=False)
    assert run.pinned_keys == {(0, 1000, 0)} and run.fallbacks == 1
    manager.end(run, "p", graph_owned=True)
    assert manager.learn_from(run, "p")
    plan = manager.plans["p"]
    assert plan.slots[(0, 1000, 0)].last == 2 and plan.slots[(0, 1000, 0)].offset != plan.slots[(1, 1000, 0)].offset
    assert not manager.learn_from(run, "p")  # the plan already changed: learn once per run
    live.clear()
    run, _ = Holder(manager, "p", program, 2, hold_longer={0: 2}).run()
    assert run.fallbacks == 0 and not run.pinned_keys


def test_an_arena_that_cannot_be_allocated_is_a_run_error(device):
    from gradgen.errors import RunError

    def refuse(nbytes):
        raise MemoryError("cuMemAlloc failed: out of memory")

    device.reserve = refuse
    manager = MemoryManager(device, host=ArenaHost(device))
    Holder(manager, "s", [Request(0, 10_000, 1)], 2).run()
    with pytest.raises(RunError, match="could not allocate the 2 MiB device arena"):
        manager.begin("s", 2)


def test_a_traced_block_held_by_a_reference_cycle_is_still_planned(manager):
    run = manager.begin("cyc", 2)
    run.advance(0)

    class Cycle:
        pass

    holder = Cycle()
    holder.me, holder.block = holder, run.allocate(5000)  # only the garbage collector frees it
    del holder
    run.advance(1)
    run.end_of_steps()
    gc.disable()
    try:
        manager.end(run, "cyc")
    finally:
        gc.enable()
    assert manager.plans["cyc"].slots  # collected at the end of the run: planned (to the end)


def test_a_signature_that_allocates_nothing_needs_no_arena(manager, device):
    """A plan of size 0 (views and host-side steps only) runs without asking the driver for 0 bytes."""
    holder = Holder(manager, "empty", program=[], steps=2)
    for _ in range(3):
        run, _ = holder.run()
        assert run.fallbacks == 0
    assert manager.plans["empty"].size == 0 and not device.arenas and manager.leaks == 0


def test_an_output_over_an_input_dying_at_its_step_shares_the_inputs_bytes(manager):
    program = [Request(0, 8000, 1), Request(1, 8000, 2), Request(2, 8000, 3), Request(3, 100, 4)]
    # request 1 (an elementwise op at step 1) may overwrite request 0, which dies there; request 2
    # may overwrite request 1 too: one buffer for the chain.
    Holder(manager, "chain", program, 5, in_place={1: 0, 2: 1}).run()
    plan = manager.plans["chain"]
    offsets = {plan.slots[(s, n, 0)].offset for s, n in ((0, 8000), (1, 8000), (2, 8000))}
    assert len(offsets) == 1 and plan.aliased == 2
    assert plan.size == aligned(8000) + aligned(100) and plan.peak_live == plan.size
    served = Holder(manager, "chain", program, 5, in_place={1: 0, 2: 1})
    run, _ = served.run()
    assert run.served == 4 and run.fallbacks == 0
    assert served.addresses[0][0] == served.addresses[1][0] == served.addresses[2][0]


def test_an_input_still_needed_after_the_step_is_not_overwritten(manager):
    program = [Request(0, 8000, 2), Request(1, 8000, 2), Request(2, 100, 3)]  # request 0 is read at step 2 too
    Holder(manager, "kept", program, 4, in_place={1: 0}).run()
    plan = manager.plans["kept"]
    assert plan.aliased == 0
    assert plan.slots[(0, 8000, 0)].offset != plan.slots[(1, 8000, 0)].offset


def test_in_place_needs_the_same_size_and_an_input_made_before_the_step(manager):
    program = [Request(0, 8000, 1), Request(1, 4000, 2), Request(1, 256, 1), Request(1, 256, 2)]
    # a smaller output may not take a bigger input's bytes; nor an output a same-step scratch's
    Holder(manager, "mixed", program, 3, in_place={1: 0, 3: 2}).run()
    assert manager.plans["mixed"].aliased == 0


def test_a_pinned_input_learned_by_the_plan_ends_the_alias(manager):
    program = [Request(0, 8000, 1), Request(1, 8000, 2), Request(2, 100, 2)]
    Holder(manager, "p", program, 3, in_place={1: 0}).run()
    plan = manager.plans["p"]
    assert plan.aliased == 1
    longer = plan.extended({(0, 8000, 0)})  # request 0 kept to the end of the run (a deferred check)
    assert longer.aliased == 0
    assert longer.slots[(0, 8000, 0)].offset != longer.slots[(1, 8000, 0)].offset
