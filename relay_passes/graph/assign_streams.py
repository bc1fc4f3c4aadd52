"""assign_streams: give every kernel and copy a stream, and each cross-stream edge an event.

A stream is a queue of steps that one worker runs in order; streams run at the same time.
Like a logical stream allocator: a node continues its producer's stream when it is that
producer's first consumer on the same device; otherwise it opens a new stream of its device,
up to ``per_device`` streams, beyond which it joins the device's stream that frees first in
node order. A copy runs on its destination device. A node waits for a producer on another
stream only when no earlier wait already orders them (vector clocks), so events are few.
``single_stream=True`` puts every step on one stream: the graph then runs as one without
streams, in node order.

Streams cost memory: bytes of branches that overlap cannot share the pool. Extra streams on a
device are kept only while its activation pool (planned by ``plan_memory`` under the streams'
happens-before order) stays within ``1 + memory_slack`` (default 0.10) of the sequential plan's;
past it the device gets one stream fewer, down to one (``memory_slack=None``: no cap). The
planner is not the lever: it reaches the bound (two chains of matmuls overlapping keep two
tensors each live, plus the input: 5 of 4 in the sequential plan, 1.25x, and any overlap
beyond the nodes reading the input needs as much), so only fewer streams stay within 10%.
Events that let only those nodes overlap were not chosen: a stream gets a share of the
device's cores, so mostly serialized streams would run each kernel on fewer threads.

    graph = assign_streams(graph, ctx)   # graph.streams / graph.waits, in the JSON's hgrt section
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import numpy as np

from hgrt.errors import BuildError, did_you_mean
from hgrt.graph import Graph
from hgrt.lifetimes import Order, entry_writers, runs
from hgrt.relay_passes.graph.plan_memory import pool_bytes
from hgrt.relay_passes.util.context import BuildContext
from hgrt.relay_passes.util.pipeline import contract

MEMORY_SLACK = 0.10  # extra streams may grow a device's pool by this much over sequential


def _producers(g: Graph, nid: int, writers: list[tuple[int, ...]]) -> list[int]:
    """The nodes that run and write what ``nid`` reads (through ``__nop`` and ``__concat``
    views; ``writers``: ``entry_writers``)."""
    found = []
    for src, idx, _ in g.nodes[nid].inputs:
        for writer in writers[g.entry_id(src, idx)]:
            if writer not in found:
                found.append(writer)
    return found


def check_stream_options(opts: Any) -> dict[str, Any]:
    """``build(streams=...)`` checked: known keys, each of its type and range (a typo was
    ignored, and a bad value failed only after the whole library was built)."""
    if opts is None:
        return {}
    if not isinstance(opts, dict):
        raise BuildError(f"streams must be a dict of options ({sorted(STREAM_OPTIONS)}), got "
                         f"{type(opts).__name__}")
    for key, value in opts.items():
        if key not in STREAM_OPTIONS:
            raise BuildError(f"streams option {did_you_mean(key, sorted(STREAM_OPTIONS))}")
        number = isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
        ok = {"per_device": number and isinstance(value, numbers.Integral) and value >= 1,
              "single_stream": isinstance(value, (bool, np.bool_)) or value in (0, 1),
              "memory_slack": value is None or number and value >= 0}[key]
        if not ok:
            raise BuildError(f"streams option {key!r} must be {STREAM_OPTIONS[key]}, got "
                             f"{value!r}")
    convert = {"per_device": int, "single_stream": bool,
               "memory_slack": lambda v: None if v is None else float(v)}
    return {key: convert[key](value) for key, value in opts.items()}


STREAM_OPTIONS = {"per_device": "an integer >= 1", "single_stream": "True or False",
                  "memory_slack": "a fraction >= 0 (or None: no memory bound)"}


# after concat_views: streams and events see each piece's writer (entry_writers)
@contract(reads={"streams"}, after=("concat_views",))
def assign_streams(graph: Graph, ctx: BuildContext | None = None, *, per_device: int = 1,
                   single_stream: bool = False,
                   memory_slack: float | None = MEMORY_SLACK) -> Graph:
    """``graph`` with ``streams`` (per node) and ``waits`` (per node: nodes of other streams
    it waits for). Options from ``ctx.streams`` (``{"per_device": n, "single_stream": b,
    "memory_slack": f}``) when a build context is given; ``memory_slack=None``: open the
    streams whatever they cost in memory."""
    opts = (None if ctx is None else ctx.streams) or {}
    per_device = opts.get("per_device", per_device)
    single_stream = opts.get("single_stream", single_stream)
    memory_slack = opts.get("memory_slack", memory_slack)
    if single_stream:  # one stream over all devices: the sequential run, no section needed
        return dataclasses.replace(graph, streams=None, waits=None)
    writers = entry_writers(graph)
    caps: dict[int, int] = {}  # device -> streams it may have, where fewer than per_device
    streams = _streams(graph, writers, per_device, caps)
    sequential: list[int] | None = None  # the sequential plan's pools, planned once
    while memory_slack is not None and _several(graph, streams):
        if sequential is None:
            sequential = pool_bytes(dataclasses.replace(graph, streams=None, waits=None))
        over = _over_budget(graph, writers, streams, sequential, memory_slack, ctx)
        if not over:
            break
        caps.update(over)
        streams = _streams(graph, writers, per_device, caps)
    return dataclasses.replace(graph, streams=streams, waits=_waits(graph, streams, writers))


def _streams(g: Graph, writers: list[tuple[int, ...]], per_device: int,
             caps: dict[int, int]) -> list[int]:
    """Per node its stream (-1: it does not run), at most ``caps.get(device, per_device)``
    streams on a device."""
    streams = [-1] * len(g.nodes)
    device_of: list[int] = []  # stream -> device
    continued: set[int] = set()  # producers whose stream a consumer already continued
    tail: dict[int, int] = {}  # stream -> its last node
    for nid, node in enumerate(g.nodes):
        if not runs(node):
            continue
        dev = g.entry_device(g.entry_id(nid))
        mine = [s for s, d in enumerate(device_of) if d == dev]
        reuse = next((p for p in _producers(g, nid, writers) if p not in continued
                      and streams[p] in mine and tail[streams[p]] == p), None)
        if reuse is not None:
            continued.add(reuse)
            s = streams[reuse]
        elif len(mine) < caps.get(dev, per_device):
            s = len(device_of)
            device_of.append(dev)
        else:
            s = min(mine, key=lambda m: tail[m])  # the one whose last node came earliest
        streams[nid], tail[s] = s, nid
    return streams


def _several(g: Graph, streams: list[int]) -> dict[int, int]:
    """Devices with more than one stream, and how many they have."""
    count: dict[int, set[int]] = {}
    for nid, s in enumerate(streams):
        if s >= 0:
            count.setdefault(g.entry_device(g.entry_id(nid)), set()).add(s)
    return {d: len(ss) for d, ss in count.items() if len(ss) > 1}


def _over_budget(g: Graph, writers: list[tuple[int, ...]], streams: list[int],
                 sequential: list[int], slack: float, ctx: BuildContext | None
                 ) -> dict[int, int]:
    """Devices with more than one stream whose activation pool exceeds ``1 + slack`` times
    the sequential plan's (``sequential``), each with one stream fewer than it has."""
    several = _several(g, streams)
    concurrent = pool_bytes(dataclasses.replace(g, streams=streams,
                                                waits=_waits(g, streams, writers)))
    over = {d: n - 1 for d, n in several.items() if concurrent[d] > (1 + slack) * sequential[d]}
    for d, n in over.items():
        if ctx is not None:
            ctx.log(f"streams: device {d} gets {n} stream(s), not {n + 1}: {n + 1} would need "
                    f"{concurrent[d]} B of pool, {concurrent[d] / max(1, sequential[d]):.2f}x the "
                    f"sequential plan's {sequential[d]} B (memory_slack {slack})")
    return over


def _waits(g: Graph, streams: list[int], writers: list[tuple[int, ...]]) -> list[list[int]]:
    """A wait for each producer on another stream that earlier waits do not already order
    (latest producer first: waiting for it often orders the others too)."""
    order, waits = Order(), []
    for nid, s in enumerate(streams):
        order.add(s)
        mine = []
        if s >= 0:
            for p in sorted(_producers(g, nid, writers), key=lambda p: -order.pos[p]):
                if streams[p] != s and not order.before(p, nid):
                    order.wait(nid, p)
                    mine.append(p)
        waits.append(sorted(mine))
    return waits
