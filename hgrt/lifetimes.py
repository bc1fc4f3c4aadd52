"""Liveness: which graph entries are alive at which step, and which bytes they occupy.

The one home of the questions the memory planner, the graph verifier, the storage pools, the
memory report and the pictures all ask. An entry group is an entry plus the entries that are
its bytes: its ``__nop`` views (the same bytes), its ``__slice`` views (a range of them), and
where it is the output of a ``__concat``, its pieces, which their kernels wrote in place, one
after another (``Graph.entry_offsets``); a step is a node id. Inputs and params are live from
before the first step to after the last, graph outputs from their producer to after the last
step, so a run can be repeated without setting them again.

Functions take an ``hgrt.graph.Graph`` (not imported here: graph.py validates with this module).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hgrt.graph_format import CONCAT_FUNC, NOP_FUNC, SLICE_FUNC, VIEW_FUNCS

ALIGN = 64  # bytes: every storage of an hgrt memory plan starts at a multiple of this
Graph = Any  # an hgrt.graph.Graph


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Group:
    """Entries that share bytes (an entry, its ``__nop`` views, the pieces of a ``__concat``),
    and the steps they are live in, ``first`` to ``last`` inclusive (-1: before the first
    step). ``writers`` are the nodes that write them, in order (one, or a concat's piece by
    piece; none for an input or param: ``writer`` -1), ``users`` the nodes that run and touch them,
    ``forever``: never overwritten (an input, a param, a graph output)."""

    root: int
    first: int
    last: int
    members: tuple[int, ...]
    users: tuple[int, ...] = ()
    forever: bool = False
    writers: tuple[int, ...] = ()

    @property
    def writer(self) -> int:
        return self.writers[0] if self.writers else -1

    def overlaps(self, other: Group) -> bool:
        return self.first <= other.last and other.first <= self.last


def runs(node) -> bool:
    """Whether a node is a step of ``run()`` (a kernel or a copy; ``__nop``, ``__slice`` and
    ``__concat`` are views)."""
    return node.op == "tvm_op" and node.func_name not in VIEW_FUNCS


def entry_writers(g: Graph) -> list[tuple[int, ...]]:
    """Per entry, the nodes that run and write its bytes: its kernel; for a view its input's;
    for a ``__concat`` output its pieces' (none for an input or param)."""
    writers: list[tuple[int, ...]] = [()] * g.num_entries
    for nid, node in enumerate(g.nodes):
        ins = [writers[g.entry_id(src, idx)] for src, idx, _ in node.inputs]
        if node.func_name in (NOP_FUNC, SLICE_FUNC) and ins:
            writers[g.entry_id(nid)] = ins[0]
        elif node.func_name == CONCAT_FUNC:
            writers[g.entry_id(nid)] = tuple(sorted({w for piece in ins for w in piece}))
        elif runs(node):
            for k in range(node.num_outputs):
                writers[g.entry_id(nid, k)] = (nid,)
    return writers


def live_ranges(g: Graph) -> dict[int, Group]:
    """Every entry group by its root entry id."""
    end = len(g.nodes)
    root = g.alias_roots()
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    members: dict[int, list[int]] = {}
    users: dict[int, set[int]] = {}
    for nid, node in enumerate(g.nodes):
        start = -1 if node.op == "null" else nid
        for k in range(node.num_outputs):
            r = root[g.entry_id(nid, k)]
            members.setdefault(r, []).append(g.entry_id(nid, k))
            first[r] = min(first.get(r, start), start)
            last[r] = max(last.get(r, start), end if node.op == "null" else start)
            if runs(node):
                users.setdefault(r, set()).add(nid)
        for src_nid, idx, _ in node.inputs:
            r = root[g.entry_id(src_nid, idx)]
            last[r] = max(last[r], nid)
            if runs(node):
                users.setdefault(r, set()).add(nid)
    for nid, idx, _ in g.heads:
        last[root[g.entry_id(nid, idx)]] = end
    writers = entry_writers(g)  # a root's: every member's (views and pieces lie inside it)
    return {r: Group(r, first[r], last[r], tuple(m), tuple(sorted(users.get(r, ()))),
                     last[r] == end, writers[r])
            for r, m in members.items()}


