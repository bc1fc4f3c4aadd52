"""Streams: do independent branches overlap? Concurrent vs sequential vs one device.

A synthetic two-branch model (two chains of matmul+relu from one input, joined by an add) with
one branch on cpu:0 and the other on cpu:1, and the branchy zoo models (inception_v1,
inception_v2, densenet121) with two streams on one device and with the convolution rule over
two devices. Every row uses the same total cores: "seq" runs one step at a time (kernels on
``--threads`` threads, or on 1 where noted), "streams" runs the streams at once (the cores
split over them). Printed: run() medians, ratios, pool bytes of the stream-safe plan against
the sequential plan, and the Relax VM on one device for reference.

    python python/bench_concurrency.py [--models synthetic inception_v1 ...] [--markdown F]
"""

from __future__ import annotations

import hgrt.spin  # noqa: F401  (first: the spin settings before TVM loads libgomp)

# isort: split
import argparse
import os
import warnings

import numpy as np
from bench_common import light, median_time, table, vm_on_hgrt_kernels
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

import hgrt
from hgrt.devices import runtime_device, usable_cores
from hgrt.frontend import import_model
from hgrt.relay_passes.util.relax_util import bindings, op_name, tensor_args


def two_branch(depth: int = 4, size: int = 512, batch: int = 256):
    rng = np.random.default_rng(0)
    nodes, inits, ends = [], [], []
    for br in "ab":
        prev = "x"
        for i in range(depth):
            w = (rng.standard_normal((size, size)) / np.sqrt(size)).astype("float32")
            inits.append(numpy_helper.from_array(w, f"{br}w{i}"))
            nodes += [helper.make_node("MatMul", [prev, f"{br}w{i}"], [f"{br}m{i}"]),
                      helper.make_node("Relu", [f"{br}m{i}"], [f"{br}{i}"])]
            prev = f"{br}{i}"
        ends.append(prev)
    nodes.append(helper.make_node("Add", ends, ["y"]))
    graph = helper.make_graph(
        nodes, "two_branch", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, size])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    mod, _ = import_model(model, None, None)
    second = _depending_on(mod, "bw")
    inputs = {"x": rng.standard_normal((batch, size)).astype("float32")}
    return model, inputs, hgrt.Placement(overrides=dict.fromkeys(second, "cpu:1"))


def _depending_on(mod, prefix: str) -> list[str]:
    """The op bindings of main that read, directly or not, a parameter named ``prefix...``,
    but not the join (an add reading both branches)."""
    seen = {p.name for p in mod["main"].params if p.name.startswith(prefix)}
    found = []
    for b in bindings(mod["main"]):
        reads = {a.name for a in tensor_args(b.value) if isinstance(a, relax.Var)} \
            if op_name(b.value) else set()
        if reads & seen and op_name(b.value) != "relax.add":
            seen.add(b.var.name)
            found.append(b.var.name)
    return found


def run_time(res, inputs, devices, repeat: int, parallel: bool, threads: dict | None = None):
    m = hgrt.create(res.graph, res.lib, [runtime_device(d) for d in devices])
    m.load_params(res.params)
    m.set_input(**inputs)
    if threads is not None:
        m.configure_streams(threads=threads)
    t = median_time(lambda: m.run(parallel=parallel), repeat)
    return t, m


def one_thread_per_kernel(m, repeat: int) -> float:
    """run(parallel=False) with every kernel on one thread: the work the streams split."""
    before = os.environ.get("TVM_NUM_THREADS")
    os.environ["TVM_NUM_THREADS"] = "1"
    try:
        return median_time(lambda: m.run(parallel=False), repeat)
    finally:
        os.environ["TVM_NUM_THREADS"] = before or str(usable_cores())
        m.run(parallel=False)  # back to every core on this thread


# streams kept even where they cost memory (the default build drops a device's extra streams
# when its pool would grow over 1.10x the sequential plan's; the row's notes say if it did)
TWO_STREAMS = {"per_device": 2, "memory_slack": None}


