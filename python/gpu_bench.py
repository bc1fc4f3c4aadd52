"""hgrt on a GPU against the Relax VM and PyTorch, for a GPU machine lent for a few minutes.

Real-size corpus models (hgrt.corpus), each run as hgrt cuda only, hgrt auto (cost-based
placement over cpu:0 + cuda:0), hgrt cpu only (the oracle the other two are compared with),
the Relax VM on cuda (TVM's ONNX import, its default CUDA pipeline with dlight's schedules) and
PyTorch eager (fp32, TF32 off). Two halves:

    python python/gpu_bench.py --prepare [--models distilbert gpt2 ...]   # here: writes .gpu/
    python3 python/gpu_bench.py                                           # on the GPU machine
    python python/gpu_bench.py --dry-run                                  # here: its CPU part

``--prepare`` builds everything with the full TVM (CUDA kernels compiled with nvcc, for
``--arch``) into ``.gpu/`` at the repository root: the tvm-ffi wheel for Python 3.12, the tvm
package without its compiler, and one archive per model whose large weights are recipes
(``gpu_bench_bundle``). The GPU machine needs no TVM installed: the run unpacks the runtime
into ``--site`` (/tmp), imports TVM's runtime only (``TVM_USE_RUNTIME_LIB=1``), loads TVM's
CUDA backend itself, regenerates the weights, and stops starting models past ``--budget``
seconds. Results go to ``$OUT/gpu_bench.{md,json}``; here, ``--from-json FILE --markdown
BENCHMARKS.md`` puts the table between the ``<!-- gpu_bench:begin/end -->`` markers.

The GPU machine gets the working tree plus ``.gpu`` (``carry: [".gpu"]``); ``.gpu/`` is
listed in ``.git/info/exclude``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import sys
import tarfile
import time
import zipfile

from gpu_bench_bundle import BUNDLE, BUNDLE_FILE, REPO, read_json

# most telling first (the time limit skips from the end)
MODELS = ("squeezenet", "postprocess", "distilbert", "gpt2", "vit", "resnet", "mobilenet_v2",
          "t5_encoder", "llama", "convnext", "efficientnet", "lstm")
SITE = "/tmp/hgrt_gpu_site"


def bootstrap(bundle: dict, site: str) -> list[str]:
    """Put the bundle's runtime-only TVM (and hgrt from this source tree) on ``sys.path``;
    what was used from where."""
    if "tvm" in sys.modules:
        raise SystemExit("gpu_bench: tvm was imported before the runtime-only one was set up")
    os.environ["TVM_USE_RUNTIME_LIB"] = "1"
    # no torch extension built at tvm_ffi's import; hgrt's compiled parts cached under site
    os.environ.setdefault("TVM_FFI_DISABLE_TORCH_C_DLPACK", "1")
    os.environ.setdefault("HGRT_CACHE_DIR", os.path.join(site, "cache"))
    rt = bundle["runtime"]
    os.makedirs(site, exist_ok=True)
    notes = []
    tag = f"-cp{sys.version_info.major}{sys.version_info.minor}-"
    if tag in rt["ffi_wheel"]:
        with zipfile.ZipFile(os.path.join(BUNDLE, rt["ffi_wheel"])) as z:
            z.extractall(site)
        notes.append(f"tvm_ffi: {rt['ffi_wheel']} unpacked into {site}")
    elif importlib.util.find_spec("tvm_ffi") is not None:
        notes.append(f"tvm_ffi: the installed one ({rt['ffi_wheel']} is for another Python)")
    else:
        raise SystemExit(f"gpu_bench: {rt['ffi_wheel']} does not fit Python "
                         f"{sys.version.split()[0]} and no tvm_ffi is installed")
    with tarfile.open(os.path.join(BUNDLE, rt["tvm"])) as tar:
        tar.extractall(site, filter="data")
    sys.path.insert(0, site)
    sys.path.append(os.path.join(site, "fallback"))  # psutil & co. where none is installed
    notes.append(f"tvm {rt['tvm_version']} (runtime only) from {site}")
    # hgrt from this tree, its folders mapped as pyproject.toml's package-dir says
    spec = importlib.util.spec_from_file_location(
        "hgrt", os.path.join(REPO, "hgrt", "__init__.py"),
        submodule_search_locations=[os.path.join(REPO, "hgrt"), REPO])
    module = importlib.util.module_from_spec(spec)
    sys.modules["hgrt"] = module
    spec.loader.exec_module(module)
    return notes


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prepare", action="store_true", help="build .gpu/ here (full TVM)")
    p.add_argument("--dry-run", action="store_true",
                   help="the GPU machine's run here, without CUDA (cpu builds, torch on cpu)")
    p.add_argument("--models", nargs="*", default=None,
                   help=f"models (prepare default: {' '.join(MODELS)}; run: all in .gpu/)")
    g = p.add_argument_group("prepare")
    g.add_argument("--kernels", default="auto", help="hgrt.build's kernels (default auto)")
    g.add_argument("--without", nargs="*", default=["onednn"],
                   help="kernel providers left out of the builds (not on the GPU machine)")
    g.add_argument("--arch", default="sm_90", help="CUDA arch (H100 and H200: sm_90)")
    g.add_argument("--mcpu", default="haswell", help="the CPU code's mcpu (runs on any x86-64 "
                   "with AVX2)")
    g.add_argument("--cpu-cores", type=int, default=16, help="the GPU machine's cores")
    g.add_argument("--no-vm-build", action="store_true", help="no Relax VM builds")
    g.add_argument("--vm-cpu", action="store_true",
                   help="also a Relax VM for the CPU (what --dry-run runs in the VM's place)")
    g.add_argument("--export-missing", action="store_true",
                   help="export corpus models missing from the cache (torch, minutes each)")
    g = p.add_argument_group("run")
    g.add_argument("--budget", type=float, default=230.0,
                   help="seconds after which no model or run starts (default 230)")
    g.add_argument("--model-min-s", type=float, default=12.0,
                   help="a model starts only with this many seconds left")
    g.add_argument("--repeat", type=int, default=10, help="timed repeats per figure")
    g.add_argument("--budget-per-run", type=float, default=1.0,
                   help="seconds of timed runs per figure at most (then fewer repeats)")
    g.add_argument("--tolerance", type=float, default=1e-3, help="rel diff that is a note")
    g.add_argument("--no-vm", action="store_true")
    g.add_argument("--no-torch", action="store_true")
    g.add_argument("--site", default=SITE, help="where the runtime is unpacked")
    g.add_argument("--out", default=os.environ.get("OUT"), help="results dir (default $OUT)")
    g = p.add_argument_group("report")
    g.add_argument("--from-json", help="table a gpu_bench.json instead of running")
    g.add_argument("--markdown", help="replace the gpu_bench section of this markdown file")
    return p.parse_args(argv)


def report_from_json(args: argparse.Namespace) -> int:
    from gpu_bench_report import markdown, write_section

    report = read_json(args.from_json)
    print(markdown(report))
    if args.markdown:
        write_section(args.markdown, report.get("command", "python3 python/gpu_bench.py"),
                      markdown(report))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    started = time.monotonic()
    if args.prepare:
        from gpu_bench_prepare import prepare

        options = {"kernels": args.kernels, "without": sorted(args.without), "arch": args.arch,
                   "mcpu": args.mcpu, "cpu_cores": args.cpu_cores, "vm": not args.no_vm_build,
                   "vm_cpu": args.vm_cpu, "export_missing": args.export_missing}
        return prepare(list(args.models or MODELS), options)
    if args.from_json:
        return report_from_json(args)
    path = os.path.join(BUNDLE, BUNDLE_FILE)
    if not os.path.exists(path):
        raise SystemExit(f"gpu_bench: no {path}: run `python python/gpu_bench.py --prepare` "
                         f"first (and carry .gpu to the GPU machine)")
    bundle = read_json(path)
    for note in bootstrap(bundle, args.site):
        print(note, flush=True)
    from gpu_bench_device import run
    from gpu_bench_report import markdown, save, write_section

    command = "python3 python/gpu_bench.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    report = run(BUNDLE, bundle, args, started,
                 lambda r: save({**r, "command": command.strip()}, args.out))
    report["command"] = command.strip()
    save(report, args.out)
    print(markdown(report))
    if args.markdown:
        write_section(args.markdown, report["command"], markdown(report))
    print(f"gpu_bench: {time.monotonic() - started:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