class Order:
    """Happens-before between steps: a stream runs its nodes in node order, and a node waits
    for the nodes its ``waits`` name on other streams. A graph without streams runs in node
    order: ``conflict`` then compares live ranges, and no clocks are kept.

    ``clock[n][s]``: the position on stream ``s`` of the last node known to have finished
    before node ``n`` starts (vector clocks)."""

    def __init__(self, g: Graph | None = None):
        self.sequential = g is not None and g.streams is None
        self.stream: list[int] = []
        self.pos: list[int] = []
        self.clock: list[dict[int, int]] = []
        self._tail: dict[int, int] = {}
        self._last_uses: dict[int, dict[int, int]] = {}
        if g is not None and g.streams is not None:  # sequential: node order, see conflict()
            for nid, s in enumerate(g.streams):
                self.add(s, g.waits[nid] if g.waits is not None else ())

    def add(self, stream: int, waits=()) -> None:
        """The next node: on ``stream`` (-1: it does not run), after the nodes ``waits``."""
        self.stream.append(stream)
        self.pos.append(-1)
        self.clock.append({})
        if stream < 0:
            return
        for w in waits:
            self.wait(len(self.stream) - 1, w)
        if stream in self._tail:
            self.wait(len(self.stream) - 1, self._tail[stream])
            self.pos[-1] = self.pos[self._tail[stream]] + 1
        else:
            self.pos[-1] = 0
        self._tail[stream] = len(self.stream) - 1

    def wait(self, nid: int, prev: int) -> None:
        """Node ``nid`` starts after node ``prev`` (and all that ``prev`` came after)."""
        clock = self.clock[nid]
        for ps, pp in self.clock[prev].items():
            clock[ps] = max(clock.get(ps, -1), pp)
        clock[self.stream[prev]] = max(clock.get(self.stream[prev], -1), self.pos[prev])

    def before(self, a: int, b: int) -> bool:
        """Node ``a`` has finished before node ``b`` starts."""
        if self.sequential:
            return a < b
        return self.clock[b].get(self.stream[a], -1) >= self.pos[a]

    def precedes(self, a: Group, b: Group) -> bool:
        """Every use of ``a`` has finished before ``b`` is written (by each of its writers):
        they may share bytes."""
        if a.forever or b.writer < 0:
            return False
        uses = self._last_uses.get(a.root)
        if uses is None:
            uses = self._last_uses[a.root] = {}
            for u in a.users:
                uses[self.stream[u]] = max(uses.get(self.stream[u], -1), self.pos[u])
        return all(self.clock[w].get(s, -1) >= p for w in b.writers for s, p in uses.items())

    def conflict(self, a: Group, b: Group) -> bool:
        """``a`` and ``b`` may be live at once: they must not share bytes."""
        if self.sequential:
            return a.overlaps(b)
        return not (self.precedes(a, b) or self.precedes(b, a))


def inplace_pairs(g: Graph, groups: dict[int, Group] | None = None,
                  order: Order | None = None) -> dict[int, int]:
    """Output group root -> input group root, for every node that offers to write its output
    over an input (``attrs.inplace``) where that is safe: the input is written by a step and
    never read after this node (every other user happens before it, by ``order``), no other
    operand of the node is the same bytes, no view of it comes after the node, neither is kept
    for the whole run (an input, a param, a graph output), and both are the same bytes on one
    device. The planner gives such a pair one storage; the verifier accepts their overlap (and
    only at the same offset)."""
    groups = live_ranges(g) if groups is None else groups
    order = Order(g) if order is None else order
    root = g.alias_roots()
    pairs: dict[int, int] = {}
    taken: set[int] = set()
    for nid, node in enumerate(g.nodes):
        k = node.inplace
        if k is None or not runs(node):
            continue
        src = g.entry_id(*node.inputs[k][:2])
        out = g.entry_id(nid)
        gi, go = groups[root[src]], groups[root[out]]
        others = {root[g.entry_id(*i[:2])] for j, i in enumerate(node.inputs) if j != k}
        if (gi.writer < 0 or len(gi.writers) > 1 or gi.forever or go.forever or go.root != out
                or gi.root in taken
                or gi.root in others or g.entry_device(src) != g.entry_device(out)
                or group_bytes(g, gi) != g.entry_bytes(out) or g.dtypes[src] != g.dtypes[out]
                or gi.last > nid  # a view of it after this node, read or not
                or not all(u == nid or order.before(u, nid) for u in gi.users)):
            continue
        pairs[out] = gi.root
        taken.add(gi.root)
    return pairs


