"""Per-op profiling of a GraphModule: where the time of a run goes, by op and by device, each
step named as a person would say it (``op_label``) with its FLOPs and bytes (``node_work``, also
the cost estimate of the streams, ``runtime/streams.py``).

    report = m.profile(repeat=20)
    print(report.table())                    # slowest first
    report.save_chrome_trace("trace.json")   # open in Perfetto / chrome://tracing
"""

from __future__ import annotations

import json
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from hgrt import providers
from hgrt.graph import COPY_FUNC, Graph
from hgrt.graph_format import VIEW_FUNCS
from hgrt.runtime.threads import restore_thread_count


def node_work(g: Graph, nid: int) -> tuple[float, float]:
    """FLOPs and bytes (read and written) of node ``nid``'s kernel or copy: the node's ``flops``
    attr where the compiler knew them (a oneDNN kernel, whose weights are a packed blob), else
    from its entries' shapes: a convolution's output x its weight's size per output channel, a
    matmul's output x its reduction length, x2; 0 FLOPs else."""
    node = g.nodes[nid]
    out = g.entry_id(nid)
    ins = [g.entry_id(i, k) for i, k, _ in node.inputs]
    elems = float(np.prod(g.shapes[out], dtype=np.float64))
    nbytes = float(sum(g.entry_bytes(e) for e in ins) + g.entry_bytes(out))
    if "flops" in node.attrs:
        return float(node.attrs["flops"]), nbytes
    label = op_label(node.func_name or "")
    if "conv" in label and len(ins) > 1 and len(g.shapes[ins[1]]) > 2:  # (not a packed blob)
        w = g.shapes[ins[1]]  # OIHW, or blocked by output channels (OIHW16o: O/16, I, H, W, 16)
        blocked = len(w) == len(g.shapes[out]) + 1  # plain weights have the output's rank
        c_out = w[0] * (w[-1] if blocked else 1)
        return 2 * elems * float(np.prod(w, dtype=np.float64)) / c_out, nbytes
    if ("matmul" in label or "dense" in label) and ins and g.shapes[ins[0]]:
        return 2 * elems * g.shapes[ins[0]][-1], nbytes
    return 0.0, nbytes


def op_label(func_name: str) -> str:
    """A kernel's function name as a person would say it: ``fused_conv2d3_add2_llvm_relu2_llvm``
    → ``conv2d+add+relu``."""
    parts = [p for p in func_name.split("_") if p not in ("fused", "llvm", "cuda", "")]
    words: list[str] = []
    for p in parts:
        p = p.rstrip("0123456789") or p
        if p in ("dims", "dim", "to", "pool2d", "2d") and words:  # expand_dims, broadcast_to
            words[-1] += "_" + p
        elif not words or words[-1] != p:
            words.append(p)
    return "+".join(words)[:40]


@dataclass
class OpRecord:
    """One step of the run: a kernel or a copy, with its median time over the repeats."""

    node_id: int
    name: str
    func: str
    device: str
    median_us: float
    is_copy: bool = False
    copy_bytes: int = 0
    copy_from: str = ""
    flops: float = 0.0  # of a convolution or matmul kernel (its anchor), else 0
    nbytes: float = 0.0  # read and written
    label: str = ""  # what it computes: "conv2d+add+relu", "onednn conv2d+relu", "copy", "view"


