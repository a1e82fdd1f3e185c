"""Pipeline schedules as tables: which stage runs which microbatch's forward or backward at every tick.

A schedule is plain data, built here by simulating the stages tick by tick; `jaxtrain.parallel.pipeline` runs any
table the same way, so GPipe, 1F1B and interleaved 1F1B differ only in the order each stage takes its work.

The model: P devices along the `pipeline` axis, each holding V chunks of layers ("virtual stages"; chunk v of device
s is virtual stage j = v*P + s, so consecutive chunks sit on neighbouring devices). At each tick every device may do
one forward F(v, m) and then one backward B(v, m) of microbatch m. An output sent at the end of a tick is usable at
the next one; the last virtual stage turns its forward into a loss gradient within the same tick.

    >>> s = build_schedule("1f1b", stages=4, virtual=1, microbatches=8)
    >>> s.ticks, round(s.bubble(), 3), s.stash_slots  # at most 2P - 1 microbatches in flight, whatever M is
    (14, 0.273, 7)
    >>> build_schedule("gpipe", stages=4, virtual=1, microbatches=8).stash_slots  # GPipe keeps all M
    8
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxtrain.errors import UserInputError

SCHEDULES = ("gpipe", "1f1b", "interleaved")


class ScheduleError(UserInputError):
    """A microbatch count or stage count the schedule cannot run."""


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The tick table of one step. Every array is (ticks, stages) int32; -1 means "nothing" (or the trash slot).

    fwd_v/fwd_m: chunk and microbatch of the tick's forward; bwd_v/bwd_m likewise for the backward.
    fwd_in: activation slot the forward reads (its input arrived from the previous device earlier);
    stash: residual slot the forward writes and its backward later reads;
    loss_grad: gradient slot where the last virtual stage puts d(loss)/d(output) for its own backward;
    bwd_grad: gradient slot the backward reads;
    recv_act/recv_grad: slots where the activation/gradient arriving at the end of the tick is stored.
    """

    name: str
    stages: int
    virtual: int
    microbatches: int
    tables: dict[str, np.ndarray]
    act_slots: int
    stash_slots: int
    grad_slots: int

    @property
    def ticks(self) -> int:
        return self.tables["fwd_v"].shape[0]

    def theoretical_bubble(self) -> float:
        """(P - 1) / (V*M + P - 1): the idle fraction of an ideal schedule with V chunks per device."""
        p, v, m = self.stages, self.virtual, self.microbatches
        return (p - 1) / (v * m + p - 1)

    def bubble(self, forward_cost: float = 1.0, backward_cost: float = 2.0) -> float:
        """Idle fraction of this table when every device waits for the slowest at each tick.

        A tick costs the forward (per chunk) if any device runs one, plus the backward if any device runs one.
        """
        any_fwd = (self.tables["fwd_v"] >= 0).any(axis=1)
        any_bwd = (self.tables["bwd_v"] >= 0).any(axis=1)
        chunk_f, chunk_b = forward_cost / self.virtual, backward_cost / self.virtual
        elapsed = chunk_f * any_fwd.sum() + chunk_b * any_bwd.sum()
        return float(1.0 - self.microbatches * (forward_cost + backward_cost) / elapsed)

    def report(self) -> dict[str, float | int | str]:
        return {
            "schedule": self.name,
            "stages": self.stages,
            "virtual_stages": self.virtual,
            "microbatches": self.microbatches,
            "ticks": self.ticks,
            "bubble_theory": round(self.theoretical_bubble(), 4),
            "bubble_table": round(self.bubble(), 4),
            "microbatches_in_flight": self.stash_slots,
        }

    def describe(self) -> str:
        r = self.report()
        return (
            f"pipeline: {r['schedule']}, P={r['stages']} stages x V={r['virtual_stages']} chunks, "
            f"M={r['microbatches']} microbatches, {r['ticks']} ticks; bubble {r['bubble_theory']:.1%} in theory "
            f"((P-1)/(V*M+P-1)), {r['bubble_table']:.1%} for this table (backward = 2 x forward); "
            f"at most {r['microbatches_in_flight']} microbatches' activations kept per device"
        )


