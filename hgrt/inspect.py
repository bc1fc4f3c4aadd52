"""Look inside compiled artifacts: nodes per device, copies, memory per device, and pictures.

    hgrt inspect out/            # summary + out/inspect/graph.{dot,png} + memory_<dev>.png
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections import Counter

from hgrt.graph import COPY_FUNC, NOP_FUNC, Graph, live_ranges, memory_report

# One colour per device position (Graphviz / matplotlib names).
PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#b07aa1", "#76b7b2"]


def summary(g: Graph) -> dict:
    names = g.device_names or [f"device {i}" for i in range(1 + max(g.device_index or [0]))]
    per_dev = Counter()
    copies = Counter()
    for nid, node in enumerate(g.nodes):
        if node.op != "tvm_op" or node.func_name == NOP_FUNC:
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
    }


def format_summary(s: dict) -> str:
    lines = ["kernels per device:"]
    lines += [f"  {d:<10} {n}" for d, n in s["kernels_per_device"].items()]
    lines.append(f"copies: {s['num_copies']}")
    lines += [f"  {k}: {b} bytes per run" for k, b in s["copies"].items()]
    lines.append("memory per device (bytes):   planned   lower bound   no reuse   planned/bound")
    for d, m in s["memory"].items():
        ratio = m["planned_bytes"] / m["lower_bound"] if m["lower_bound"] else 1.0
        lines.append(f"  {d:<20} {m['planned_bytes']:>12} {m['lower_bound']:>13} "
                     f"{m['no_reuse_bytes']:>10} "
                     f"{ratio:>14.3f}")
    return "\n".join(lines)


def graph_dot(g: Graph) -> str:
    """The graph in Graphviz DOT: nodes filled with their device's colour, copies as diamonds."""
    names = g.device_names or [f"device {i}" for i in range(1 + max(g.device_index or [0]))]
    lines = ["digraph hgrt {", "  rankdir=TB; node [style=filled, fontname=Helvetica, "
             "fontsize=10, fontcolor=white];"]
    for d, name in enumerate(names):
        lines.append(f'  legend{d} [label="{name}", shape=box, fillcolor="{PALETTE[d % 6]}"];')
    for nid, node in enumerate(g.nodes):
        dev = g.entry_device(g.entry_id(nid))
        eid = g.entry_id(nid)
        label = f"{node.name}\\n{list(g.shapes[eid])} {g.dtypes[eid]}"
        if node.op == "null":
            shape = "box" if node.name in g.params else "invhouse"
        elif node.func_name == COPY_FUNC:
            shape = "diamond"
            label = f"copy\\n{g.entry_bytes(eid)} B"
        else:
            shape = "ellipse"
        lines.append(f'  n{nid} [label="{label}", shape={shape}, '
                     f'fillcolor="{PALETTE[dev % 6]}"];')
        for src, _, _ in node.inputs:
            style = ' [color="#d62728", penwidth=2]' if node.func_name == COPY_FUNC else ""
            lines.append(f"  n{src} -> n{nid}{style};")
    lines.append("}")
    return "\n".join(lines)


