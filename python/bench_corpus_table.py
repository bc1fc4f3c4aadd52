"""The corpus table: per corpus file, does hgrt import it, are its outputs right (against
onnxruntime on the same file), build seconds, kernels by provider, and hgrt's run() time
against onnxruntime's CPU provider at the same thread count.

    python python/bench_corpus_table.py                              # tiny configs, all files
    python python/bench_corpus_table.py --size real --models resnet.dynamo gpt2.dynamo
    python python/bench_corpus_table.py --exporter dynamo --markdown BENCHMARKS.md
    python python/bench_corpus_table.py --size real --kernels tvm        # TVM's kernels only
    python python/bench_corpus_table.py --size real --batch 8            # 8 samples a run
    python python/bench_corpus_table.py --size real --target 'cpu=llvm -mcpu=haswell' \
        --cap-onnxruntime                                    # AVX2 against AVX2 onnxruntime

Held-out files (kept out of any tuning loop) are listed in a table of their own. "right": max
|hgrt - onnxruntime| / max |onnxruntime| within 1e-4, or for int8 QDQ files within twice
onnxruntime's own spread (its int8 kernels against its QDQ-as-float run) with the same top-1
(except where onnxruntime's own int8 kernels change it too: a tie within the quantization).
The real configs are exported on demand into the corpus cache (the corpus extra).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from collections import Counter

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import hgrt_runner, max_diff, table, time_against_onnxruntime  # noqa: E402

HEAD = ["| file | family | imports | right | max rel diff | build s | kernels | hgrt ms | ORT ms "
        "| hgrt/ORT |", "|---|---|---|---|---|---|---|---|---|---|"]


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=("tiny", "real"), default="tiny")
    p.add_argument("--models", nargs="*", help="corpus files (<model>.<exporter>); default all")
    p.add_argument("--exporter", choices=("dynamo", "torchscript"),
                   help="only the files of this exporter")
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--batch", type=int, default=1,
                   help="samples per run (real size: each batch is an export of its own)")
    p.add_argument("--markdown", help="write the table into this markdown file")
    p.add_argument("--ort-no-spin", action="store_true",
                   help="onnxruntime's pool threads do not spin between parallel sections "
                        "(they then hold no core while hgrt's calls are timed)")
    p.add_argument("--kernels", choices=("auto", "tvm", "onednn"), default="auto",
                   help="hgrt.build's kernels (default auto)")
    p.add_argument("--target", action="append", metavar="KIND=TARGET",
                   help="build the CPU for another target, e.g. 'cpu=llvm -mcpu=haswell' (an "
                        "AVX2 build; oneDNN capped to its ISA)")
    from bench_common import add_onnxruntime_cap_option

    add_onnxruntime_cap_option(p)
    return p.parse_args()


def _file(entry, size: str, batch: int = 1) -> tuple[str, dict[str, np.ndarray]]:
    """The ONNX file of ``entry`` at ``size`` with inputs of ``batch`` samples, and its seeded
    inputs by ONNX input name."""
    if size == "tiny":
        if batch != 1:
            raise SystemExit("bench_corpus_table: --batch needs --size real (the committed "
                             "tiny files take one sample)")
        return entry.path, entry.seeded_inputs()
    from hgrt.corpus import seeded_inputs, spec
    from hgrt.corpus.generate import real_path
    from hgrt.corpus.specs import inputs_of

    return real_path(entry.model, entry.exporter, batch=batch), seeded_inputs(
        inputs_of(spec(entry.model), "real", batch))


def _int8_run(model, x: dict[str, np.ndarray]) -> list[np.ndarray]:
    """onnxruntime's own int8 kernels on ``model`` (its default optimizations fuse the QDQ)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), opts,
                                providers=["CPUExecutionProvider"])
    return sess.run(None, x)


def _right(entry, model, x, got, want) -> tuple[str, float]:
    diff = max_diff(got, want)
    if entry.family != "int8":
        return ("yes" if diff <= 1e-4 else "NO"), diff
    ort8 = _int8_run(model, x)
    spread = max_diff(ort8, want)
    # top-1 as the QDQ-as-float run's, except on rows where onnxruntime's own int8 kernels pick
    # another class too (a tie within the quantization: the float run's top two equal)
    top1 = all(np.all((g.argmax(-1) == w.argmax(-1)) | (o.argmax(-1) != w.argmax(-1)))
               for g, w, o in zip(got, want, ort8, strict=True))
    ok = diff <= max(2 * spread, 1e-6) and top1
    return f"{'yes' if ok else 'NO'} (ORT's int8 spread {spread:.1e})", diff