def inplace_chains(pairs: dict[int, int]) -> dict[int, int]:
    """In-place output root -> the root of its chain's first input (``inplace_pairs``: an
    output that is in turn written over resolves to where its chain began)."""
    first: dict[int, int] = {}
    for out, into in sorted(pairs.items()):  # node order: a chain's earlier link first
        first[out] = first.get(into, into)
    return first


def merged_ranges(g: Graph, order: Order | None = None,
                  pairs: dict[int, int] | None = None) -> dict[int, Group]:
    """``live_ranges`` with each in-place chain (``inplace_pairs``, or ``pairs`` when the
    caller has them) as one group, under the root of its first input: the same bytes from the
    input's writer to the last output's last use."""
    groups = live_ranges(g)
    pairs = inplace_pairs(g, groups, order) if pairs is None else pairs
    for out, into in inplace_chains(pairs).items():  # node order: earlier links first
        a, b = groups[into], groups.pop(out)
        groups[into] = Group(into, min(a.first, b.first), max(a.last, b.last),
                             a.members + b.members,
                             tuple(sorted(set(a.users) | set(b.users))), a.forever or b.forever,
                             tuple(sorted(set(a.writers) | set(b.writers))))
    return groups


def group_bytes(g: Graph, group: Group) -> int:
    """The bytes a group spans from its root's start (a concat piece lies past the start)."""
    offsets = g.entry_offsets()
    return max(offsets[e] + g.entry_bytes(e) for e in group.members)


def storage_devices(g: Graph, error: type[Exception]) -> dict[int, int]:
    """storage id -> the one device it lives on; ``error`` when entries of one storage id are
    on two devices."""
    owner: dict[int, tuple[int, int]] = {}
    for eid, sid in enumerate(g.storage_ids):
        dev = g.entry_device(eid)
        if owner.setdefault(sid, (dev, eid))[0] != dev:
            raise error(f"storage id {sid} is used on device {owner[sid][0]} (entry "
                        f"{owner[sid][1]}) and on device {dev} (entry {eid}): a storage belongs "
                        f"to one device")
    return {sid: dev for sid, (dev, _) in owner.items()}


def storage_bytes(g: Graph) -> dict[int, int]:
    """storage id -> its size: the largest entry using it (where it ends: a concat piece lies
    past the storage's start), rounded up to ``ALIGN``."""
    size: dict[int, int] = {}
    offsets = g.entry_offsets()
    for eid, sid in enumerate(g.storage_ids):
        size[sid] = max(size.get(sid, 0), align(offsets[eid] + g.entry_bytes(eid)))
    return size


