"""Planned device memory: the first run of a shape is traced, later runs are served from a plan.

The steps of a Session run in a fixed order, so for one input-shape signature every run makes the
same allocations: the k-th request of n bytes during step s. The first (eager) run of a signature
records, for each request, the step that made it and the step during which it was released (the
Session frees values after their last reader: ``Step.free_after``; scratch buffers die inside
their step; outputs live until the run ends). ``memory_plan.plan_offsets`` turns those lifetimes
into offsets in one arena, and from the second run on each request (step, bytes, k) is served at
its planned offset, eager runs and CUDA-graph recording alike: memory is the peak live set, not
the sum, and a recorded graph owns no buffers of its own.

The plan is a prediction, so every served block is checked against it: a block still alive after
the step at which the plan said it dies (a deferred error check holding an array, an exception
keeping a frame) is *pinned*, and any later request whose planned bytes meet a pinned block is
served from the ordinary pool instead. A request the plan does not know (a data-dependent size)
also goes to the pool. So a wrong plan costs memory, never data. When a run ends, every block it
served must be gone (or owned by the CUDA graph it recorded); a block still held is a leak, and
the arena it lives in is retired: no later run writes to it, and a new arena serves them.

In place: where the backend tells a traced run that a step's output may be written over one of
its inputs (``RunMemory.note_in_place``: an elementwise launcher reads each element before writing
the same element), and that input's block dies at that step with the output's size, the plan gives
both requests the same bytes: one buffer instead of two at that step.

Feeds are uploaded before the first step and planned to live for the whole run: a recorded graph
keeps its input buffers and copies each call's feeds into them.

One arena serves every signature of every Session in the process (``ArenaHost``): runs take turns
under one lock, and nothing in the arena outlives the run that wrote it (outputs are downloaded
before the lock is released), so the arena is sized for the largest plan, not the sum. An arena
that must grow is replaced; the CUDA graphs recorded against the old one are dropped first (they
record again on their next call), so old and new never coexist.

This module allocates nothing itself: a ``device`` object supplies memory (``reserve(nbytes)`` for
an arena, ``pool_allocate(nbytes)`` for the pool, ``release_held()`` to hand cached pool blocks
back, ``pool_bytes()`` for what the pool holds). The CUDA backend passes PyCUDA's; the tests pass
a fake one.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import itertools
import traceback
import weakref

from gradgen.errors import RunError
from gradgen.executor.memory_plan import Buffer, aligned, merge_aliases, peak_live_bytes, plan_offsets

ARENA_GRANULE = 2 << 20  # arenas are sized in whole 2 MiB units (the driver's own granularity)
FEED_STEP = -1  # the step index of the uploads made before the first step


class Block(int):
    """A device address a run served (an int, so PyCUDA takes it as a GPUArray's ``gpudata``).

    When the last array using it is collected, its run hears of it. ``keep`` is what the address
    lives in (the arena, or a pool allocation), held for as long as the block lives.
    """

    def __new__(cls, address: int, run: "RunMemory", serial: int, keep):
        self = int.__new__(cls, address)
        self._run, self._serial, self._keep = run, serial, keep
        return self

    @property
    def gpudata(self) -> "Block":  # so a bare block passes where PyCUDA expects an array
        return self

    def __del__(self):
        # Only a note here: a finaliser may run at any point (inside the run's own bookkeeping, or in
        # another thread through the garbage collector); the run reads its notes at safe points.
        try:
            run = self._run
            if not run.closed:
                run.pending.append(self._serial)
        except Exception:  # noqa: BLE001 - never raise from a finaliser (interpreter shutdown)
            pass


class Arena:
    """One device allocation that planned runs carve up."""

    def __init__(self, device, nbytes: int):
        self.nbytes = int(nbytes)
        if not self.nbytes:  # a plan of empty or view-only buffers: cuMemAlloc refuses 0 bytes
            self.allocation, self.base = None, 0
            return
        try:
            self.allocation = device.reserve(self.nbytes)
        except Exception as exc:  # noqa: BLE001 - the driver's out-of-memory error, whatever its type
            raise RunError(
                f"could not allocate the {self.nbytes / 2**20:.0f} MiB device arena the memory plan "
                f"of these input shapes needs: {type(exc).__name__}: {exc}"
            ) from exc
        self.base = int(self.allocation)


class FreeList:
    """Free byte ranges of an arena for a traced run (best fit, coalescing), before any plan exists."""

    def __init__(self, nbytes: int):
        self.free: list[list[int]] = [[0, nbytes]] if nbytes else []  # [start, end), sorted, disjoint

    def take(self, size: int) -> int | None:
        best = None
        for index, (start, end) in enumerate(self.free):
            if end - start >= size and (best is None or end - start < self.free[best][1] - self.free[best][0]):
                best = index
        if best is None:
            return None
        start = self.free[best][0]
        if self.free[best][1] - start == size:
            del self.free[best]
        else:
            self.free[best][0] = start + size
        return start

    def give(self, start: int, end: int) -> None:
        index = 0
        while index < len(self.free) and self.free[index][0] < start:
            index += 1
        self.free.insert(index, [start, end])
        if index + 1 < len(self.free) and self.free[index][1] == self.free[index + 1][0]:
            self.free[index][1] = self.free.pop(index + 1)[1]
        if index > 0 and self.free[index - 1][1] == self.free[index][0]:
            self.free[index - 1][1] = self.free.pop(index)[1]


@dataclasses.dataclass(frozen=True)
class Slot:
    offset: int
    end: int  # offset + aligned size
    last: int  # the last step the block may be alive in


@dataclasses.dataclass(frozen=True)
class SignaturePlan:
    """The plan of one input-shape signature: where each request (step, bytes, k) goes."""

    slots: dict
    size: int  # arena bytes the plan needs
    peak_live: int  # the lower bound: the largest total of requests alive at one step
    requests: int
    entries: tuple  # the traced requests it was made from: (key, nbytes, first, last)
    num_steps: int
    alignment: int
    in_place: tuple = ()  # (output key, input keys it may be written over), as the trace noted them
    aliased: int = 0  # outputs planned over a dying input

    def extended(self, keys) -> "SignaturePlan":
        """The plan again, with the requests ``keys`` alive until the end of the run."""
        keys = set(keys)
        entries = [(key, nbytes, first, self.num_steps if key in keys else last) for key, nbytes, first, last in self.entries]
        return build_plan(entries, self.num_steps, self.alignment, self.in_place)


def build_plan(trace, num_steps: int, alignment: int, in_place=()) -> SignaturePlan:
    """A plan from a traced run's requests ``(key, nbytes, first, last)`` (last None: never freed,
    so not planned: such a request is served from the pool). ``in_place``: pairs (output key,
    input keys) of steps whose output may overwrite an input; the first input that dies at the
    output's step, with the output's size and not taken by another output, shares its bytes."""
    done = [tuple(entry) for entry in trace if entry[3] is not None]
    buffers = [Buffer(nbytes, first, last) for _key, nbytes, first, last in done]
    aliases = _aliases(done, in_place, alignment)
    joined, member_of = merge_aliases(buffers, aliases)
    plan = plan_offsets(joined, alignment)
    slots = {
        key: Slot(plan.offsets[group], plan.offsets[group] + aligned(nbytes, alignment), last)
        for (key, nbytes, _first, last), group in zip(done, member_of)
    }
    return SignaturePlan(
        slots,
        plan.size,
        peak_live_bytes(joined, alignment),
        len(trace),
        tuple(done),
        num_steps,
        alignment,
        tuple(in_place),
        len(aliases),
    )


def _aliases(done, in_place, alignment: int) -> list[tuple[int, int]]:
    """(input index, output index) into ``done`` for the in-place pairs that hold in this trace."""
    index = {entry[0]: i for i, entry in enumerate(done)}
    taken = set()
    pairs = []
    for out_key, in_keys in in_place:
        out = index.get(out_key)
        if out is None:
            continue
        _key, nbytes, first, _last = done[out]
        for in_key in in_keys:
            i = index.get(in_key)
            if i is None or i in taken:
                continue
            _k, in_bytes, in_first, in_last = done[i]
            if in_last == first and in_first < first and aligned(in_bytes, alignment) == aligned(nbytes, alignment):
                taken.add(i)
                pairs.append((i, out))
                break
    return pairs


class RunMemory:
    """The allocations of one run: traced (no plan yet) or served from a plan."""

    def __init__(self, device, arena: Arena | None, plan: SignaturePlan | None, num_steps: int, alignment: int):
        self.device, self.arena, self.plan = device, arena, plan
        self.tracing = plan is None
        self.num_steps = num_steps
        self.alignment = alignment
        self.freelist = FreeList(arena.nbytes) if self.tracing and arena is not None else None
        self.step = FEED_STEP
        self.checked = FEED_STEP  # due lists below this step are checked
        self.closed = False
        self.counts: dict[tuple[int, int], int] = {}
        self.live: dict[int, tuple[int, int] | None] = {}  # serial -> arena bytes [start, end), None: pool
        self.trace: list[list] = []  # tracing: [key, nbytes, first, last], indexed by serial
        self.addresses: dict[int, int] = {}  # tracing: device address -> serial of the live blocks
        self.address_of: dict[int, int] = {}  # tracing: serial -> device address
        self.in_place: list[tuple] = []  # tracing: (output key, input keys) noted by the backend
        self.due: dict[int, list[int]] = {}  # serving: last step -> serials that must be gone after it
        self.pinned: dict[int, tuple[int, int]] = {}
        self.keys: dict[int, tuple] = {}  # serving: serial -> request key (to name what got pinned)
        self.pinned_keys: set[tuple] = set()
        self.fallback_log: list[tuple] = []  # (key, why) of the first fallbacks, for diagnosis
        self.served = self.fallbacks = 0
        self.pending: list[int] = []  # serials of blocks collected since the last safe point
        self.peak_pool = device.pool_bytes()
        self._serials = itertools.count()

    # -- allocation ------------------------------------------------------------------------------

    def allocate(self, nbytes: int):
        """Device memory for a request of ``nbytes`` made during the current step."""
        if self.pending:
            self._drain()
        count_key = (self.step, nbytes)
        k = self.counts.get(count_key, 0)
        self.counts[count_key] = k + 1
        key = (self.step, nbytes, k)
        if self.tracing:
            return self._traced(key, nbytes)
        slot = self.plan.slots.get(key)
        if slot is None or (self.pinned and self._meets_pinned(slot.offset, slot.end)):
            self.fallbacks += 1
            if len(self.fallback_log) < 16:
                self.fallback_log.append((key, "not planned" if slot is None else "meets a pinned block"))
            return self._pool(nbytes)
        serial = next(self._serials)
        self.live[serial] = (slot.offset, slot.end)
        self.keys[serial] = key
        if slot.last < self.num_steps:
            self.due.setdefault(slot.last, []).append(serial)
        self.served += 1
        return Block(self.arena.base + slot.offset, self, serial, self.arena)

    def _traced(self, key, nbytes: int) -> Block:
        serial = next(self._serials)
        first = self.step
        self.trace.append([key, nbytes, first, None])
        size = aligned(nbytes, self.alignment)
        offset = self.freelist.take(size) if self.freelist is not None else None
        if offset is not None:
            self.live[serial] = (offset, offset + size)
            block = Block(self.arena.base + offset, self, serial, self.arena)
        else:
            raw = self._pool(nbytes)
            self.live[serial] = None
            block = Block(int(raw), self, serial, raw)
        if nbytes:
            self.addresses[int(block)] = serial
            self.address_of[serial] = int(block)
        return block

    def note_in_place(self, outputs, inputs) -> None:
        """Traced runs: the current step's ``outputs`` (device addresses and byte counts of whole
        arrays) may be written over any of its ``inputs`` (likewise) that dies here. The plan
        decides which pairs hold, from the lifetimes the trace finds."""
        if not self.tracing:
            return
        if self.pending:
            self._drain()
        in_keys = tuple(self.trace[serial][0] for serial in self._whole_blocks(inputs))
        if not in_keys:
            return
        for serial in self._whole_blocks(outputs):
            if self.trace[serial][2] == self.step:  # made by this step (not an input passed through)
                self.in_place.append((self.trace[serial][0], in_keys))

    def _whole_blocks(self, arrays):
        for address, nbytes in arrays:
            serial = self.addresses.get(int(address))
            if serial is not None and nbytes and self.trace[serial][1] == nbytes:
                yield serial

    def _pool(self, nbytes: int):
        raw = self.device.pool_allocate(nbytes)
        self.peak_pool = max(self.peak_pool, self.device.pool_bytes())
        return raw

    def _meets_pinned(self, start: int, end: int) -> bool:
        return any(s < end and start < e for s, e in self.pinned.values())

    # -- lifetimes -------------------------------------------------------------------------------

    def _drain(self) -> None:
        """Account for the blocks collected since the last safe point (at the current step)."""
        pending = self.pending
        while pending:
            self.released(pending.pop())

    def released(self, serial: int) -> None:
        region = self.live.pop(serial, None)
        if self.closed:
            return
        if self.tracing:
            entry = self.trace[serial]
            address = self.address_of.pop(serial, None)
            if address is not None and self.addresses.get(address) == serial:
                del self.addresses[address]
            if entry[3] is None:
                entry[3] = self.num_steps if entry[2] == FEED_STEP else max(self.step, entry[2])
            if region is not None:
                self.freelist.give(*region)
        else:
            self.pinned.pop(serial, None)
            self.keys.pop(serial, None)

    def advance(self, step: int) -> None:
        """Step ``step`` starts: blocks planned to die before it must be gone, or they are pinned."""
        if self.pending:
            self._drain()  # released during the step that just ended
        if not self.tracing:
            for s in range(self.checked, step):
                for serial in self.due.pop(s, ()):
                    region = self.live.get(serial)
                    if region is not None:
                        self.pinned[serial] = region
                        self.pinned_keys.add(self.keys[serial])
            self.checked = max(self.checked, step)
        self.step = step

    def end_of_steps(self) -> None:
        """Every step ran: what is released from now on lived until the end of the run."""
        self.advance(self.num_steps)

    # -- the end ---------------------------------------------------------------------------------

    def unreleased_traces(self) -> bool:
        self._drain()
        return self.tracing and any(entry[3] is None for entry in self.trace)

    def arena_blocks_alive(self) -> int:
        self._drain()
        return sum(1 for region in self.live.values() if region is not None)

    def close(self) -> None:
        self._drain()
        self.closed = True


class MemoryManager:
    """The planned memory of one Session's CUDA backend: its plans (one per input-shape signature,
    the most recent ``max_plans`` kept) and its share of the process's arena."""

    def __init__(self, device, host: "ArenaHost | None" = None, max_plans: int = 64, alignment: int = 256):
        self.device = device
        self.host = host if host is not None else ArenaHost.shared(device)
        self.max_plans = max_plans
        self.alignment = alignment
        self.plans: collections.OrderedDict = collections.OrderedDict()
        self.peak_held = 0  # the most device memory seen held by the pool and the arena during a run
        self.leaks = 0  # runs that left an arena block alive (each retired the arena)
        self.served = self.fallbacks = 0  # requests of planned runs served from the arena / the pool
        self.fallback_log: list[tuple] = []  # the last run's first fallbacks: (key, why)
        self._on_retire = None
        self.host.join(self)

    def on_arena_retired(self, callback) -> None:
        """``callback()`` runs when the arena is replaced or retired (weakly held: a bound method of
        the backend, which drops its CUDA graphs)."""
        self._on_retire = weakref.WeakMethod(callback) if hasattr(callback, "__self__") else (lambda: callback)

    def arena_retired(self) -> None:
        callback = self._on_retire() if self._on_retire is not None else None
        if callback is not None:
            callback()

    def plan_for(self, signature) -> SignaturePlan | None:
        plan = self.plans.get(signature)
        if plan is not None:
            self.plans.move_to_end(signature)
        return plan

    def begin(self, signature, num_steps: int) -> RunMemory:
        """The memory of a run of ``signature``: served from its plan, or traced to make one."""
        plan = self.plan_for(signature)
        arena = self.host.arena_for(self, plan.size) if plan is not None else self.host.arena
        return RunMemory(self.device, arena, plan, num_steps, self.alignment)

    def end(self, run: RunMemory, signature, graph_owned: bool = False) -> None:
        """After the run's values are dropped (or handed to the CUDA graph it recorded, when
        ``graph_owned``): record the trace's plan, and retire the arena if a block leaked."""
        if not graph_owned and (run.arena_blocks_alive() or run.unreleased_traces()):
            # A reference cycle (an exception caught on a first-use path, with its frames) may hold
            # the last blocks; a traced block never released would not be planned.
            gc.collect()
        run.close()
        self.peak_held = max(self.peak_held, run.peak_pool + (run.arena.nbytes if run.arena is not None else 0))
        self.served += run.served
        self.fallbacks += run.fallbacks
        if not graph_owned and run.arena_blocks_alive():
            self.leaks += 1
            if run.arena is self.host.arena:
                self.host.retire()
        if run.tracing:
            plan = self.plans[signature] = build_plan(run.trace, run.num_steps, self.alignment, run.in_place)
            while len(self.plans) > self.max_plans:
                self.plans.popitem(last=False)
            self.device.release_held()  # the pool hands back what the traced run cached
            if plan.size:  # size the arena now: the next signature's traced run draws on it too
                try:
                    self.host.arena_for(self, plan.size)
                except RunError:
                    pass  # the next run of this signature says so, if it still does not fit
        self.fallback_log = run.fallback_log or self.fallback_log

    def learn_from(self, run: RunMemory, signature) -> bool:
        """A recorded run pinned blocks (a deferred error check keeps an array for after the replay):
        plan those requests to live to the end of the run. True when the plan changed, so the
        caller records again: its graph then needs no pool memory for requests that met them."""
        plan = self.plans.get(signature)
        if plan is None or not run.pinned_keys or plan is not run.plan:
            return False
        self.plans[signature] = plan.extended(run.pinned_keys)
        self.served -= run.served  # that run's graph is dropped: its counts go with it
        self.fallbacks -= run.fallbacks
        self.fallback_log = []
        return True

    def abandon(self, run: RunMemory) -> None:
        """A run that failed: keep no plan from it; retire the arena if its blocks are still held."""
        if run.arena_blocks_alive():
            gc.collect()
        run.close()
        if run.arena_blocks_alive() and run.arena is self.host.arena:
            self.leaks += 1
            self.host.retire()

    @property
    def planned_bytes(self) -> int:
        """The arena size this Session's plans need (the largest of them)."""
        return max((plan.size for plan in self.plans.values()), default=0)

    @property
    def in_place_outputs(self) -> int:
        """The most outputs one plan puts over a dying input."""
        return max((plan.aliased for plan in self.plans.values()), default=0)

    @property
    def peak_live_bytes(self) -> int:
        return max((plan.peak_live for plan in self.plans.values()), default=0)

    def close(self) -> None:
        self.plans.clear()
        self.host.leave(self)
        self.device.release_held()


