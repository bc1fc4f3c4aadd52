"""Real models end to end: hgrt build time, run latency and memory, next to the Relax VM running
hgrt's own kernels (so the ratio is the runtime's) and next to onnxruntime's CPU provider.

    python python/bench_models.py                     # light zoo + pytorch-converted cases
    python python/bench_models.py --models squeezenet resnet50 --tuning-db tuning/
    python python/bench_models.py --markdown BENCHMARKS.md   # also write the table there
    python python/bench_models.py --kernels onednn --models squeezenet resnet50  # oneDNN's
    python python/bench_models.py --target 'cpu=llvm -mcpu=haswell'   # an AVX2 build

For each model, in one process: ``hgrt.build(model, ["cpu"])`` (build time), run() latency
(median of ``--repeat``), the same model split over cpu:0 + cpu:1 (convolutions and matmuls on
cpu:1), the Relax VM on the same fused and scheduled kernels, onnxruntime at the same thread
count; planned bytes per device against the VM's static memory plan; and from hgrt's profiler
the share of run() spent inside kernels (the rest is the runtime: dispatch, copies).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
import warnings

SPLIT_RULES = {"nn.conv2d": "cpu:1", "matmul": "cpu:1", "nn.conv2d_transpose": "cpu:1"}


def _parse() -> argparse.Namespace:
    from bench_common import PYTORCH_CASES, add_onnxruntime_cap_option

    from hgrt.zoo import LIGHT_MODELS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(LIGHT_MODELS) + list(PYTORCH_CASES))
    p.add_argument("--repeat", type=int, default=20, help="timed runs per model (median)")
    p.add_argument("--tuning-db", help="build with this database (hgrt and the VM alike)")
    p.add_argument("--markdown", help="write the table (with command and machine) here")
    p.add_argument("--kernels", choices=("tvm", "onednn", "auto"), default="tvm",
                   help="hgrt's kernel provider (default tvm: the VM runs the same kernels, so "
                        "hgrt/VM is the runtime's ratio; onednn: hgrt/ORT compares oneDNN's "
                        "kernels with onnxruntime's, ONEDNN_MAX_CPU_ISA=AVX2 for an AVX2 "
                        "target)")
    p.add_argument("--target", action="append", metavar="KIND=TARGET",
                   help="build for this CPU target instead of the host's (hgrt, split and the "
                        "VM alike), as `hgrt compile --target` takes it: 'cpu=llvm "
                        "-mcpu=haswell' (oneDNN is capped to its ISA; onnxruntime runs the "
                        "host's unless --cap-onnxruntime)")
    p.add_argument("--no-winograd", action="store_true",
                   help="oneDNN's 3x3 convolutions stay direct (hgrt compile --no-winograd): "
                        "the A/B of Winograd, in a row of its own")
    p.add_argument("--winograd", metavar="all|none|SHARE", default=None,
                   help="as hgrt compile --winograd (default: the build's default share)")
    add_onnxruntime_cap_option(p)
    return p.parse_args()


def _ms(s: float) -> str:
    ms = s * 1e3
    return f"{ms:.4f}" if ms < 0.1 else f"{ms:.3f}" if ms < 10 else f"{ms:.2f}" if ms < 1000 \
        else f"{ms:.0f}"


def bench_one(entry, repeat: int, tuning_db: str | None, kernels: str = "tvm",
              target: dict | None = None) -> dict:
    from bench_common import (
        built_isa,
        hgrt_outputs,
        hgrt_runner,
        max_diff,
        time_against_onnxruntime,
        timed_interleaved,
        vm_on_hgrt_kernels,
        winograd_layers,
    )
    from bench_memory import vm_planned_bytes

    import hgrt

    row: dict = {"model": entry.name}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = time.perf_counter()
        single = hgrt.build(entry.model, ["cpu"], tuning_db=tuning_db, kernels=kernels,
                            target=target)
        row["build_s"] = time.perf_counter() - t
        split = hgrt.build(entry.model, ["cpu:0", "cpu:1"],
                           hgrt.Placement(rules=SPLIT_RULES, fallback="cpu:0"),
                           tuning_db=tuning_db, kernels=kernels, target=target)
        vm_call = vm_on_hgrt_kernels(entry.model, entry.inputs, tuning_db, target)
        vm_bytes = vm_planned_bytes(entry.model)
    row["isa"] = built_isa(single)
    # who computes the heavy ops: oneDNN when it claimed any ("auto" / "onednn"), else TVM;
    # "+winograd" where some of its convolutions run as Winograd
    row["kernels"] = "onednn" if any(r.kernels == "onednn" for r in single.placement_report) \
        else "tvm"
    if winograd_layers(single):
        row["kernels"] += "+winograd"
    m = hgrt_runner(single, entry.inputs)
    ms = hgrt_runner(split, entry.inputs)
    ref = vm_call()
    row["diff_vm"] = max(max_diff(hgrt_outputs(m), ref), max_diff(hgrt_outputs(ms), ref))
    if kernels == "tvm":  # hgrt and the VM on the same TVM kernels, in turns
        row.update(timed_interleaved({"hgrt": m.run, "vm": vm_call.run, "split": ms.run}, repeat))
    else:  # oneDNN's OpenMP threads and TVM's pool slow each other when runs alternate
        row.update(timed_interleaved({"vm": vm_call.run}, repeat))
        row.update(timed_interleaved({"hgrt": m.run, "split": ms.run}, repeat))
    prof = m.profile(repeat=max(3, repeat // 4))
    row["kernel_share"] = prof.op_sum_us / max(prof.run_wall_us, 1e-9)
    ort = time_against_onnxruntime(m.run, entry.model, entry.inputs, repeat)  # last: its doc
    if ort is not None:
        row["alone"], row["ort"], outs = ort
        row["diff_ort"] = max(max_diff(hgrt_outputs(m), outs), max_diff(hgrt_outputs(ms), outs))
    row["nodes"] = len(prof.ops)
    row["copies"] = sum(1 for n in split_graph_nodes(split) if n == "__copy")
    row["mem"] = sum(d.planned_bytes for d in single.memory_report)
    row["mem_split"] = [d.planned_bytes for d in split.memory_report]
    row["mem_vm"] = vm_bytes
    return row


def split_graph_nodes(result) -> list[str]:
    return [n.func_name for n in result.graph.nodes if n.op == "tvm_op"]


HEADER = ("model", "ISA", "kernels", "build s", "hgrt ms", "VM ms", "hgrt/VM", "split ms",
          "copies", "hgrt alone ms", "ORT ms", "hgrt/ORT", "in kernels", "MB hgrt", "MB VM",
          "mem/VM")


def format_rows(rows: list[dict]) -> list[tuple[str, ...]]:
    out = []
    for r in rows:
        ort = r.get("ort")
        out.append((
            r["model"], r["isa"], r["kernels"], f"{r['build_s']:.1f}", _ms(r["hgrt"]), _ms(r["vm"]),
            f"{r['hgrt'] / r['vm']:.2f}", _ms(r["split"]), str(r["copies"]),
            _ms(r["alone"]) if ort else "-", _ms(ort) if ort else "-",
            f"{r['alone'] / ort:.2f}" if ort else "-",
            f"{r['kernel_share'] * 100:.0f}%", f"{r['mem'] / 2**20:.2f}",
            f"{r['mem_vm'] / 2**20:.2f}", f"{r['mem'] / max(r['mem_vm'], 1):.2f}"))
    return out


def text_table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(x[i]) for x in [HEADER, *rows]) for i in range(len(HEADER))]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in
                               enumerate(zip(line, widths, strict=True)))
                     for line in [HEADER, *rows])


def markdown_table(rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    args = _parse()
    from bench_common import (
        PYTORCH_CASES,
        cap_onednn_isa,
        cap_onnxruntime_isa,
        light,
        machine,
        ort_block_suffix,
        parse_target_args,
        pytorch_case,
        write_block,
    )

    from hgrt.devices import host_target, vector_isa

    target = parse_target_args(args.target)
    kernels = args.kernels
    from hgrt.cli import winograd_arg

    winograd = winograd_arg(args)
    if winograd is not None and args.kernels == "tvm":
        sys.exit("--winograd / --no-winograd: Winograd is oneDNN's (--kernels onednn or auto)")
    if winograd is not None:
        from hgrt.relay_passes.util.kernels import Kernels

        kernels = Kernels(args.kernels, winograd=winograd)
    ort_isa = cap_onnxruntime_isa(target, args.cap_onnxruntime)  # before it loads
    if args.kernels != "tvm":
        from hgrt.providers.onednn import kernels as onednn

        cap_onednn_isa(target)  # before oneDNN loads: one ISA per row
        print(f"hgrt kernels: {args.kernels}; oneDNN {onednn.unavailable_reason() or onednn.isa()}"
              f" (the VM: TVM kernels; onnxruntime: {ort_isa})")
    print(machine())
    rows = []
    for i, name in enumerate(args.models):
        entry = pytorch_case(name) if name in PYTORCH_CASES else light(name)
        if i == 0:  # warm-up, not shown: the first model timed in a fresh process ran 10-30 %
            # slower against onnxruntime than in a rerun (squeezenet 1.13-1.34 vs 1.03-1.05)
            bench_one(entry, max(3, args.repeat // 3), args.tuning_db, kernels, target)
        r = bench_one(entry, args.repeat, args.tuning_db, kernels, target)
        rows.append(r)
        print(f"{name}: hgrt {_ms(r['hgrt'])} ms, VM {_ms(r['vm'])} ms, split "
              f"{_ms(r['split'])} ms, ORT {_ms(r['ort']) if 'ort' in r else '-'} ms (hgrt "
              f"{_ms(r['alone']) if 'ort' in r else '-'} ms in turns with it); max rel. diff "
              f"vs VM {r['diff_vm']:.1e}, vs ORT {r.get('diff_ort', float('nan')):.1e}",
              flush=True)
    table = format_rows(rows)
    note = (f"ISA: the vector ISA of the target hgrt and the VM built for; kernels: who computed "
            f"the convolutions and dense layers; onnxruntime runs {ort_isa} (the host: "
            f"{vector_isa(host_target()).name}); hgrt ms: timed in turns with the VM and the "
            f"split run (hgrt/VM); hgrt alone ms: timed in blocks (>= --repeat runs and 0.25 s) "
            f"taking turns with onnxruntime's 5 times, a pause before each (hgrt/ORT)")
    print()
    print(text_table(table))
    print(note)
    if args.markdown:
        # one block per build kind: the host build with TVM kernels, else named after it
        block = "bench_models" + ("_target" if target else "") + (
            f"_{args.kernels}" if args.kernels != "tvm" else "") + ort_block_suffix(ort_isa) + (
            "_direct" if winograd is False else "_winograd_all" if winograd is True
            else f"_winograd_{winograd}" if winograd is not None else "")
        write_block(args.markdown, block, "python python/bench_models.py "
                    + shlex.join(sys.argv[1:]), markdown_table(table) + f"\n\n- {note}")


if __name__ == "__main__":
    main()
