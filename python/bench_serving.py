"""Many callers, one module: throughput of hgrt's call API against onnxruntime, one session.

For 1, 2 and 4 callers (threads), each caller runs ``--calls`` inferences; hgrt gives each call
``cores // callers`` kernel threads and its own activation frame (one copy of the weights),
onnxruntime one InferenceSession with ``cores // callers`` intra-op threads shared by the callers.
Printed: inferences per second, hgrt / its own single caller, hgrt / onnxruntime, and the
memory one more frame costs (activation pools only) against the weights.

    python python/bench_serving.py [--models squeezenet resnet50] [--calls 50] [--markdown F]
"""

from __future__ import annotations

import argparse
import os
import threading
import time
import warnings

from bench_common import light, ort_feed, ort_session, table

import hgrt
from hgrt.devices import usable_cores
from hgrt.lifetimes import memory_report

CALLERS = (1, 2, 4)


def throughput(call, callers: int, calls: int) -> float:
    """Inferences per second with ``callers`` threads each making ``calls`` calls."""
    call()  # warm: frames, thread pools
    start = threading.Barrier(callers + 1)

    def worker():
        start.wait()
        for _ in range(calls):
            call()

    threads = [threading.Thread(target=worker) for _ in range(callers)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return callers * calls / (time.perf_counter() - t0)


def bench(name: str, calls: int) -> list[str]:
    mdl = light(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = hgrt.build(mdl.model, ["cpu"])
    m = hgrt.create(res.graph, res.lib, [hgrt.devices.runtime_device("cpu:0")])
    m.load_params(res.params)
    (mem,) = memory_report(res.graph)
    cores = usable_cores()
    rows, base = [], None
    for callers in CALLERS:
        threads = max(1, cores // callers)
        m.configure_calls(callers=callers, threads_per_call=threads)
        ours = throughput(lambda: m(mdl.inputs), callers, calls)
        base = base or ours
        sess = ort_session(mdl.model, threads)
        theirs = None
        if sess is not None:
            feed = ort_feed(sess, mdl.model, mdl.inputs)
            theirs = throughput(lambda s=sess, f=feed: s.run(None, f), callers, calls)
            del sess
        ratio = f"{ours / theirs:.2f}" if theirs else "-"
        rows.append(f"| {name} | {callers} x {threads} | {ours:.1f} | {ours / base:.2f} | "
                    f"{theirs:.1f} | {ratio} |" if theirs else
                    f"| {name} | {callers} x {threads} | {ours:.1f} | {ours / base:.2f} | - | - |")
        print(rows[-1], flush=True)
    frame = sum(m.frame_bytes)
    rows.append(f"| {name} | memory | one more frame {frame / 2**20:.2f} MiB (activations) | "
                f"weights {mem.weight_bytes / 2**20:.2f} MiB, one copy | frames made: "
                f"{m._frames.made} | |")
    print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["squeezenet", "resnet50"])
    ap.add_argument("--calls", type=int, default=50, help="inferences per caller")
    ap.add_argument("--markdown", help="write the table into this markdown file")
    args = ap.parse_args()
    head = ["| model | callers x threads each | hgrt inf/s | hgrt / 1 caller | "
            "onnxruntime inf/s | hgrt / onnxruntime |", "|---|---|---|---|---|---|"]
    table(args.markdown, "bench_serving", f"python python/bench_serving.py --calls {args.calls} "
          f"--models {' '.join(args.models)}", head,
          lambda: [r for name in args.models for r in bench(name, args.calls)])


if __name__ == "__main__":
    os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", "0")  # spinning pools starve callers
    main()