def _capped_note(model, devices, placement, streams, kernels) -> str:
    if streams is not TWO_STREAMS:
        return ""
    capped = hgrt.build(model, devices, placement, streams={"per_device": 2}, kernels=kernels)
    n = len({s for s in capped.graph.streams or [] if s >= 0})
    return f"; default build (memory cap 1.10x): {max(n, 1)} stream(s)"


def configs(name: str):
    """(label, model, inputs, devices, placement, streams options) to compare."""
    if name == "synthetic":
        model, inputs, split = two_branch()
        return [("one device", model, inputs, ["cpu:0"], None, {}),
                ("branch per device", model, inputs, ["cpu:0", "cpu:1"], split, {}),
                ("two streams, one device", model, inputs, ["cpu:0"], None, TWO_STREAMS)]
    mdl = light(name)
    conv = hgrt.Placement(rules={"nn.conv2d": "cpu:1"}, fallback="cpu:0")
    return [("one device", mdl.model, mdl.inputs, ["cpu:0"], None, {}),
            ("two streams, one device", mdl.model, mdl.inputs, ["cpu:0"], None, TWO_STREAMS),
            ("conv rule, two devices", mdl.model, mdl.inputs, ["cpu:0", "cpu:1"], conv, {})]


def bench(name: str, repeat: int, kernels: str) -> list[str]:
    rows, base = [], None
    cores = usable_cores()
    for label, model, inputs, devices, placement, streams in configs(name):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = hgrt.build(model, devices, placement, streams=streams, kernels=kernels)
            seq_plan = hgrt.build(model, devices, placement, streams={"single_stream": True},
                                  kernels=kernels)
            capped = _capped_note(model, devices, placement, streams, kernels)
        seq, m = run_time(res, inputs, devices, repeat, parallel=False)
        base = base or seq
        if m._streams is None:
            rows.append(f"| {name} | {label} | {seq * 1e3:.2f} | - | - | {seq / base:.2f} | "
                        f"streams cannot overlap: sequential |")
        else:
            per = {hgrt.devices.device_name(m.devices[d]): max(1, cores // len(devices))
                   for d in range(len(devices))}
            con, _ = run_time(res, inputs, devices, repeat, parallel=True, threads=per)
            seq1 = one_thread_per_kernel(m, repeat)
            mem = sum(res.graph.pool_bytes) / max(1, sum(seq_plan.graph.pool_bytes))
            rows.append(f"| {name} | {label} | {seq * 1e3:.2f} | {con * 1e3:.2f} | "
                        f"{con / seq:.2f} | {min(seq, con) / base:.2f} | sequential at 1 "
                        f"thread per kernel {seq1 * 1e3:.2f} ms (streams {con / seq1:.2f}x "
                        f"that); pools {mem:.2f}x "
                        f"the sequential plan; {len(m._streams.streams)} streams, threads "
                        f"{m._streams.threads}{capped} |")
        print(rows[-1], flush=True)
    vm = vm_on_hgrt_kernels(configs(name)[0][1], configs(name)[0][2])
    rows.append(f"| {name} | Relax VM, one device | {median_time(vm.run, repeat) * 1e3:.2f} | "
                f"- | - | - | reference |")
    print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+",
                    default=["synthetic", "inception_v1", "inception_v2", "densenet121"])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--kernels", default="tvm", choices=("tvm", "onednn", "auto"),
                    help="kernel provider (default tvm: its pool threads follow the budget)")
    ap.add_argument("--markdown", help="write the table into this markdown file")
    args = ap.parse_args()
    head = ["| model | placement | sequential ms | streams at once ms | streams / sequential | "
            "best / one device | notes |", "|---|---|---|---|---|---|---|"]
    table(args.markdown, "bench_concurrency",
          f"python python/bench_concurrency.py --repeat {args.repeat} --kernels {args.kernels} "
          f"--models {' '.join(args.models)}", head,
          lambda: [r for name in args.models for r in bench(name, args.repeat, args.kernels)])


if __name__ == "__main__":
    main()