def build_schedule(name: str, stages: int, virtual: int, microbatches: int, forward_only: bool = False) -> Schedule:
    """The tick table of schedule `name` ("gpipe", "1f1b" or "interleaved"); `forward_only` for evaluation."""
    check_schedule(name, stages, virtual, microbatches)
    p, v_count, m_count = stages, virtual, microbatches
    f_order, b_order, in_flight_cap = _orders(name, p, v_count, m_count)
    if forward_only:
        b_order = [[] for _ in range(p)]
    chunks = p * v_count
    fwd_done: dict[tuple[int, int], int] = {}  # (virtual stage, microbatch) -> tick
    bwd_done: dict[tuple[int, int], int] = {}
    f_next, b_next, in_flight = [0] * p, [0] * p, [0] * p
    rows: list[list[tuple[tuple[int, int] | None, tuple[int, int] | None]]] = []
    tick = 0
    while any(f_next[s] < len(f_order[s]) or b_next[s] < len(b_order[s]) for s in range(p)):
        row = []
        for s in range(p):
            fwd = None
            if f_next[s] < len(f_order[s]) and in_flight[s] < in_flight_cap[s]:
                v, m = f_order[s][f_next[s]]
                j = v * p + s
                if j == 0 or fwd_done.get((j - 1, m), tick) < tick:
                    fwd = (v, m)
                    fwd_done[(j, m)] = tick
                    f_next[s] += 1
                    in_flight[s] += not forward_only
            bwd = None
            gpipe_wait = name == "gpipe" and f_next[s] < len(f_order[s])  # GPipe: every forward first
            if b_next[s] < len(b_order[s]) and not gpipe_wait:
                v, m = b_order[s][b_next[s]]
                j = v * p + s
                ready = (
                    fwd_done.get((j, m), tick + 1) <= tick if j == chunks - 1 else bwd_done.get((j + 1, m), tick) < tick
                )
                if ready:
                    bwd = (v, m)
                    bwd_done[(j, m)] = tick
                    b_next[s] += 1
                    in_flight[s] -= 1
            row.append((fwd, bwd))
        if all(f is None and b is None for f, b in row):
            raise AssertionError(f"schedule {name} deadlocked at tick {tick}")  # a bug in the orders, not user input
        rows.append(row)
        tick += 1
    return _tabulate(name, p, v_count, m_count, rows, fwd_done, bwd_done)


def check_schedule(name: str, stages: int, virtual: int, microbatches: int) -> None:
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown pipeline schedule '{name}'; choose one of: {', '.join(SCHEDULES)}.")
    if microbatches < 1:
        raise ScheduleError(f"pipeline.microbatches={microbatches}: a pipeline needs at least 1 microbatch.")
    if virtual < 1:
        raise ScheduleError(f"pipeline.virtual_stages={virtual}: use 1 or more chunks per device.")
    if name != "interleaved" and virtual != 1:
        raise ScheduleError(
            f"pipeline.virtual_stages={virtual} needs schedule=interleaved; {name} runs one chunk per device."
        )
    if name == "interleaved" and microbatches % stages:
        raise ScheduleError(
            f"the interleaved schedule sends microbatches round the {stages} stages in groups of {stages}, so "
            f"pipeline.microbatches must be a multiple of {stages} (got {microbatches})."
        )


