"""Kernel quality on CPU: light squeezenet / resnet50 (random weights) built by hgrt with
unscheduled kernels, with the default CPU schedule, and with a tuned database, against
onnxruntime's CPU provider at the same thread count, in one process.

    hgrt zoo squeezenet -o sq.onnx && hgrt tune sq.onnx --device cpu --db tuning/sq
    python python/bench_kernels.py --models squeezenet --db squeezenet=tuning/sq

The databases behind BENCHMARKS.md (64 trials per task; 19 min for squeezenet, 21 min for
resnet50 on 2 cores):

    hgrt zoo squeezenet -o sq.onnx && hgrt tune sq.onnx --device cpu --db tuning/squeezenet
        --trials-per-task 64
    hgrt zoo resnet50 -o r50.onnx && hgrt tune r50.onnx --device cpu --db tuning/resnet50
        --trials-per-task 64

Every variant runs through ``hgrt.create`` on cpu:0 (the Relax VM on the same kernels is
``bench_models.py``'s business). The hgrt builds are timed interleaved call by call, onnxruntime
after them on its own (``time_onnxruntime`` says why). ``--skip-unscheduled`` saves a minute.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["squeezenet", "resnet50"])
    p.add_argument("--repeat", type=int, default=20, help="timed runs (median reported)")
    p.add_argument("--db", action="append", default=[], metavar="MODEL=DIR",
                   help="tuned database of a model (written by `hgrt tune`)")
    p.add_argument("--skip-unscheduled", action="store_true")
    p.add_argument("--markdown", help="also write the table (command, machine) into this file")
    return p.parse_args()


def _build(model, **kwargs):
    import hgrt

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = time.perf_counter()
        res = hgrt.build(model, ["cpu"], **kwargs)
        return res, time.perf_counter() - t


def main() -> None:
    args = _parse()
    from bench_common import (
        hgrt_outputs,
        hgrt_runner,
        light,
        machine,
        max_diff,
        median_time,
        time_onnxruntime,
        timed_interleaved,
    )

    dbs = dict(item.split("=", 1) for item in args.db)
    print(machine())
    rows, notes_all = [], []
    for name in args.models:
        entry = light(name)
        runners, notes = {}, []
        if not args.skip_unscheduled:
            os.environ["HGRT_DEFAULT_SCHEDULE"] = "0"
            try:
                res, _ = _build(entry.model)
            finally:
                del os.environ["HGRT_DEFAULT_SCHEDULE"]
            runners["unscheduled"] = hgrt_runner(res, entry.inputs)
        res, secs = _build(entry.model)
        runners["default"] = hgrt_runner(res, entry.inputs)
        notes.append(f"default build {secs:.1f} s")
        if name in dbs:
            res, secs = _build(entry.model, tuning_db=dbs[name])
            runners["tuned"] = hgrt_runner(res, entry.inputs)
            t = res.tuning
            n = len(t.tuned) + len(t.fallback)
            notes.append(f"tuned build {secs:.1f} s: {len(t.tuned)} of {n} kernels from the "
                         f"database, {len(t.default_faster)} kept the default schedule (faster "
                         f"in the model), {len(t.fallback) - len(t.default_faster)} untuned")
        outs = {k: hgrt_outputs(m) for k, m in runners.items()}
        ref = outs["default"]
        for k, o in outs.items():
            if k != "default":
                notes.append(f"{k} max rel. diff vs default {max_diff(o, ref):.1e}")
        times = timed_interleaved({k: m.run for k, m in runners.items()
                                   if k != "unscheduled"}, args.repeat)
        if "unscheduled" in runners:  # seconds per run: a few runs are enough
            times["unscheduled"] = median_time(runners["unscheduled"].run, 3)
        ort = time_onnxruntime(entry.model, entry.inputs, args.repeat)
        if ort is not None:
            times["onnxruntime"] = ort[0]
            notes.append(f"onnxruntime max rel. diff vs default {max_diff(ort[1], ref):.1e}")
        print(f"{name}: " + "; ".join(notes), flush=True)
        notes_all.append(f"{name}: " + "; ".join(notes))
        rows.append((name, times))

    header = ["model", "unscheduled ms", "default ms", "tuned ms", "onnxruntime ms",
              "unscheduled/default", "default/ORT", "tuned/ORT"]
    table = []
    for name, t in rows:
        def ratio(a, b, r=t):
            return f"{r[a] / r[b]:.2f}" if a in r and b in r else "-"
        table.append([name] + [f"{t[c] * 1e3:.2f}" if c in t else "-" for c in
                               ("unscheduled", "default", "tuned", "onnxruntime")]
                     + [ratio("unscheduled", "default"), ratio("default", "onnxruntime"),
                        ratio("tuned", "onnxruntime")])
    print(f"\nrun() latency, median of {args.repeat}, TVM_NUM_THREADS="
          f"{os.environ.get('TVM_NUM_THREADS')}, onnxruntime intra-op threads the same")
    widths = [max(len(r[i]) for r in [header, *table]) for i in range(len(header))]
    for r in [header, *table]:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
    if args.markdown:
        from bench_common import write_block

        md = "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                       + ["| " + " | ".join(r) + " |" for r in table])
        write_block(args.markdown, "bench_kernels", "python python/bench_kernels.py "
                    + " ".join(sys.argv[1:]), md + "\n\n" + "\n".join(
                        f"- {n}" for n in notes_all))


if __name__ == "__main__":
    main()
