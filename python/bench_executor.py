"""Per-op cost of hgrt's executor against the Relax VM, on the same kernels, in one process.

A chain of N tiny elementwise kernels (16 floats each) is run by hgrt.create and by
relax.VirtualMachine; both call the very same compiled PrimFunc. Prints µs per op and the ratio.

    python python/bench_executor.py [--ops 400] [--repeat 20] [--two-devices] [--callers 2]

With ``--callers N``: N threads at once, each running a module (and a VM) of its own; µs per op
is wall time over all the threads' ops. hgrt's step loop runs in native code, holding no GIL
between kernels; ``HGRT_NATIVE_STEPS=0`` runs it in Python, for comparison.
"""

from __future__ import annotations

import hgrt.spin  # noqa: F401  (first: the spin settings before TVM loads libgomp)

# isort: split
import argparse
import json
import threading
import time

import numpy as np
import tvm
from tvm import relax, te

import hgrt

SHAPE = (16,)


def kernel():
    a = te.placeholder(SHAPE, "float32", name="a")
    b = te.compute(SHAPE, lambda i: a[i] + tvm.tirx.const(1, "float32"), name="b")
    return te.create_prim_func([a, b]).with_attr("global_symbol", "add_one")


def relax_chain(n_ops: int) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(SHAPE, "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            gv = bb.add_func(kernel(), "add_one")
            y = x
            for _ in range(n_ops):
                y = bb.emit(relax.call_tir(gv, [y], relax.TensorType(SHAPE, "float32")))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


def hgrt_chain(n_ops: int, two_devices: bool) -> str:
    """The same chain as a graph JSON; with two_devices, the second half runs on device 1."""
    nodes = [{"op": "null", "name": "x", "inputs": []}]
    devs, sids = [0], [0]
    half = n_ops // 2
    for i in range(n_ops):
        dev = 1 if two_devices and i >= half else 0
        if two_devices and i == half:
            nodes.append({"op": "tvm_op", "name": "copy", "inputs": [[len(nodes) - 1, 0, 0]],
                          "attrs": {"func_name": "__copy", "num_inputs": "1",
                                    "num_outputs": "1"}})
            devs.append(1)
            sids.append(3)
        nodes.append({"op": "tvm_op", "name": f"add_one_{i}", "inputs": [[len(nodes) - 1, 0, 0]],
                      "attrs": {"func_name": "add_one", "num_inputs": "1", "num_outputs": "1",
                                "flatten_data": "0"}})
        devs.append(dev)
        sids.append(1 + 3 * dev + (i % 2))  # ping-pong between two storages per device
    n = len(nodes)
    sids[-1] = 6  # the output keeps its own storage
    doc = {"nodes": nodes, "arg_nodes": [0], "node_row_ptr": list(range(n + 1)),
           "heads": [[n - 1, 0, 0]],
           "attrs": {"shape": ["list_shape", [list(SHAPE)] * n],
                     "dltype": ["list_str", ["float32"] * n],
                     "storage_id": ["list_int", sids], "device_index": ["list_int", devs]}}
    return json.dumps(doc)


def per_op_us(fn, n_ops: int, repeat: int, number: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - t0) / number)
    return float(np.median(times)) / n_ops * 1e6


def together(fns: list, n_ops: int, repeat: int, number: int) -> float:
    """µs per op with every ``fns[i]`` looping in a thread of its own at once (wall time)."""
    for fn in fns:
        fn()

    def loop(fn):
        for _ in range(repeat * number):
            fn()

    threads = [threading.Thread(target=loop, args=(fn,)) for fn in fns]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return (time.perf_counter() - t0) / (repeat * number * n_ops * len(fns)) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=400)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--number", type=int, default=20)
    ap.add_argument("--callers", type=int, default=1,
                    help="threads at once, each with its own module and VM")
    ap.add_argument("--two-devices", action="store_true",
                    help="hgrt runs the second half on cpu:1 (one __copy in between)")
    args = ap.parse_args()

    mod = relax_chain(args.ops)
    exe = tvm.compile(mod, "llvm")
    vm = relax.VirtualMachine(exe, tvm.cpu(0))
    x_np = np.random.default_rng(0).standard_normal(SHAPE).astype("float32")
    x = tvm.runtime.tensor(x_np)
    vm.set_input("main", x)
    vm_fn = vm["main"]

    lib = tvm.tirx.build(tvm.IRModule({"add_one": kernel()}),
                         target="llvm")
    devices = [tvm.cpu(0), tvm.cpu(1)] if args.two_devices else [tvm.cpu(0)]
    m = hgrt.create(hgrt_chain(args.ops, args.two_devices), lib, devices)
    m.set_input("x", x_np)

    m.run()
    np.testing.assert_allclose(m.get_output(0).numpy(), vm_fn(x).numpy(), rtol=1e-5)

    if args.callers > 1:
        vms = [vm_fn] + [relax.VirtualMachine(exe, tvm.cpu(0))["main"]
                         for _ in range(args.callers - 1)]
        mods = [m] + [hgrt.create(hgrt_chain(args.ops, args.two_devices), lib, devices)
                      for _ in range(args.callers - 1)]
        for other in mods[1:]:
            other.set_input("x", x_np)
        vm_us = together([lambda f=f: f(x) for f in vms], args.ops, args.repeat, args.number)
        hg_us = together([mod.run for mod in mods], args.ops, args.repeat, args.number)
        how = f"{args.callers} threads at once, {args.repeat * args.number} runs each"
    else:
        vm_us = per_op_us(lambda: vm_fn(x), args.ops, args.repeat, args.number)
        hg_us = per_op_us(m.run, args.ops, args.repeat, args.number)
        how = f"median of {args.repeat} x {args.number} runs"
    from hgrt.runtime.step_loop import native_steps

    print(f"chain of {args.ops} kernels ({'cpu:0 + cpu:1' if args.two_devices else 'cpu:0'}), "
          f"{how}; hgrt's step loop in {'native code' if native_steps() else 'Python'}")
    print(f"  relax VM : {vm_us:7.3f} us/op")
    print(f"  hgrt     : {hg_us:7.3f} us/op")
    print(f"  ratio hgrt / VM: {hg_us / vm_us:.3f}x  (target <= 1.0x)")


if __name__ == "__main__":
    main()
