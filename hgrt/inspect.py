"""Look inside compiled artifacts: nodes per device, copies, memory per device, and pictures;
per kernel, the device and provider that run it and why.

    hgrt inspect out/            # summary + out/inspect/graph.{dot,png} + memory_<dev>.png
    hgrt inspect out/ --ops      # and a table: node, op, device, provider, why
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections import Counter

from hgrt import providers
from hgrt.graph import CONCAT_FUNC, COPY_FUNC, NOP_FUNC, SLICE_FUNC, Graph
from hgrt.graph_format import DEVICE_WHY, PROVIDER_WHY, SPECIAL_FUNCS, VIEW_FUNCS
from hgrt.lifetimes import group_bytes, memory_report, merged_ranges
from hgrt.runtime.profiler import op_label

# One colour per device position (Graphviz / matplotlib names).
PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#b07aa1", "#76b7b2"]
NOT_RECORDED = "not recorded"  # a graph built before kernels carried their reasons


def summary(g: Graph) -> dict:
    names = g.device_names or [f"device {i}" for i in range(1 + max(g.device_index or [0]))]
    per_dev = Counter()
    copies = Counter()
    for nid, node in enumerate(g.nodes):
        if node.op != "tvm_op" or node.func_name in VIEW_FUNCS:
            continue
        dev = g.entry_device(g.entry_id(nid))
        if node.func_name == COPY_FUNC:
            src = g.entry_id(node.inputs[0][0], node.inputs[0][1])
            copies[(g.entry_device(src), dev)] += g.entry_bytes(src)
        else:
            per_dev[dev] += 1
    mem = memory_report(g)
    return {
        "devices": names,
        "kernels_per_device": {names[d]: per_dev[d] for d in range(len(names))},
        "copies": {f"{names[s]} -> {names[d]}": b for (s, d), b in sorted(copies.items())},
        "num_copies": sum(1 for n in g.nodes if n.func_name == COPY_FUNC),
        "memory": {names[d]: vars(m) for d, m in enumerate(mem) if d < len(names)},
        "streams": _streams(g, names),
        "providers": _providers(g),
        "reasons": reason_counts(op_rows(g)),
        # concats whose pieces their kernels write in place (concat_views): no step of their own
        "concat_views": sum(1 for n in g.nodes if n.func_name == CONCAT_FUNC),
        # copy kernels that read one contiguous range of their input (slice_views)
        "slice_views": sum(1 for n in g.nodes if n.func_name == SLICE_FUNC),
    }


def _providers(g: Graph) -> dict[str, int]:
    """Kernels by provider and the ISA it packed for (``onednn avx512_core: 53``: the
    provider's ``isa_attr``)."""
    def key(attrs: dict) -> str:
        p = providers.of_node(attrs)
        isa = attrs.get(p.isa_attr, "") if p is not None and p.isa_attr else ""
        return f"{attrs['provider']} {isa}".strip()
    return dict(Counter(key(n.attrs) for n in g.nodes
                        if n.op == "tvm_op" and "provider" in n.attrs))


def op_rows(g: Graph) -> list[dict[str, str]]:
    """Per kernel of ``g`` (copies and views aside), in graph order: its ``node``, the ``op`` it
    computes, its ``device`` and ``provider`` ("tvm": TVM's own kernel), and why each
    (``device_why``, ``provider_why``: what the build recorded, or ``NOT_RECORDED``)."""
    names = g.device_names or [f"device {i}" for i in range(1 + max(g.device_index or [0]))]
    rows = []
    for nid, node in enumerate(g.nodes):
        if node.op != "tvm_op" or node.func_name in SPECIAL_FUNCS:
            continue
        p = providers.of_node(node.attrs)
        op = node.attrs.get(p.op_attr, "") if p is not None and p.op_attr else ""
        rows.append({"node": node.name, "op": op or op_label(node.func_name),
                     "device": names[g.entry_device(g.entry_id(nid))],
                     "provider": node.attrs.get("provider", "tvm"),
                     "device_why": node.attrs.get(DEVICE_WHY, NOT_RECORDED),
                     "provider_why": node.attrs.get(PROVIDER_WHY, NOT_RECORDED)})
    return rows


def reason_kind(why: str) -> str:
    """What reasons are counted by: their words before the detail (``auto`` of ``auto: 1.2 ms
    on cuda:0 vs ...``, ``rule 'nn.conv2d'``, ``size floor``); a fallback from a device that
    cannot compile the op says which (``fallback: cuda:0 cannot compile it``).

    >>> reason_kind("fallback (cuda:0: data-dependent output shape)")
    'fallback: cuda:0 cannot compile it'
    """
    head = why.split(";")[0].strip()
    if head.startswith("fallback (") and ": " in head:
        return f"fallback: {head[len('fallback ('):].split(': ')[0]} cannot compile it"
    for sep in (": ", " ("):
        head = head.split(sep)[0]
    return head.strip() or NOT_RECORDED


def reason_counts(rows: list[dict[str, str]]) -> dict[str, dict[str, int]]:
    """How many kernels each kind of reason put on their provider and on their device:
    ``{"provider": {"onednn: auto": 26, "tvm: size floor": 3}, "device": {"cpu:0: fallback":
    29}}``."""
    out: dict[str, Counter] = {"provider": Counter(), "device": Counter()}
    for r in rows:
        out["provider"][f"{r['provider']}: {reason_kind(r['provider_why'])}"] += 1
        out["device"][f"{r['device']}: {reason_kind(r['device_why'])}"] += 1
    return {k: dict(c.most_common()) for k, c in out.items()}


def format_ops(rows: list[dict[str, str]]) -> str:
    """``op_rows`` as a table, one kernel a line: node, op, device, provider, why (the
    provider's reason, then the device's)."""
    table = [("node", "op", "device", "provider", "why")]
    table += [(r["node"], r["op"], r["device"], r["provider"],
               f"{r['provider']}: {r['provider_why']}; {r['device']}: {r['device_why']}")
              for r in rows]
    widths = [max(len(t[i]) for t in table) for i in range(4)]
    return "\n".join("  ".join([*(c.ljust(w) for c, w in zip(t[:4], widths, strict=True)),
                                t[4]]) for t in table)


def _streams(g: Graph, names: list[str]) -> dict[str, dict]:
    """Per stream: its device, steps, and the events its steps wait for (none: sequential)."""
    out: dict[str, dict] = {}
    for nid, s in enumerate(g.streams or []):
        if s >= 0:
            row = out.setdefault(f"stream {s}", {"device": names[g.entry_device(g.entry_id(nid))],
                                                 "steps": 0, "waits": 0})
            row["steps"] += 1
            row["waits"] += len(g.waits[nid])
    return out


def format_summary(s: dict) -> str:
    lines = ["kernels per device:"]
    lines += [f"  {d:<10} {n}" for d, n in s["kernels_per_device"].items()]
    by_provider: dict[str, list] = {}
    for key, n in s.get("providers", {}).items():  # "<provider> <isa>": packed for that ISA
        provider, _, isa = key.partition(" ")
        row = by_provider.setdefault(provider, [0, []])
        row[0] += n
        if isa:
            row[1].append(f"{n} with weights packed for {isa}")
    lines += [f"  of which {p}: {n}" + (f" ({', '.join(packed)})" if packed else "")
              for p, (n, packed) in by_provider.items()]
    for name, w in (s.get("provider_weights") or {}).items():
        p = providers.get(name) if name in providers.names() else None
        if w.get("blobs") and p is not None and p.format_weights is not None:
            lines.append(p.format_weights(w))
    for what, counts in (s.get("reasons") or {}).items():  # (hgrt inspect --ops: per kernel)
        if counts:
            lines.append(f"kernels by why of their {what}:")
            width = max(len(k) for k in counts)
            lines += [f"  {k:<{width}}  {n}" for k, n in counts.items()]
    if s.get("concat_views"):
        lines.append(f"concats written in place by their pieces' kernels: {s['concat_views']}")
    if s.get("slice_views"):
        lines.append(f"slices read in place (views of a range of their input): "
                     f"{s['slice_views']}")
    lines.append(f"copies: {s['num_copies']}")
    lines += [f"  {k}: {b} bytes per run" for k, b in s["copies"].items()]
    lines.append("streams: " + (", ".join(f"{k} on {v['device']}: {v['steps']} steps, waits "
                                          f"{v['waits']}" for k, v in s["streams"].items())
                                if s["streams"] else "none (steps run one after another)"))
    lines.append("memory per device (bytes):   planned   lower bound   no reuse   planned/bound")
    for d, m in s["memory"].items():
        ratio = m["planned_bytes"] / m["lower_bound"] if m["lower_bound"] else 1.0
        lines.append(f"  {d:<20} {m['planned_bytes']:>12} {m['lower_bound']:>13} "
                     f"{m['no_reuse_bytes']:>10} "
                     f"{ratio:>14.3f}")
    return "\n".join(lines)


def _drawn_nodes(g: Graph) -> list[int]:
    """Every node but the weights (tens of them fan into the first kernels and hide the graph)."""
    params = set(g.params or [])
    return [nid for nid, n in enumerate(g.nodes) if not (n.op == "null" and n.name in params)]


def _label(g: Graph, nid: int) -> str:
    node, eid = g.nodes[nid], g.entry_id(nid)
    shape = "x".join(str(d) for d in g.shapes[eid]) or "scalar"
    if node.op == "null":
        return f"{node.name}\n{shape}"
    if node.func_name == COPY_FUNC:
        return f"copy {g.entry_bytes(eid) / 1024:.0f} KiB"
    if node.func_name == NOP_FUNC:
        return f"view\n{shape}"
    if node.func_name == CONCAT_FUNC:
        return f"concat in place\n{shape}"
    if node.func_name == SLICE_FUNC:
        return f"view at byte {node.byte_offset}\n{shape}"
    return f"{op_label(node.func_name)}\n{shape}"


def _title(g: Graph, n_devices: int, hidden: int) -> str:
    funcs = [n.func_name for n in g.nodes if n.op == "tvm_op"]
    kernels = sum(1 for f in funcs if f != COPY_FUNC and f not in VIEW_FUNCS)
    return (f"{kernels} kernels on {n_devices} devices, {funcs.count(COPY_FUNC)} copies; "
            f"{hidden} weights not drawn")


def graph_dot(g: Graph) -> str:
    """The graph in Graphviz DOT: kernels filled with their device's colour, copies as red
    diamonds, weights left out (their count is in the title)."""
    names = g.device_names or [f"device {i}" for i in range(1 + max(g.device_index or [0]))]
    keep = _drawn_nodes(g)
    kept = set(keep)
    title = _title(g, len(names), len(g.nodes) - len(keep))
    lines = ["digraph hgrt {", f'  label="{title}"; labelloc=t; fontname=Helvetica;',
             "  rankdir=TB; nodesep=0.15; ranksep=0.25; node [style=filled, fontname=Helvetica, "
             "fontsize=9, fontcolor=white, height=0.3, margin=\"0.08,0.02\"];"]
    lines.append("  { rank=source; " + " ".join(f"legend{d}" for d in range(len(names))) + " }")
    for d, name in enumerate(names):
        lines.append(f'  legend{d} [label="{name}", shape=box, fillcolor="{PALETTE[d % 6]}"];')
    for nid in keep:
        node = g.nodes[nid]
        dev = g.entry_device(g.entry_id(nid))
        if node.op == "null":
            shape = "invhouse"
        elif node.func_name == COPY_FUNC:
            shape = 'diamond, color="#d62728", penwidth=2'
        else:
            shape = "box, style=\"filled,rounded\""
        label = _label(g, nid).replace("\n", "\\n")
        lines.append(f'  n{nid} [label="{label}", shape={shape}, '
                     f'fillcolor="{PALETTE[dev % 6]}"];')
        for src, _, _ in node.inputs:
            if src in kept:
                style = ' [color="#d62728", penwidth=2]' if node.func_name == COPY_FUNC else ""
                lines.append(f"  n{src} -> n{nid}{style};")
    lines.append("}")
    return "\n".join(lines)


def draw_graph(g: Graph, path_png: str) -> str | None:
    """Write ``path_png`` with Graphviz if ``dot`` is installed, else with matplotlib."""
    dot = shutil.which("dot")
    if dot:
        subprocess.run([dot, "-Tpng", "-Gdpi=80", "-o", path_png], input=graph_dot(g).encode(),
                       check=True)
        return path_png
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    keep = _drawn_nodes(g)
    kept = set(keep)
    # Layered layout: a node's row is one below its deepest drawn input.
    depth: dict[int, int] = {}
    for nid in keep:
        depth[nid] = 1 + max((depth[i] for i, _, _ in g.nodes[nid].inputs if i in kept),
                             default=-1)
    rows: dict[int, list[int]] = {}
    for nid in keep:
        rows.setdefault(depth[nid], []).append(nid)
    pos = {}
    for d, nids in rows.items():
        for k, nid in enumerate(nids):
            pos[nid] = (2.2 * (k - (len(nids) - 1) / 2), -d)
    width = max(len(v) for v in rows.values())
    fig, ax = plt.subplots(figsize=(max(6.0, 2.2 * width + 1), max(4.0, 0.42 * len(rows) + 1)))
    for nid in keep:
        node = g.nodes[nid]
        for src, _, _ in node.inputs:
            if src not in kept:
                continue
            (x0, y0), (x1, y1) = pos[src], pos[nid]
            copy = node.func_name == COPY_FUNC
            ax.annotate("", (x1, y1 + 0.18), (x0, y0 - 0.18), arrowprops={
                "arrowstyle": "->", "color": "#d62728" if copy else "#888888",
                "lw": 1.6 if copy else 0.7, "shrinkA": 0, "shrinkB": 0})
    names = g.device_names or [f"device {i}" for i in range(1 + max(g.device_index or [0]))]
    for nid in keep:
        dev = g.entry_device(g.entry_id(nid))
        copy = g.nodes[nid].func_name == COPY_FUNC
        ax.text(*pos[nid], _label(g, nid).replace("\n", "  "), ha="center", va="center",
                fontsize=6.5, color="white",
                bbox={"boxstyle": "round,pad=0.25", "fc": PALETTE[dev % 6],
                      "ec": "#d62728" if copy else "none", "lw": 1.6})
    for d, name in enumerate(names):
        ax.scatter([], [], color=PALETTE[d % 6], label=name, s=80, marker="s")
    ax.scatter([], [], facecolor="white", edgecolor="#d62728", label="copy", s=80, marker="s")
    ax.legend(loc="upper right", fontsize=8)
    ax.set_xlim(-1.1 * width - 1, 1.1 * width + 1)
    ax.set_ylim(-len(rows), 0.6)
    ax.axis("off")
    ax.set_title(_title(g, len(names), len(g.nodes) - len(keep)), fontsize=9)
    fig.tight_layout()
    fig.savefig(path_png, dpi=100)
    plt.close(fig)
    return path_png


def draw_memory(g: Graph, device: int, path_png: str) -> str | None:
    """Each entry of ``device`` as a box: x = the steps it is live, y = its bytes in the pool."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Rectangle
    except ImportError:
        return None
    n_steps = len(g.nodes)
    mem = memory_report(g)[device]
    # x is the kernel step: the i-th kernel call of run() (inputs and weights are not steps)
    step = [0] * (n_steps + 1)
    for nid, node in enumerate(g.nodes):
        step[nid + 1] = step[nid] + (node.op == "tvm_op")
    n_kernels = step[n_steps]

    def x_of(nid: int) -> int:
        return -1 if nid < 0 else step[min(nid, n_steps)]

    fig, ax = plt.subplots(figsize=(10, 5))
    pool = g.pool_bytes[device] if g.pool_bytes is not None and device < len(g.pool_bytes) else 0
    offsets: dict[int, int] = {}
    next_sid_base = 0
    for root, grp in sorted(merged_ranges(g).items()):  # an in-place pair: one box
        if g.entry_device(root) != device:
            continue
        lo, hi = grp.first, grp.last
        sid = g.storage_ids[root]
        nbytes = group_bytes(g, grp)
        if g.pool_bytes is not None:  # the weight pool drawn above the activations'
            y = g.storage_offset[sid] + (pool if g.pool_of(root)[1] else 0)
        else:  # classic layout: storages stacked in id order
            if sid not in offsets:
                offsets[sid] = next_sid_base
                next_sid_base += nbytes
            y = offsets[sid]
        node = g.nodes[g.node_of_entry(root)]
        colour = "#9c9c9c" if node.op == "null" else PALETTE[(sid * 7) % 6]
        x0, x1 = x_of(lo), x_of(hi)
        ax.add_patch(Rectangle((x0, y / 2**20), x1 - x0 + 1, nbytes / 2**20, fc=colour,
                               ec="black", lw=0.4, alpha=0.85))
    top = max(mem.planned_bytes, 1) / 2**20
    if mem.weight_bytes:
        ax.axhline(pool / 2**20, color="black", lw=0.8)
        ax.text(n_kernels + 1.4, pool / 2**20, "weight pool above ", ha="right", va="bottom",
                fontsize=8)
    ax.axhline(mem.lower_bound / 2**20, color="#d62728", ls="--", lw=1,
               label=f"lower bound {mem.lower_bound / 2**20:.2f} MiB")
    ax.set_xlim(-1.5, n_kernels + 1.5)
    ax.set_ylim(0, top * 1.05)
    ax.set_xlabel("kernel step of run() (inputs and weights live from -1 to the end, grey)")
    ax.set_ylabel("offset in the device's pools, MiB")
    name = (g.device_names or [f"device {device}"] * (device + 1))[device]
    ax.set_title(f"memory plan of {name}: {mem.planned_bytes / 2**20:.2f} MiB planned, "
                 f"lower bound {mem.lower_bound / 2**20:.2f} MiB\n"
                 f"({mem.no_reuse_bytes / 2**20:.2f} MiB without reuse; one box per tensor: "
                 f"steps live × bytes)", fontsize=10)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path_png, dpi=110)
    plt.close(fig)
    return path_png


def inspect_artifacts(directory: str, out_dir: str | None = None) -> tuple[dict, list[str]]:
    """Summary of the artifacts in ``directory`` and the pictures written for it."""
    from hgrt.artifacts import GRAPH_FILE, PARAMS_FILE, iter_params, paths, read_graph_text

    found = paths(directory)
    g = Graph.from_json(read_graph_text(found[GRAPH_FILE]))
    out_dir = out_dir or os.path.join(directory, "inspect")
    os.makedirs(out_dir, exist_ok=True)
    files = []
    dot_path = os.path.join(out_dir, "graph.dot")
    with open(dot_path, "w") as f:
        f.write(graph_dot(g))
    files.append(dot_path)
    png = draw_graph(g, os.path.join(out_dir, "graph.png"))
    if png:
        files.append(png)
    n_dev = len(memory_report(g))
    for d in range(n_dev):
        png = draw_memory(g, d, os.path.join(out_dir, f"memory_{d}.png"))
        if png:
            files.append(png)
    s = summary(g)
    s["ops"] = op_rows(g)  # (hgrt inspect --ops)
    s["provider_weights"] = {p.name: p.summarize_weights(iter_params(found[PARAMS_FILE]))
                             for p in providers.registered() if p.weights_summary}
    return s, files
