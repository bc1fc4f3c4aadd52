"""Kernel quality on CPU: light squeezenet / resnet50 (random weights) built by hgrt with
unscheduled kernels, with the default CPU schedule, and with a tuned database, against
onnxruntime's CPU provider at the same thread count, in one process.

    hgrt zoo squeezenet -o sq.onnx && hgrt tune sq.onnx --device cpu --db tuning/sq
    python python/bench_kernels.py --models squeezenet --db squeezenet=tuning/sq

Every variant runs through ``hgrt.create`` on cpu:0 (the Relax VM on the same kernels is
``bench_models.py``'s business). The three hgrt builds are timed interleaved, round by round;
onnxruntime on its own afterwards (its pool threads spin after each run and would slow TVM's
down, and the other way round). ``--skip-unscheduled`` saves minutes on resnet50.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


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
        median_times,
        ort_feed,
        ort_session,
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
            notes.append(f"tuned build {secs:.1f} s, {res.tuning.summary()}")
        outs = {k: hgrt_outputs(m) for k, m in runners.items()}
        ref = outs["default"]
        for k, o in outs.items():
            notes.append(f"{k} max rel. diff vs default {max_diff(o, ref):.1e}")
        # unscheduled kernels take seconds: a few runs are enough for them
        times = median_times({k: m.run for k, m in runners.items() if k != "unscheduled"},
                             args.repeat)
        if "unscheduled" in runners:
            times["unscheduled"] = median_time(runners["unscheduled"].run, 3)
        threads = int(os.environ.get("TVM_NUM_THREADS", "1"))
        sess = ort_session(entry.model, threads)
        if sess is not None:
            feed = ort_feed(sess, entry.model, entry.inputs)
            notes.append(f"onnxruntime max rel. diff vs default "
                         f"{max_diff(sess.run(None, feed), ref):.1e}")
            time.sleep(0.2)
            times["onnxruntime"] = median_time(lambda s=sess, f=feed: s.run(None, f),
                                               args.repeat)
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
