"""Kernel quality on CPU: light squeezenet / resnet50 (random weights) built by hgrt with
unscheduled kernels, with the default CPU schedule, and with a tuned database, against
onnxruntime's CPU provider at the same thread count, in one process. The tuned build has TVM
kernels only, so its database is tuned with ``--kernels tvm`` (``hgrt tune``'s default, like
``compile``'s, leaves what oneDNN computes untuned):

    hgrt zoo squeezenet -o sq.onnx && hgrt tune sq.onnx --device cpu --kernels tvm --db tuning/sq
    python python/bench_kernels.py --models squeezenet --db squeezenet=tuning/sq

The databases behind BENCHMARKS.md (64 trials per task; 14 min for squeezenet, 18 min for
resnet50 on 2 cores):

    hgrt zoo squeezenet -o sq.onnx && hgrt tune sq.onnx --device cpu --kernels tvm
        --db tuning/squeezenet --trials-per-task 64
    hgrt zoo resnet50 -o r50.onnx && hgrt tune r50.onnx --device cpu --kernels tvm
        --db tuning/resnet50 --trials-per-task 64

With the ``onednn`` extra installed, ``--kernels tvm onednn`` (the default then) adds a build
whose convolutions and dense layers are oneDNN kernels (``hgrt.build(..., kernels="onednn")``);
``ONEDNN_MAX_CPU_ISA=AVX2`` caps oneDNN to AVX2 on an AVX-512 host. onnxruntime runs the host's
ISA unless ``--cap-onnxruntime`` (with ``--target``) loads it under a CPUID cap to the target's
(``cpuid_cap.py``). The table's notes name the ISA each side ran.

    python python/bench_kernels.py --skip-unscheduled --kernels tvm onednn

``--target`` builds for another CPU than the host, spelled as ``hgrt compile --target`` takes
it; the ``ISA`` column is the vector ISA of the target built (``hgrt.devices.vector_isa``), and
oneDNN is capped to it (unless ``ONEDNN_MAX_CPU_ISA`` is set):

    python python/bench_kernels.py --skip-unscheduled --target 'cpu=llvm -mcpu=haswell'

Where oneDNN runs some 3x3 convolutions as Winograd, the same build with every convolution
direct is timed in turns with it (``oneDNN direct``, ``oneDNN/direct``); ``--kernels onednn``
writes a table of its own:

    python python/bench_kernels.py --skip-unscheduled --kernels onednn --models resnet50 vgg19

Every variant runs through ``hgrt.create`` on cpu:0 (the Relax VM on the same kernels is
``bench_models.py``'s business). The hgrt builds are timed interleaved call by call, onnxruntime
after them on its own (``time_onnxruntime`` says why). ``--skip-unscheduled`` saves a minute.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
import warnings


def _parse() -> argparse.Namespace:
    from bench_common import add_onnxruntime_cap_option

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["squeezenet", "resnet50"])
    p.add_argument("--repeat", type=int, default=20, help="timed runs (median reported)")
    p.add_argument("--db", action="append", default=[], metavar="MODEL=DIR",
                   help="tuned database of a model (written by `hgrt tune`)")
    p.add_argument("--skip-unscheduled", action="store_true")
    p.add_argument("--kernels", nargs="+", choices=["tvm", "onednn"], default=None,
                   help="kernel providers to time (default: tvm, and onednn where installed)")
    p.add_argument("--target", action="append", metavar="KIND=TARGET",
                   help="build for this CPU target instead of the host's, as `hgrt compile "
                        "--target` takes it: 'cpu=llvm -mcpu=haswell' (oneDNN is capped to "
                        "its ISA; onnxruntime runs the host's unless --cap-onnxruntime)")
    add_onnxruntime_cap_option(p)
    p.add_argument("--markdown", help="also write the table (command, machine) into this file")
    return p.parse_args()


def _build(model, target, **kwargs):
    import hgrt

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = time.perf_counter()
        res = hgrt.build(model, ["cpu"], target=target, **kwargs)
        return res, time.perf_counter() - t


def _providers(asked: list[str] | None, ort_isa: str) -> list[str]:
    """The kernel providers to time; oneDNN's ISA said once (the TVM kernels' is the table's
    ISA column, onnxruntime's the host's)."""
    from hgrt.providers.onednn import kernels as onednn

    reason = onednn.unavailable_reason()
    if asked is None:
        asked = ["tvm"] if reason else ["tvm", "onednn"]
    if "onednn" in asked:
        if reason:
            sys.exit(f"--kernels onednn: {reason}")
        print(f"oneDNN {onednn.version()}, ISA {onednn.isa()} (ONEDNN_MAX_CPU_ISA="
              f"{os.environ.get('ONEDNN_MAX_CPU_ISA', '-')}); onnxruntime runs {ort_isa}")
    return asked


def _claimed(res) -> str:
    rows = res.placement_report
    return f"{sum(r.kernels == 'onednn' for r in rows)} of {len(rows)} ops on oneDNN"


def _variants(entry, skip_unscheduled: bool, kernels: list[str], db: str | None,
              target: dict | None) -> tuple[dict, list[str], str]:
    """The builds of one model to time, as GraphModules by variant name, notes, and the
    vector ISA the TVM kernels were built for."""
    from bench_common import built_isa, hgrt_runner, winograd_layers

    runners, notes = {}, []
    if not skip_unscheduled:
        os.environ["HGRT_DEFAULT_SCHEDULE"] = "0"
        try:
            res, _ = _build(entry.model, target, kernels="tvm")
        finally:
            del os.environ["HGRT_DEFAULT_SCHEDULE"]
        runners["unscheduled"] = hgrt_runner(res, entry.inputs)
    res, secs = _build(entry.model, target, kernels="tvm")
    runners["default"] = hgrt_runner(res, entry.inputs)
    isa = built_isa(res)
    notes.append(f"default build {secs:.1f} s")
    if "onednn" in kernels:
        res, secs = _build(entry.model, target, kernels="onednn")
        runners["onednn"] = hgrt_runner(res, entry.inputs)
        notes.append(f"oneDNN build {secs:.1f} s, {_claimed(res)}")
        wino = winograd_layers(res)
        if wino:  # the A/B of Winograd: the same build with every convolution direct
            from hgrt.relay_passes.util.kernels import Kernels

            res, _ = _build(entry.model, target, kernels=Kernels("onednn", winograd=False))
            runners["onednn_direct"] = hgrt_runner(res, entry.inputs)
            notes.append(f"oneDNN: {wino} convolutions as Winograd (oneDNN direct: none)")
    if db is not None:
        res, secs = _build(entry.model, target, tuning_db=db, kernels="tvm")
        runners["tuned"] = hgrt_runner(res, entry.inputs)
        t = res.tuning
        n = len(t.tuned) + len(t.fallback)
        notes.append(f"tuned build {secs:.1f} s: {len(t.tuned)} of {n} kernels from the "
                     f"database, {len(t.default_faster)} kept the default schedule (faster "
                     f"in the model), {len(t.fallback) - len(t.default_faster)} untuned")
    return runners, notes, isa


def _table(rows: list[tuple[str, str, dict]]) -> tuple[list[str], list[list[str]]]:
    """The header and rows of the latency table: per model, the ISA of the TVM kernels, each
    variant's milliseconds and the ratios."""
    header = ["model", "ISA", "unscheduled ms", "default ms", "tuned ms", "oneDNN ms",
              "oneDNN direct ms", "onnxruntime ms", "unscheduled/default", "default/ORT",
              "tuned/ORT", "oneDNN/ORT", "oneDNN/direct"]
    table = []
    for name, isa, t in rows:
        def ratio(a, b, r=t):
            return f"{r[a] / r[b]:.2f}" if a in r and b in r else "-"
        table.append([name, isa] + [f"{t[c] * 1e3:.2f}" if c in t else "-" for c in
                                    ("unscheduled", "default", "tuned", "onednn",
                                     "onednn_direct", "onnxruntime")]
                     + [ratio("unscheduled", "default"), ratio("default", "onnxruntime"),
                        ratio("tuned", "onnxruntime"), ratio("onednn", "onnxruntime"),
                        ratio("onednn", "onednn_direct")])
    return header, table


