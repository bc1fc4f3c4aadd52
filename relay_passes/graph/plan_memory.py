"""plan_memory: one arena per device, byte offsets by greedy first-fit, proved by a verifier.

Every entry gets its own storage id, except a ``__nop`` output, which shares its input's storage
(it is a view), the pieces of a ``__concat``, which share its output's (at their offsets in
it: ``Graph.entry_offsets``), and an output its kernel may write over an input that dies there
(``lifetimes.inplace_pairs``: oneDNN's convolution adding a residual), which takes the
input's. A storage is live from the node that first writes it to the last node that reads
it; inputs and params are live for the whole run, graph outputs from their producer to the end
(never overwritten). Per device, storages are placed one by one at the lowest offset that no
storage live at the same time occupies (TFLite's arena planner / tinygrad's memory.py), in a few
orders (largest first, ...), keeping the smallest arena. ``verify_memory`` re-derives the
lifetimes from the graph alone and refuses two live storages sharing a byte.
"""

from __future__ import annotations

import dataclasses

from hgrt.errors import PlanError
from hgrt.graph import Graph
from hgrt.lifetimes import (
    ALIGN,
    Order,
    align,
    check_lifetimes,
    group_bytes,
    inplace_chains,
    inplace_pairs,
    memory_report,
    merged_ranges,
    storage_devices,
)
from hgrt.relay_passes.util.context import BuildContext
from hgrt.relay_passes.util.pipeline import contract


def _assign_storage(g: Graph, pairs: dict[int, int]) -> list[int]:
    """One storage per entry group: an entry and its views (``__nop``; a ``__concat``'s pieces)
    share one, and so does an in-place output (``pairs``: ``inplace_pairs``) with its input;
    numbered densely in order of first use."""
    merged = inplace_chains(pairs)
    root = [merged.get(r, r) for r in g.alias_roots()]
    dense: dict[int, int] = {}
    return [dense.setdefault(r, len(dense)) for r in root]


# orders to place storages in; the plan with the smallest pool wins (largest-first alone is
# ~5% above the lower bound on inception / densenet, another order often closes the gap)
PLACEMENT_ORDERS = {
    "size": lambda t: (-t[1], t[2], t[0]),
    "size_x_duration": lambda t: (-t[1] * (t[3] - t[2] + 1), t[2], t[0]),
    "duration": lambda t: (-(t[3] - t[2]), -t[1], t[0]),
    "first_use": lambda t: (t[2], -t[1], t[0]),
}


def _place(items: list[tuple], order, live: Order) -> tuple[dict[int, int], int]:
    """First-fit at the lowest offset that no storage possibly live at the same time occupies
    (with streams: not ordered by happens-before)."""
    placed: list[tuple] = []  # (offset, size, group)
    offsets: dict[int, int] = {}
    pool = 0
    for sid, size, _first, _last, grp in sorted(items, key=order):
        busy = sorted((o, o + s) for o, s, other in placed if live.conflict(grp, other))
        offset = 0
        for lo, hi in busy:
            if offset + size <= lo:
                break
            offset = max(offset, align(hi))
        offsets[sid] = offset
        placed.append((offset, size, grp))
        pool = max(pool, offset + size)
    return offsets, pool


def _greedy_offsets(items: list[tuple], live: Order) -> tuple[dict[int, int], int]:
    """items: (sid, size, first, last, group) → offsets and pool size, best of
    PLACEMENT_ORDERS."""
    plans = [_place(items, order, live) for order in PLACEMENT_ORDERS.values()]
    return min(plans, key=lambda plan: plan[1])


def _layout(g: Graph, n_dev: int, pairs: dict[int, int]
            ) -> tuple[list[int], list[int], list[int]]:
    """Offsets per storage, activation pool and weight pool bytes per device of ``g`` (which
    has its storage ids, ``pairs`` merged), under the happens-before order of its streams."""
    owner = storage_devices(g, PlanError)
    weights = g.weight_storages
    live = Order(g)
    items: list[list[tuple]] = [[] for _ in range(n_dev)]
    offsets = [0] * len(owner)
    weight_pools = [0] * n_dev
    for root, grp in sorted(merged_ranges(g, live, pairs).items()):
        sid = g.storage_ids[root]
        size = align(group_bytes(g, grp))
        if sid in weights:
            offsets[sid] = weight_pools[owner[sid]]
            weight_pools[owner[sid]] += size
        else:
            items[owner[sid]].append((sid, size, grp.first, grp.last, grp))
    pools = [0] * n_dev
    for dev in range(n_dev):
        dev_offsets, pools[dev] = _greedy_offsets(items[dev], live)
        for s, o in dev_offsets.items():
            offsets[s] = o
    return offsets, pools, weight_pools


def _with_storage(graph: Graph, ctx: BuildContext | None = None
                  ) -> tuple[Graph, int, dict[int, int]]:
    """``graph`` with its storage ids, its device count and its in-place pairs (which do not
    depend on storage: found once, for the ids and the layout)."""
    pairs = inplace_pairs(graph)
    g = dataclasses.replace(graph, storage_ids=_assign_storage(graph, pairs))
    n_dev = max(storage_devices(g, PlanError).values(), default=0) + 1
    if g.device_index is not None and ctx is not None:
        n_dev = max(n_dev, len(ctx.devices))
    return g, n_dev, pairs


def pool_bytes(graph: Graph) -> list[int]:
    """The activation pool bytes per device that ``plan_memory`` gives ``graph`` (with its
    streams and waits, if any), without writing the plan: what stream assignment weighs."""
    return _layout(*_with_storage(graph))[1]


# under the happens-before order of the streams assign_streams gave
@contract(reads={"devices"}, after=("assign_streams",))
def plan_memory(graph: Graph, ctx: BuildContext | None = None) -> Graph:
    """Return ``graph`` with storage ids, per-device pool sizes and offsets; verified.

    Per device two pools: the weights (parameters, live always, one after another) and the
    activations (everything else, reused by lifetime), so that a call frame or a second module
    allocates activations only."""
    g, n_dev, pairs = _with_storage(graph, ctx)
    offsets, pools, weight_pools = _layout(g, n_dev, pairs)
    g = dataclasses.replace(g, pool_bytes=pools, storage_offset=offsets,
                            weight_pool_bytes=weight_pools)
    verify_memory(g)
    if ctx is not None:
        for m in memory_report(g):
            ctx.log(f"memory on device {m.device}: {m.planned_bytes} B planned ({m.weight_bytes} "
                    f"B weights), lower bound {m.lower_bound} B, {m.no_reuse_bytes} B without "
                    f"reuse")
    return g


def verify_memory(g: Graph) -> None:
    """Raise PlanError if two entries live at the same time share a byte of one pool, a
    storage spans devices, falls outside its pool, or is not aligned."""
    if g.pool_bytes is None or g.storage_offset is None:
        raise PlanError("the graph has no memory plan (pool_bytes / storage_offset)")
    storage_devices(g, PlanError)
    within = g.entry_offsets()
    for eid, sid in enumerate(g.storage_ids):
        off = g.storage_offset[sid] + within[eid]
        end = off + g.entry_bytes(eid)
        if off % ALIGN:
            raise PlanError(f"storage {sid}: offset {off} is not a multiple of {ALIGN}")
        dev, weight = g.pool_of(eid)
        pools = g.weight_pool_bytes if weight else g.pool_bytes
        if dev >= len(pools) or end > pools[dev]:
            raise PlanError(f"storage {sid} [{off}, {end}) is outside the "
                            f"{'weight pool' if weight else 'pool'} of device {dev}")
    check_lifetimes(g, PlanError)
