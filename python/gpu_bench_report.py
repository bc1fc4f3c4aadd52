"""The GPU benchmark's results: one row per model as JSON, the markdown table made of them, and
the ``<!-- gpu_bench:begin -->`` section of a markdown file (BENCHMARKS.md) replaced by it.

Standard library only: the table is written on the GPU machine and again here from its JSON.
"""

from __future__ import annotations

import json
import os

MARKER = "gpu_bench"
HEAD = ("| model | family | hgrt cuda ms | hgrt cuda, TVM kernels ms | hgrt auto ms (copies) "
        "| hgrt cpu ms | Relax VM ms | PyTorch eager ms | cuda / PyTorch | auto / min(cuda, cpu) "
        "| rel diff cuda / TVM kernels / auto |")


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if value < 10 else f"{value:.2f}" if value < 100 else f"{value:.1f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}"


def _diff(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def row_line(r: dict) -> str:
    ms = r.get("ms", {})
    cuda, auto, cpu = ms.get("cuda"), ms.get("auto"), ms.get("cpu")
    best = min([v for v in (cuda, cpu) if v is not None], default=None)
    auto_cell = "-" if auto is None else f"{_ms(auto)} ({r.get('copies', {}).get('auto', '?')})"
    diff = r.get("rel_diff", {})
    diffs = " / ".join(_diff(diff.get(k)) for k in ("cuda", "cuda_tvm", "auto"))
    return (f"| {r['name']} | {r.get('family', '')} | {_ms(cuda)} | {_ms(ms.get('cuda_tvm'))} "
            f"| {auto_cell} | {_ms(cpu)} | {_ms(ms.get('vm'))} | {_ms(ms.get('torch'))} "
            f"| {_ratio(cuda, ms.get('torch'))} | {_ratio(auto, best)} | {diffs} |")


CHECK_HEAD = ("| model checked against onnxruntime | hgrt cpu ms | hgrt cuda ms | conv on cuda, "
              "rest on cpu ms (copies) | hgrt auto ms (copies) | rel diff to onnxruntime "
              "(CPU): cpu / cuda / split / auto |")


def check_line(r: dict) -> str:
    ms, diff = r.get("ms", {}), r.get("rel_diff", {})
    split = "-" if ms.get("split") is None else \
        f"{_ms(ms['split'])} ({r.get('copies', {}).get('split', '?')})"
    auto = "-" if ms.get("auto") is None else \
        f"{_ms(ms['auto'])} ({r.get('copies', {}).get('auto', '?')})"
    diffs = " / ".join(_diff(diff.get(k)) for k in ("cpu", "cuda", "split", "auto"))
    return (f"| {r['name']} | {_ms(ms.get('cpu'))} | {_ms(ms.get('cuda'))} | {split} | {auto} "
            f"| {diffs} |")


PINNED_HEAD = ("| model | build | copies per run | pinned host pools ms | pageable ms "
               "| pageable / pinned |")


def pinned_lines(rows: list[dict]) -> list[str]:
    """The builds with copies, timed with their CPU pools pinned and pageable."""
    out = []
    for r in rows:
        ms = r.get("ms", {})
        for label in ("split", "auto"):
            if ms.get(f"{label}_pageable") is not None:
                out.append(f"| {r['name']} | {label} | {r.get('copies', {}).get(label, '?')} "
                           f"| {_ms(ms.get(label))} | {_ms(ms[f'{label}_pageable'])} "
                           f"| {_ratio(ms[f'{label}_pageable'], ms.get(label))} |")
    return out


def machine_line(machine: dict) -> str:
    m = machine
    parts = [f"{m.get('gpu', 'no GPU')}"
             + (f" (compute {m['compute']}, {m['gpu_gib']:.0f} GiB)" if m.get("compute") else ""),
             f"driver {m.get('driver', '?')}", f"host {m.get('cpu', '?')}, "
             f"{m.get('cores', '?')} cores", f"Python {m.get('python', '?')}",
             f"TVM {m.get('tvm', '?')} (runtime only)", f"PyTorch {m.get('torch', '-')}",
             f"hgrt's step loop {m.get('step_loop', '?')}"]
    return "; ".join(parts)


def notes_of(report: dict) -> list[str]:
    out = list(report.get("notes", []))
    for r in report["rows"]:
        for note in r.get("notes", []):
            out.append(f"{r['name']}: {note}")
    return out


def markdown(report: dict) -> str:
    """The table with its machine line, the way it was measured, and the notes."""
    lines = [f"Machine: {machine_line(report.get('machine', {}))}; measured "
             f"{report.get('date', '?')}{' (dry run: no GPU)' if report.get('dry_run') else ''}.",
             "", HEAD, "|" + "---|" * HEAD.count(" | ") + "---|"]
    lines += [row_line(r) for r in report["rows"] if not r.get("check")]
    checks = [r for r in report["rows"] if r.get("check")]
    if checks:
        lines += ["", CHECK_HEAD, "|---|---|---|---|---|---|"]
        lines += [check_line(r) for r in checks]
    pinned = pinned_lines(report["rows"])
    if pinned:
        lines += ["", PINNED_HEAD, "|---|---|---|---|---|---|"] + pinned
    lines += ["", f"Each figure is the median of {report.get('repeat', '?')} timed repeats after "
              f"warm-up, each repeat the mean of enough runs to last ~10 ms (GPU work "
              f"synchronized before the clock stops); a model's hgrt GPU builds are timed in "
              f"turns, one batch of each per round, so that clock drift falls on all alike. "
              f"rel diff: max |x - hgrt cpu| / max |hgrt "
              f"cpu| over the output, the same regenerated weights in every hgrt build. auto: "
              f"hgrt's cost-based placement over cpu:0 + cuda:0 (copies between devices per "
              f"run in brackets). PyTorch: eager fp32 (TF32 off), its own seeded weights."]
    notes = notes_of(report)
    if notes:
        lines += [""] + [f"- {n}" for n in notes]
    return "\n".join(lines)


def write_section(path: str, command: str, body: str) -> None:
    """Put ``command`` and ``body`` (which names the GPU machine) between the gpu_bench
    markers of ``path`` (appended where there are none)."""
    from bench_common import write_block  # (imports TVM: here only, never on the GPU machine)

    write_block(path, MARKER, command, body, with_machine=False)


def save(report: dict, out_dir: str | None) -> None:
    """``gpu_bench.json`` and ``gpu_bench.md`` into ``out_dir`` (``$OUT`` on the GPU machine)."""
    if not out_dir:
        return
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "gpu_bench.json.tmp"), "w") as f:
        json.dump(report, f, indent=1)
    os.replace(os.path.join(out_dir, "gpu_bench.json.tmp"), os.path.join(out_dir,
                                                                         "gpu_bench.json"))
    with open(os.path.join(out_dir, "gpu_bench.md"), "w") as f:
        f.write(markdown(report) + "\n")