def bench_one(entry, size: str, repeat: int, kernels: str = "auto", target=None,
              batch: int = 1) -> str:
    import onnx

    import hgrt
    from hgrt.frontend import import_model
    from hgrt.testing import input_names, onnx_reference

    path, x = _file(entry, size, batch)
    model = onnx.load(path)
    row = [entry.name, entry.family]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import_model(model)
    except Exception as e:
        return "| " + " | ".join(row + [f"no: {type(e).__name__}: {str(e)[:90]}"] +
                                 ["-"] * 7) + " |"
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = hgrt.build(model, ["cpu"], kernels=kernels, target=target)
    except Exception as e:
        return "| " + " | ".join(row + ["yes", f"build fails: {type(e).__name__}: "
                                 f"{str(e)[:80]}"] + ["-"] * 6) + " |"
    build_s = time.perf_counter() - t0
    kernels = Counter(r.kernels for r in res.placement_report)
    m = hgrt_runner(res, dict(zip(input_names(model), x.values(), strict=True)))
    m.run()
    got = [m.get_output(i).numpy() for i in range(m.get_num_outputs())]
    right, diff = _right(entry, model, x, got, onnx_reference(model, x))
    timed = time_against_onnxruntime(m.run, model, x, repeat, rounds=3, pause=0.2)
    ms = [f"{timed[0] * 1e3:.3f}", f"{timed[1] * 1e3:.3f}", f"{timed[0] / timed[1]:.2f}"] \
        if timed else ["-", "-", "-"]
    by = ", ".join(f"{k} {n}" for k, n in sorted(kernels.items()))
    return "| " + " | ".join(row + ["yes", right, f"{diff:.1e}", f"{build_s:.1f}", by, *ms]) \
        + " |"


def main() -> None:
    from hgrt.corpus import entries

    args = _parse()
    from bench_common import cap_onednn_isa, cap_onnxruntime_isa, parse_target_args

    target = parse_target_args(args.target)
    import bench_common

    bench_common.ORT_SPIN = not args.ort_no_spin
    ort_isa = cap_onnxruntime_isa(target, args.cap_onnxruntime)  # before onnxruntime loads
    cap_onednn_isa(target)  # before oneDNN loads: one ISA per row
    print(f"hgrt kernels {args.kernels}, target {target or 'this host'}; onnxruntime {ort_isa}")
    chosen = [e for e in entries() if (not args.models or e.name in args.models)
              and (not args.exporter or e.exporter == args.exporter)]
    command = "python python/bench_corpus_table.py" + (
        f" --size {args.size}" if args.size != "tiny" else "") + (
        f" --models {' '.join(args.models)}" if args.models else "") + (
        f" --exporter {args.exporter}" if args.exporter else "") + (
        f" --repeat {args.repeat}" if args.repeat != 10 else "") + (
        f" --batch {args.batch}" if args.batch != 1 else "") + (
        f" --kernels {args.kernels}" if args.kernels != "auto" else "") + "".join(
        f" --target '{t}'" for t in args.target or ()) + (
        " --cap-onnxruntime" if args.cap_onnxruntime else "") + (
        " --ort-no-spin" if args.ort_no_spin else "") + (
        f" --markdown {args.markdown}" if args.markdown else "")

    def rows() -> list[str]:
        out = {False: [], True: []}
        for e in chosen:
            line = bench_one(e, args.size, args.repeat, args.kernels, target, args.batch)
            print(line, flush=True)
            out[e.held_out].append(line)
        held = ["", "Held out of tuning:", "", *HEAD, *out[True]] if out[True] else []
        return out[False] + held

    block = f"bench_corpus_{args.size}" + (f"_{args.kernels}" if args.kernels != "auto" else "") \
        + ("_target" if target else "") + (f"_batch{args.batch}" if args.batch != 1 else "") \
        + ("_ort_no_spin" if args.ort_no_spin else "")
    table(args.markdown, block, command, HEAD, rows)


if __name__ == "__main__":
    main()