class ArenaHost:
    """The arena all CUDA Sessions of the process share, sized for the largest plan among them."""

    _SHARED: "ArenaHost | None" = None

    def __init__(self, device):
        self.device = device
        self.arena: Arena | None = None
        self.needs: dict[int, int] = {}  # id(manager) -> the largest plan it ran
        self.managers: "weakref.WeakValueDictionary[int, MemoryManager]" = weakref.WeakValueDictionary()
        self.generation = 0

    @classmethod
    def shared(cls, device) -> "ArenaHost":
        if cls._SHARED is None:
            cls._SHARED = cls(device)
        return cls._SHARED

    def join(self, manager: MemoryManager) -> None:
        key = id(manager)
        self.managers[key] = manager
        self.needs.setdefault(key, 0)
        finalizer = weakref.finalize(manager, self._forget, key)
        finalizer.atexit = False

    def arena_for(self, manager: MemoryManager, nbytes: int) -> Arena:
        """The arena, replaced by a larger one when ``nbytes`` does not fit, or by a smaller one when
        the Sessions that needed its size are gone."""
        key = id(manager)
        self.needs[key] = max(self.needs.get(key, 0), nbytes)
        want = -(-max(self.needs.values()) // ARENA_GRANULE) * ARENA_GRANULE
        if self.arena is None or self.arena.nbytes < nbytes or self.arena.nbytes > want + want // 2:
            self.retire()
            self.device.release_held()
            self.arena = Arena(self.device, want)
        return self.arena

    def retire(self) -> None:
        """Stop serving from the current arena; every Session drops the graphs recorded on it."""
        if self.arena is None:
            return
        self.arena = None
        self.generation += 1
        for manager in list(self.managers.values()):
            manager.arena_retired()

    def leave(self, manager: MemoryManager) -> None:
        self._forget(id(manager))

    def _forget(self, key: int) -> None:
        self.needs.pop(key, None)
        self.managers.pop(key, None)
        if not self.needs:
            self.arena = None  # freed once the last block and graph using it are gone


def release_frames(exc: BaseException) -> None:
    """Clear the locals of the finished frames in ``exc``'s tracebacks (and its causes'), so the
    arrays of a failed run are released now rather than when the exception is dropped. Line
    numbers stay: tracebacks print as before."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__