def draw_graph(g: Graph, path_png: str) -> str | None:
    """Write ``path_png`` with Graphviz if ``dot`` is installed, else with matplotlib."""
    dot = shutil.which("dot")
    if dot:
        subprocess.run([dot, "-Tpng", "-o", path_png], input=graph_dot(g).encode(), check=True)
        return path_png
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    # Layered layout: a node's row is one below its deepest input.
    depth = []
    for node in g.nodes:
        depth.append(1 + max((depth[i] for i, _, _ in node.inputs), default=-1))
    rows: dict[int, list[int]] = {}
    for nid, d in enumerate(depth):
        rows.setdefault(d, []).append(nid)
    pos = {}
    for d, nids in rows.items():
        for k, nid in enumerate(nids):
            pos[nid] = (k - (len(nids) - 1) / 2, -d)
    width = max(len(v) for v in rows.values())
    fig, ax = plt.subplots(figsize=(max(6, 2.2 * width), max(4, 0.9 * len(rows))))
    for nid, node in enumerate(g.nodes):
        for src, _, _ in node.inputs:
            (x0, y0), (x1, y1) = pos[src], pos[nid]
            copy = node.func_name == COPY_FUNC
            ax.annotate("", (x1, y1), (x0, y0), arrowprops={
                "arrowstyle": "->", "color": "#d62728" if copy else "#555555",
                "lw": 2 if copy else 0.8})
    names = g.device_names or [f"device {i}" for i in range(1 + max(g.device_index or [0]))]
    for nid, node in enumerate(g.nodes):
        dev = g.entry_device(g.entry_id(nid))
        copy = node.func_name == COPY_FUNC
        label = "copy" if copy else node.name[:28]
        ax.text(*pos[nid], label, ha="center", va="center", fontsize=7, color="white",
                bbox={"boxstyle": "round4" if not copy else "darrow", "fc": PALETTE[dev % 6],
                      "ec": "#d62728" if copy else "none", "lw": 2})
    for d, name in enumerate(names):
        ax.scatter([], [], color=PALETTE[d % 6], label=name, s=80)
    ax.scatter([], [], color="#d62728", marker=">", label="__copy", s=60)
    ax.legend(loc="upper right", fontsize=8)
    ax.set_xlim(-width / 2 - 1, width / 2 + 1)
    ax.set_ylim(-len(rows), 1)
    ax.axis("off")
    ax.set_title(f"{len(g.nodes)} nodes across {len(names)} devices")
    fig.tight_layout()
    fig.savefig(path_png, dpi=110)
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
    fig, ax = plt.subplots(figsize=(10, 5))
    offsets: dict[int, int] = {}
    next_sid_base = 0
    for root, (lo, hi, group) in sorted(live_ranges(g).items()):
        if g.entry_device(root) != device:
            continue
        sid = g.storage_ids[root]
        nbytes = max(g.entry_bytes(e) for e in group)
        if g.pool_bytes is not None:
            y = g.storage_offset[sid]
        else:  # classic layout: storages stacked in id order
            if sid not in offsets:
                offsets[sid] = next_sid_base
                next_sid_base += nbytes
            y = offsets[sid]
        node = g.nodes[next(n for n in range(n_steps) if g.entry_id(n) <= root <
                            g.node_row_ptr[n + 1])]
        colour = "#9c9c9c" if node.op == "null" else PALETTE[(sid * 7) % 6]
        ax.add_patch(Rectangle((max(lo, -1), y), hi - max(lo, -1) + 1, nbytes, fc=colour,
                               ec="black", lw=0.4, alpha=0.85))
    top = max(mem.planned_bytes, 1)
    ax.axhline(mem.lower_bound, color="#d62728", ls="--", lw=1,
               label=f"lower bound {mem.lower_bound} B")
    ax.set_xlim(-1, n_steps + 1)
    ax.set_ylim(0, top * 1.05)
    ax.set_xlabel("step (node id)")
    ax.set_ylabel("byte offset in pool")
    name = (g.device_names or [f"device {device}"] * (device + 1))[device]
    ax.set_title(f"memory plan of {name}: {mem.planned_bytes} B planned, lower bound "
                 f"{mem.lower_bound} B, {mem.no_reuse_bytes} B without reuse (grey: inputs/params)")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path_png, dpi=110)
    plt.close(fig)
    return path_png


def inspect_artifacts(directory: str, out_dir: str | None = None) -> tuple[dict, list[str]]:
    """Summary of the artifacts in ``directory`` and the pictures written for it."""
    from hgrt.artifacts import read

    graph_json, _, _ = read(directory)
    g = Graph.from_json(graph_json)
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
    return summary(g), files