@dataclass
class ProfileReport:
    ops: list[OpRecord]
    run_wall_us: float  # median wall time of a plain run()
    repeat: int
    trace_events: list[dict] = field(default_factory=list)

    @property
    def op_sum_us(self) -> float:
        return sum(op.median_us for op in self.ops)

    def rates(self) -> dict[str, dict[str, float]]:
        """Per device what its kernels sustained: FLOP/s of convolutions and matmuls, bytes/s
        of the others (what automatic placement reads instead of its estimates)."""
        sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
        for op in self.ops:
            if not op.is_copy:
                acc = sums[op.device]
                i = 0 if op.flops else 2
                acc[i] += op.flops or op.nbytes
                acc[i + 1] += op.median_us * 1e-6
        return {d: {k: v[i] / v[i + 1] for k, i in (("flops_per_s", 0), ("bytes_per_s", 2))
                    if v[i + 1] > 0} for d, v in sums.items()}

    def save_rates(self, path: str) -> str:
        with open(path, "w") as f:
            json.dump({"rates": self.rates()}, f, indent=1)
        return path

    def by_device(self) -> dict[str, tuple[int, float]]:
        """device -> (steps, total median µs)."""
        out: dict[str, list] = defaultdict(lambda: [0, 0.0])
        for op in self.ops:
            out[op.device][0] += 1
            out[op.device][1] += op.median_us
        return {k: (v[0], v[1]) for k, v in out.items()}

    def copy_bytes(self) -> dict[str, int]:
        """"src -> dst" -> bytes copied per run."""
        out: dict[str, int] = defaultdict(int)
        for op in self.ops:
            if op.is_copy:
                out[f"{op.copy_from} -> {op.device}"] += op.copy_bytes
        return dict(out)

    def by_op(self) -> dict[str, tuple[int, float]]:
        """op (``conv2d+add+relu``, ``onednn conv2d+relu``, ``copy``, ``view``) -> (calls, total
        median µs)."""
        out: dict[str, list] = defaultdict(lambda: [0, 0.0])
        for op in self.ops:
            out[op.label][0] += 1
            out[op.label][1] += op.median_us
        return {k: (v[0], v[1]) for k, v in sorted(out.items(), key=lambda kv: -kv[1][1])}

    def table(self, top: int | None = None) -> str:
        """A text table, slowest op first, then the summaries by op, by device and copies, and
        the sum of op times next to the wall time of ``run()`` (the difference is the runtime's
        own cost: the loop, argument passing, and anything between the kernels)."""
        rows = sorted(self.ops, key=lambda op: -op.median_us)[:top]
        w = max([len(op.name) for op in rows] + [4])
        fw = max([len(op.label) for op in rows] + [2])
        lines = [f"{'node':>5}  {'name':<{w}}  {'op':<{fw}}  {'device':<8} "
                 f"{'median us':>10} {'%':>6}"]
        total = self.op_sum_us or 1.0
        for op in rows:
            share = 100 * op.median_us / total
            lines.append(f"{op.node_id:>5}  {op.name:<{w}}  {op.label:<{fw}}  "
                         f"{op.device:<8} {op.median_us:>10.1f} {share:>5.1f}%")
        lines.append("")
        lines.append("by op:")
        top_ops = list(self.by_op().items())[:10]
        ow = max([len(name) for name, _ in top_ops] + [32])
        for name, (n, us) in top_ops:
            lines.append(f"  {name:<{ow}} {n:>4} calls {us:>12.1f} us {100 * us / total:>5.1f}%")
        lines.append("by device:")
        for dev, (n, us) in self.by_device().items():
            lines.append(f"  {dev:<8} {n:>5} steps {us:>12.1f} us {100 * us / total:>5.1f}%")
        copies = self.copy_bytes()
        n_copies = sum(op.is_copy for op in self.ops)
        lines.append(f"copies: {n_copies} per run" + "".join(
            f"\n  {k}: {v / 2**20:.2f} MiB" for k, v in copies.items()))
        lines.append(f"sum of op medians {self.op_sum_us:.1f} us; run() wall time "
                     f"{self.run_wall_us:.1f} us (median of {self.repeat})")
        return "\n".join(lines)

    def chrome_trace(self) -> dict:
        return {"traceEvents": self.trace_events, "displayTimeUnit": "ms"}

    def save_chrome_trace(self, path: str) -> str:
        with open(path, "w") as f:
            json.dump(self.chrome_trace(), f)
        return path