def _orders(name: str, p: int, v_count: int, m_count: int):
    """Per device: the order of its forwards and backwards, and how many microbatches it may hold in flight."""
    if name == "interleaved":
        # Megatron-LM's order: groups of P microbatches, each group through chunk 0, then chunk 1, ...; backwards
        # through the chunks in reverse.
        groups = [range(g, g + p) for g in range(0, m_count, p)]
        fwd = [(v, m) for g in groups for v in range(v_count) for m in g]
        bwd = [(v, m) for g in groups for v in reversed(range(v_count)) for m in g]
        cap = [2 * (p - s - 1) + (v_count - 1) * p + 1 for s in range(p)]
        return [fwd] * p, [bwd] * p, cap
    order = [(0, m) for m in range(m_count)]
    # 1F1B: device s holds at most 2(P - s) - 1 microbatches. In lockstep every hop between neighbours costs a whole
    # tick, so a microbatch's round trip from stage s to the loss and back takes 2(P - s) - 1 ticks, during which the
    # stage starts a new microbatch every tick; a lower cap stalls the pipeline (asynchronous 1F1B needs P - s).
    cap = [m_count] * p if name == "gpipe" else [2 * (p - s) - 1 for s in range(p)]
    return [order] * p, [order] * p, cap


def _tabulate(name, p, v_count, m_count, rows, fwd_done, bwd_done) -> Schedule:
    ticks, chunks = len(rows), p * v_count
    table = {k: np.full((ticks, p), -1, np.int32) for k in ("fwd_v", "fwd_m", "bwd_v", "bwd_m")}
    for t, row in enumerate(rows):
        for s, (fwd, bwd) in enumerate(row):
            if fwd:
                table["fwd_v"][t, s], table["fwd_m"][t, s] = fwd
            if bwd:
                table["bwd_v"][t, s], table["bwd_m"][t, s] = bwd

    # Lifetimes (first tick held, last tick read) of each buffer entry, per device.
    acts, stashes, grads = ([[] for _ in range(p)] for _ in range(3))
    for (j, m), t in fwd_done.items():
        v, s = divmod(j, p)
        if j > 0:  # the input arrives at the end of the previous virtual stage's tick
            acts[s].append(((j, m), fwd_done[(j - 1, m)] + 1, t))
        if (j, m) in bwd_done:
            stashes[s].append(((j, m), t, bwd_done[(j, m)]))
            start = t if j == chunks - 1 else bwd_done[(j + 1, m)] + 1
            grads[s].append(((j, m), start, bwd_done[(j, m)]))
    act_slot, act_slots = _allocate(acts)
    stash_slot, stash_slots = _allocate(stashes)
    grad_slot, grad_slots = _allocate(grads)

    for key in ("fwd_in", "stash", "loss_grad", "bwd_stash", "bwd_grad", "recv_act", "recv_grad"):
        table[key] = np.full((ticks, p), -1, np.int32)
    for (j, m), t in fwd_done.items():
        v, s = divmod(j, p)
        if j > 0:
            table["fwd_in"][t, s] = act_slot[s][(j, m)]
            sender = fwd_done[(j - 1, m)]
            table["recv_act"][sender, s] = act_slot[s][(j, m)]
        if (j, m) in bwd_done:
            table["stash"][t, s] = stash_slot[s][(j, m)]
            tb = bwd_done[(j, m)]
            table["bwd_stash"][tb, s] = stash_slot[s][(j, m)]
            table["bwd_grad"][tb, s] = grad_slot[s][(j, m)]
            if j == chunks - 1:
                table["loss_grad"][t, s] = grad_slot[s][(j, m)]
            else:
                table["recv_grad"][bwd_done[(j + 1, m)], s] = grad_slot[s][(j, m)]
    return Schedule(name, p, v_count, m_count, table, act_slots, stash_slots, grad_slots)


def _allocate(lifetimes: list[list[tuple[tuple[int, int], int, int]]]) -> tuple[list[dict], int]:
    """Give each entry a buffer slot no other entry holds during its lifetime; returns slots per device, count."""
    assignment, most = [], 0
    for entries in lifetimes:
        free_after: list[int] = []  # per slot: the last tick its current entry is read
        slots = {}
        for key, start, end in sorted(entries, key=lambda e: e[1]):
            slot = next((i for i, last in enumerate(free_after) if last < start), len(free_after))
            if slot == len(free_after):
                free_after.append(end)
            free_after[slot] = end
            slots[key] = slot
        assignment.append(slots)
        most = max(most, len(free_after))
    return assignment, most
