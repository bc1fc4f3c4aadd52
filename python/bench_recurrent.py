"""One recurrent layer's kernel (``hgrt/importer/recurrent_kernels.py``) timed alone on 1 and 2
threads (TVM's pool of the calling thread), built for this host or for ``--mcpu``: what the
time loop costs once the input projection is done. Random operands; best of 5 blocks of 50
calls after a warm-up call.

    python python/bench_recurrent.py                  # GRU, 256 units, 32 steps, batch 1
    python python/bench_recurrent.py --op LSTM --directions 2 --mcpu haswell
    python python/bench_recurrent.py --op LSTM --directions 2 --unroll 4   # not the target's
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import hgrt.spin  # noqa: F401  (before TVM loads)

os.environ.setdefault("TVM_NUM_THREADS", "2")  # the pool's size, set before it starts


def main() -> None:
    import numpy as np
    import tvm
    from bench_common import machine

    from hgrt.devices.host_cpu import host_target, vector_isa
    from hgrt.importer.recurrent_kernels import RecurrentLayer, kernel, unroll_for
    from hgrt.runtime.threads import set_thread_count

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--op", choices=["GRU", "LSTM", "RNN"], default="GRU")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--directions", type=int, choices=[1, 2], default=1)
    p.add_argument("--mcpu", help="build for this LLVM CPU (haswell: AVX2) instead of the host")
    p.add_argument("--unroll", type=int,
                   help="state values per pass over the gates (default: the target's, as a "
                        "build chooses)")
    args = p.parse_args()

    acts = {"GRU": ("Sigmoid", "Tanh"), "LSTM": ("Sigmoid", "Tanh", "Tanh"), "RNN": ("Tanh",)}
    dirs = ("forward", "reverse")[:args.directions]
    layer = RecurrentLayer(args.op, args.seq, args.batch, args.hidden, args.hidden, dirs,
                           (tuple((a, 0.0, 0.0) for a in acts[args.op]),) * len(dirs),
                           linear_before_reset=args.op == "GRU")
    target = host_target(2) if args.mcpu is None else tvm.target.Target(
        {"kind": "llvm", "mcpu": args.mcpu, "num-cores": 2})
    unroll = args.unroll or unroll_for(layer, [vector_isa(target)])
    layer = dataclasses.replace(layer, unroll=unroll)
    func = kernel(layer).with_attr("global_symbol", "main")
    run = tvm.compile(tvm.IRModule({"main": func}), target=target)["main"]
    rng = np.random.default_rng(0)
    operands = []
    for buf in func.params:  # (a PrimFunc's params are its buffers in TVM 0.27)
        shape = [int(d) for d in buf.shape]
        if str(buf.dtype) == "int32":  # the sequence lengths: every sequence at full length
            operands.append(tvm.runtime.tensor(np.full(shape, args.seq, "int32")))
        else:
            operands.append(tvm.runtime.tensor(
                (rng.standard_normal(shape) * 0.1).astype(str(buf.dtype))))
    print(machine())
    print(f"{args.op}, {args.hidden} units, {args.seq} steps, batch {args.batch}, "
          f"{len(dirs)} direction(s), built for {target.attrs.get('mcpu', 'the host')}, "
          f"unroll {unroll}")
    for threads in (1, 2):
        set_thread_count(threads)
        run(*operands)
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(50):
                run(*operands)
            best = min(best, (time.perf_counter() - t) / 50)
        print(f"{threads} thread(s): {best * 1e6:.1f} us a layer")


if __name__ == "__main__":
    main()