def _label(func: str, is_copy: bool, attrs: dict) -> str:
    """What a step computes, for tables: a provider's kernel by its name and the ops it fused
    (its ``op_attr``: ``onednn conv2d+relu``), a TVM kernel by its function's name
    (``op_label``)."""
    if is_copy:
        return "copy"
    if func in VIEW_FUNCS:
        return "view"
    provider = providers.of_node(attrs)
    if provider is not None and provider.op_attr and attrs.get(provider.op_attr):
        return f"{provider.name} {attrs[provider.op_attr]}"
    return op_label(func)


def profile(module, run, trace_streams, repeat: int = 10, warmup: int = 1) -> ProfileReport:
    """Time every step of ``module`` (a local GraphModule, claimed by the caller: ``run()`` and
    ``trace_streams()`` run it under that claim) ``repeat`` times."""
    g = module.graph
    steps = module.steps
    sync = module.sync
    for _ in range(warmup):
        run()
    restore_thread_count()  # steps below run on this thread: every core, as a plain run()
    samples: list[list[float]] = [[] for _ in steps]
    last_run: list[tuple[float, float]] = []
    clock = time.perf_counter
    for _ in range(repeat):
        last_run = []
        for i, step in enumerate(steps):
            t0 = clock()
            try:
                step.func(*step.args)
            except Exception as e:
                raise module.execution_error(i, e) from e
            sync()
            t1 = clock()
            samples[i].append((t1 - t0) * 1e6)
            last_run.append((t0, t1))
    walls = []
    for _ in range(repeat):
        sync()
        t0 = clock()
        run()
        sync()
        walls.append((clock() - t0) * 1e6)

    ops = []
    dev_names = [str(d) for d in module.devices]
    for i, nid in enumerate(step.node for step in steps):
        node = g.nodes[nid]
        out_eid = g.entry_id(nid)
        rec = OpRecord(nid, node.name, node.func_name, dev_names[g.entry_device(out_eid)],
                       statistics.median(samples[i]))
        rec.flops, rec.nbytes = node_work(g, nid)
        rec.label = _label(node.func_name, node.func_name == COPY_FUNC, node.attrs)
        if node.func_name == COPY_FUNC:
            src = g.entry_id(node.inputs[0][0], node.inputs[0][1])
            rec.is_copy = True
            rec.copy_bytes = g.entry_bytes(src)
            rec.copy_from = dev_names[g.entry_device(src)]
        ops.append(rec)

    return ProfileReport(ops, statistics.median(walls), repeat,
                         _trace(module, ops, last_run, trace_streams()))


def _trace(module, ops: list[OpRecord], last_run: list[tuple[float, float]],
           traced: tuple | None) -> list[dict]:
    """Chrome trace events: a track per device from the last timed run; when the module runs
    streams at once (``traced``: its runner and a record of one run), a track per stream from
    one real concurrent run (its overlap)."""
    tracks = [str(d) for d in module.devices]
    where = [tracks.index(rec.device) for rec in ops]
    if traced is not None:
        runner, record = traced
        tracks = [f"stream {s} ({ops[runner.stream_of.index(s)].device})"
                  for s in range(len(runner.streams))]
        last_run = [(0.0, 0.0)] * len(ops)
        where = list(runner.stream_of)
        for idx, _, t0, t1 in record:
            last_run[idx] = (t0, t1)
    events = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "hgrt run"}}]
    events += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": t, "args": {"name": name}}
               for t, name in enumerate(tracks)]
    origin = min((t0 for t0, _ in last_run), default=0.0)
    for rec, tid, (t0, t1) in zip(ops, where, last_run, strict=True):
        args = {"node": rec.node_id, "function": rec.func, "op": rec.label}
        if rec.is_copy:
            args.update(bytes=rec.copy_bytes, src=rec.copy_from)
        cat = "copy" if rec.is_copy else "kernel"
        events.append({"name": rec.name, "cat": cat, "ph": "B", "pid": 0, "tid": tid,
                       "ts": (t0 - origin) * 1e6, "args": args})
        events.append({"name": rec.name, "cat": cat, "ph": "E", "pid": 0, "tid": tid,
                       "ts": (t1 - origin) * 1e6})
    return events