def _time(runners: dict, repeat: int) -> dict[str, float]:
    """Median seconds per run() of each build: the TVM builds interleaved, oneDNN and the
    unscheduled build apart."""
    from bench_common import median_time, timed_interleaved

    # oneDNN apart: its OpenMP threads and TVM's pool slow each other down when their
    # runs alternate call by call (measured 1.5-1.7x on both), which no user sees
    onednn = ("onednn", "onednn_direct")
    times = timed_interleaved({k: m.run for k, m in runners.items()
                               if k != "unscheduled" and k not in onednn}, repeat)
    # oneDNN's builds in turns with each other (one OpenMP team): Winograd's A/B
    times.update(timed_interleaved({k: runners[k].run for k in onednn if k in runners}, repeat))
    if "unscheduled" in runners:  # seconds per run: a few runs are enough
        times["unscheduled"] = median_time(runners["unscheduled"].run, 3)
    return times


def main() -> None:
    args = _parse()
    from bench_common import (
        cap_onednn_isa,
        cap_onnxruntime_isa,
        hgrt_outputs,
        light,
        machine,
        max_diff,
        ort_block_suffix,
        parse_target_args,
        time_onnxruntime,
    )

    from hgrt.devices import host_target, vector_isa

    target = parse_target_args(args.target)
    dbs = dict(item.split("=", 1) for item in args.db)
    cap_onednn_isa(target)  # before oneDNN loads: both providers of a row run one ISA
    ort_isa = cap_onnxruntime_isa(target, args.cap_onnxruntime)  # before it loads
    kernels = _providers(args.kernels, ort_isa)
    print(machine())
    rows, notes_all = [], [f"ISA: the TVM kernels' (the target built); onnxruntime runs "
                           f"{ort_isa} (the host: {vector_isa(host_target()).name})"]
    for name in args.models:
        entry = light(name)
        runners, notes, isa = _variants(entry, args.skip_unscheduled, kernels, dbs.get(name),
                                        target)
        outs = {k: hgrt_outputs(m) for k, m in runners.items()}
        ref = outs["default"]
        for k, o in outs.items():
            if k != "default":
                notes.append(f"{k} max rel. diff vs default {max_diff(o, ref):.1e}")
        times = _time(runners, args.repeat)
        ort = time_onnxruntime(entry.model, entry.inputs, args.repeat)
        if ort is not None:
            times["onnxruntime"] = ort[0]
            notes.append(f"onnxruntime max rel. diff vs default {max_diff(ort[1], ref):.1e}")
        print(f"{name}: " + "; ".join(notes), flush=True)
        notes_all.append(f"{name}: " + "; ".join(notes))
        rows.append((name, isa, times))

    header, table = _table(rows)
    print(f"\nrun() latency, median of {args.repeat}, TVM_NUM_THREADS="
          f"{os.environ.get('TVM_NUM_THREADS')}, onnxruntime intra-op threads the same; "
          f"{notes_all[0]}")
    widths = [max(len(r[i]) for r in [header, *table]) for i in range(len(header))]
    for r in [header, *table]:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
    if args.markdown:
        from bench_common import write_block

        md = "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                       + ["| " + " | ".join(r) + " |" for r in table])
        # one block per build: the host's, else the --target one
        block = "bench_kernels" + ("_target" if target else "") + ort_block_suffix(ort_isa) + (
            "_onednn" if kernels == ["onednn"] else "")  # oneDNN's A/B of Winograd
        write_block(args.markdown, block,
                    "python python/bench_kernels.py "
                    + shlex.join(sys.argv[1:]), md + "\n\n" + "\n".join(
                        f"- {n}" for n in notes_all))


if __name__ == "__main__":
    main()