def find_overlap(g: Graph) -> tuple[int, int, int] | None:
    """The first (entry, entry, node) whose bytes overlap while both may be live, or None.

    With the ``hgrt`` section, bytes are pool offsets per device; without it, each storage id
    is its own buffer. With streams, "may be live at once" is the happens-before order of
    ``Order``, not the node order."""
    order = Order(g)
    groups = live_ranges(g)
    inplace = {frozenset(p) for p in inplace_pairs(g, groups, order).items()}
    regions = []  # (device, buffer, byte_start, byte_end, group)
    for r, grp in groups.items():
        nbytes = group_bytes(g, grp)
        if nbytes == 0:
            continue  # an empty tensor owns no byte
        sid = g.storage_ids[r]
        if g.pool_bytes is not None:  # the weight pool (-2) or the activation pool (-1)
            start, buf = g.storage_offset[sid], -2 if g.pool_of(r)[1] else -1
        else:
            start, buf = 0, sid
        regions.append((g.entry_device(r), buf, start, start + nbytes, grp))
    regions.sort(key=lambda t: (t[0], t[1], t[2]))
    active: list[tuple] = []
    for reg in regions:  # sweep by bytes: the regions still open share bytes with this one
        active = [a for a in active if a[:2] == reg[:2] and a[3] > reg[2]]
        for a in active:
            if a[2:4] == reg[2:4] and frozenset((a[4].root, reg[4].root)) in inplace:
                continue  # an output written over its input, element by element
            if order.conflict(a[4], reg[4]):
                return a[4].root, reg[4].root, max(a[4].first, reg[4].first)
        active.append(reg)
    return None


def check_lifetimes(g: Graph, error: type[Exception]) -> None:
    """Raise ``error`` if two entries that are live at once share bytes; the message names
    both entries, their bytes and the node where they meet."""
    hit = find_overlap(g)
    if hit is None:
        return
    a, b, step = hit
    where = (f"storage {g.storage_ids[a]}" if g.pool_bytes is None else
             f"pool bytes [{g.storage_offset[g.storage_ids[a]]}, ...) and "
             f"[{g.storage_offset[g.storage_ids[b]]}, ...)")
    nid = max(step, 0)
    raise error(f"memory plan: entries {a} and {b} on device {g.entry_device(a)} share {where} "
                f"while both are live: they overlap at node {nid} '{g.nodes[nid].name}'\n"
                f"  entry {a}: {g.describe_entry(a)}\n  entry {b}: {g.describe_entry(b)}")


@dataclass
class DeviceMemory:
    """Bytes of one device's arena: planned, the lower bound (most bytes live at once, so no
    plan can do better), and the total without any reuse. Sizes are rounded up to ``ALIGN``."""

    device: int
    planned_bytes: int
    lower_bound: int
    no_reuse_bytes: int
    weight_bytes: int = 0  # of planned_bytes, the weight pool (shared by frames and modules)


def memory_report(g: Graph) -> list[DeviceMemory]:
    """Per device: planned bytes (the ``hgrt`` pools, else one buffer per storage id), the lower
    bound over the live ranges of entry groups, and the no-reuse total."""
    n_dev = 1 + max(g.device_index or [0])
    if g.pool_bytes is not None:
        n_dev = max(n_dev, len(g.pool_bytes))
    no_reuse = [0] * n_dev
    events: list[list[tuple[int, int]]] = [[] for _ in range(n_dev)]
    for root, grp in merged_ranges(g).items():
        dev = g.entry_device(root)
        nbytes = align(group_bytes(g, grp))
        no_reuse[dev] += nbytes
        events[dev] += [(grp.first, nbytes), (grp.last + 1, -nbytes)]  # live through `last`
    lower = []
    for ev in events:
        live = peak = 0
        for _, delta in sorted(ev):  # at one step, frees (negative) before allocations
            live += delta
            peak = max(peak, live)
        lower.append(peak)
    weights = list(g.weight_pool_bytes or []) + [0] * (n_dev - len(g.weight_pool_bytes or []))
    if g.pool_bytes is not None:
        planned = [a + w for a, w in zip(list(g.pool_bytes) + [0] * (n_dev - len(g.pool_bytes)),
                                         weights, strict=True)]
    else:
        planned = [0] * n_dev
        owner = storage_devices(g, ValueError)
        for sid, nbytes in storage_bytes(g).items():
            planned[owner[sid]] += nbytes
    return [DeviceMemory(d, p, lb, nr, w)
            for d, (p, lb, nr, w) in enumerate(zip(planned, lower, no_reuse, weights, strict=True))]
