"""Kernel quality on CPU: light squeezenet / resnet50 (random weights) run latency of
unscheduled TVM kernels vs hgrt's default CPU schedule (vs a tuned database) vs onnxruntime,
all at the same thread count, in one process, run through the Relax VM.

    python python/bench_kernels.py --threads 2
    python python/bench_kernels.py --models squeezenet --db tuning/ --tune-trials 16

``--tune-trials N`` tunes into ``--db`` first (resumable). onnxruntime is optional
(``pip install onnxruntime``; the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["squeezenet", "resnet50"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--target", choices=["host", "generic"], default="host",
                   help="host: llvm with this CPU's mcpu; generic: plain 'llvm'")
    p.add_argument("--repeat", type=int, default=20, help="timed runs (median reported)")
    p.add_argument("--db", default=None, help="MetaSchedule database dir (tuned column)")
    p.add_argument("--tune-trials", type=int, default=0, help="tune into --db first")
    p.add_argument("--skip-unscheduled", action="store_true")
    return p.parse_args()


def _time(fn, repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    args = _parse()
    # TVM's pool defaults to half the hardware threads on x86 (it assumes hyper-threading):
    # on a 2-vCPU machine that is 1 thread unless told
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    import numpy as np
    import tvm
    from kernel_testing import fused_module, input_shape, light_model
    from tvm import relax

    from hgrt.relay_passes.schedule_cpu import host_target, schedule_cpu_functions
    from hgrt.tune import apply_database, tune

    target = (host_target(args.threads) if args.target == "host"
              else tvm.target.Target({"kind": "llvm", "num-cores": args.threads}))
    print(f"target {target}; {args.threads} threads; load {os.getloadavg()[0]:.2f}")
    try:
        import onnxruntime as ort
    except ImportError:
        ort = None
        print("onnxruntime not installed: no onnxruntime column")

    rows = []
    for name in args.models:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = light_model(name)
            mod, params = fused_module(model)
        x = np.random.default_rng(1).standard_normal(input_shape(model)).astype("float32")
        dev = tvm.cpu()
        tvm_args = [tvm.runtime.tensor(a, dev) for a in [x, *params]]

        def vm_runner(m, _args=tvm_args, _dev=dev):
            f = relax.VirtualMachine(tvm.compile(m, target), _dev)["main"]

            def call():
                out = f(*_args)
                return out.numpy() if hasattr(out, "numpy") else out[0].numpy()
            return call

        res: dict[str, float] = {}
        outs = {}
        if not args.skip_unscheduled:
            run = vm_runner(mod)
            outs["unscheduled"] = run()
            res["unscheduled"] = _time(run, max(2, args.repeat // 10))
        t = time.perf_counter()
        sched, report = schedule_cpu_functions(mod, target)
        sched_s = time.perf_counter() - t
        run = vm_runner(sched)
        outs["default"] = run()
        res["default"] = _time(run, args.repeat)
        print(f"{name}: {report.summary()} in {sched_s:.2f} s")
        if args.db:
            if args.tune_trials:
                tune(mod, target, args.db, trials_per_task=args.tune_trials)
            tuned, rep = apply_database(mod, target, args.db)
            print(f"{name}: {rep.summary()}")
            run = vm_runner(schedule_cpu_functions(tuned, target)[0])
            outs["tuned"] = run()
            res["tuned"] = _time(run, args.repeat)
        if ort is not None:
            so = ort.SessionOptions()
            so.intra_op_num_threads = args.threads
            so.inter_op_num_threads = 1
            sess = ort.InferenceSession(model.SerializeToString(), so,
                                        providers=["CPUExecutionProvider"])
            feed = {sess.get_inputs()[0].name: x}
            outs["onnxruntime"] = sess.run(None, feed)[0]
            res["onnxruntime"] = _time(lambda s=sess, fd=feed: s.run(None, fd), args.repeat)
        ref = outs.get("onnxruntime", outs.get("unscheduled"))
        for k, o in outs.items():
            if ref is not None and k != "onnxruntime":
                err = float(np.abs(o.reshape(ref.shape) - ref).max())
                print(f"{name}: {k} max |diff| vs reference {err:.2e}")
        rows.append((name, res))

    print(f"\nlatency, ms (median), {args.threads} threads")
    cols = ["unscheduled", "default", "tuned", "onnxruntime"]
    print(f"{'model':12s}" + "".join(f"{c:>13s}" for c in cols)
          + "  unsched/default  default/ort  tuned/ort")
    for name, res in rows:
        line = f"{name:12s}" + "".join(
            f"{res[c] * 1e3:13.2f}" if c in res else f"{'-':>13s}" for c in cols)

        def ratio(a, b, r=res):
            return f"{r[a] / r[b]:8.1f}x" if a in r and b in r else f"{'-':>9s}"
        line += f"  {ratio('unscheduled', 'default'):>15s}  {ratio('default', 'onnxruntime'):>11s}"
        line += f"  {ratio('tuned', 'onnxruntime'):>9s}"
        print(line)


if __name__ == "__main__":
    main()
