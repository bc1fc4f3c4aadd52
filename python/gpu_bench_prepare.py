"""``gpu_bench.py --prepare``: build everything the GPU machine runs, here, into ``.gpu/``.

Per model (a real-size corpus export): hgrt builds for cuda only, auto (cpu + cuda) and cpu
only, and the Relax VM on cuda (TVM's ONNX import, its default CUDA pipeline with dlight's
schedules, weights lifted out of ``main``); their CUDA kernels compiled here with nvcc (the GPU
machine has no CUDA compiler of TVM's), by the sha256 of their source; weights as recipes
(``gpu_bench_bundle``). Each model is one ``.tar.xz``, cached under
``~/.cache/hgrt/gpu_bench`` by a fingerprint of the ONNX file, the options and hgrt's sources:
an unchanged model is not built again.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
import shutil
import sys
import tarfile
import tempfile
import time

import numpy as np
from gpu_bench_bundle import (
    BUNDLE,
    BUNDLE_FILE,
    FORMAT,
    KERNELS_DIR,
    MODEL_FILE,
    REPO,
    SMALL_FILE,
    Bases,
    read_json,
    recipes,
    write_json,
)

CACHE = os.path.join(os.path.expanduser("~"), ".cache", "hgrt", "gpu_bench")
SOURCES = ("hgrt", "relay_passes", "runtime", "providers")
# this step's own files: what they write into an archive (the recipes) is part of it too
OWN_SOURCES = ("python/gpu_bench_bundle.py", "python/gpu_bench_prepare.py")
FFI_WHEEL = "apache_tvm_ffi-0.1.14.post1-cp312-*.whl"
RUNTIME_TAR = "tvm_runtime.tar.xz"
# what of the installed tvm package the GPU machine does not need: the compiler library
# (250 MB), CUTLASS's sources, the runtime's C++ sources, the web runtime
TVM_LEFT_OUT = ("lib/libtvm_compiler.so", "3rdparty", "src", "web", "__pycache__")
FALLBACK_PACKAGES = ("psutil", "typing_extensions")  # pure or abi3: used where none is there
BUILDS = {  # label -> (devices, placement fields, kernels: None for the option's)
    "cuda": (["cuda:0", "cpu:0"], {"preferred": "cuda:0", "fallback": "cpu:0"}, None),
    "auto": (["cpu:0", "cuda:0"], {"auto": True}, None),
    "cpu": (["cpu:0"], {}, None),
    # TVM's kernels alone on cuda: what the kernel providers add, and a build to run where a
    # provider's runtime cannot be set up on the GPU machine
    "cuda_tvm": (["cuda:0", "cpu:0"], {"preferred": "cuda:0", "fallback": "cpu:0"}, "tvm"),
    # the split of gpu_check.py: convolutions on cuda, the rest on the CPU, copies between
    "split": (["cpu:0", "cuda:0"], {"rules": {"nn.conv2d": "cuda:0"}, "fallback": "cpu:0"},
              None),
}
# light zoo models whose every build is checked against onnxruntime on the GPU machine (the
# ONNX file travels: its weights are the builds' weights)
# and the classifier whose TopK / CumSum have no CUDA kernel (hgrt.corpus.postprocess, its
# "real" size): on cpu:0 + cuda:0 those ops go to the CPU by themselves
CHECKS = ("squeezenet", "postprocess")
CHECK_BUILDS = ("cpu", "cuda", "split", "auto")


def fingerprint(onnx_path: str | None, options: dict) -> str:
    """What a model's archive depends on: the ONNX file, the options, hgrt's sources and the
    bundle's ``FORMAT`` (raise it when an archive's contents change)."""
    h = hashlib.sha256(repr((FORMAT, sorted(options.items()))).encode())
    if onnx_path is not None:  # (a check model is made by hgrt's own sources)
        st = os.stat(onnx_path)
        h.update(f"{onnx_path} {st.st_size} {st.st_mtime_ns}".encode())
    files = []
    for folder in SOURCES:
        for ext in ("py", "cc", "h"):
            files += glob.glob(os.path.join(REPO, folder, "**", f"*.{ext}"), recursive=True)
    files += [os.path.join(REPO, f) for f in OWN_SOURCES]
    for path in sorted(files):
        h.update(path.encode())
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def cuda_sources(lib) -> list[str]:
    """The CUDA C++ source of each CUDA module a built library imports."""
    out, stack = [], list(lib.imports)
    while stack:
        m = stack.pop()
        stack += list(m.imports)
        if m.kind == "cuda":
            out.append(m.inspect_source("cuda"))
    return out


# a kernel's definition (its declarations end in ";")
_KERNEL = re.compile(
    r'extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\([^)]*\)\s*\{')


def fast_math_pow(lib) -> list[str]:
    """The CUDA kernels of ``lib`` that call ``powf``: nvcc's ``--use_fast_math`` (TVM's
    default, off with ``TVM_CUDA_NVCC_NO_FAST_MATH``; NVRTC's too) makes it ``exp2(y *
    log2(x))``, NaN for every ``x < 0`` whatever ``y`` (also 2: RMSNorm's square)."""
    if os.environ.get("TVM_CUDA_NVCC_NO_FAST_MATH"):
        return []
    names = set()
    for src in cuda_sources(lib):
        starts = [(m.start(), m.group(1)) for m in _KERNEL.finditer(src)]
        for (at, name), (end, _) in zip(starts, starts[1:] + [(len(src), "")], strict=True):
            if re.search(r"\bpowf\(", src[at:end]):
                names.add(name)
    return sorted(names)


def compile_kernels(lib, arch: str, into: str) -> list[str]:
    """Compile the CUDA modules of ``lib`` with nvcc (what TVM's ``tvm_callback_cuda_compile``
    does in its nvcc mode) into ``into/<sha256 of the source>.fatbin``; their keys."""
    import tvm
    from tvm.support import nvcc

    keys = []
    os.makedirs(into, exist_ok=True)
    for src in cuda_sources(lib):
        key = hashlib.sha256(src.encode()).hexdigest()
        path = os.path.join(into, f"{key}.fatbin")
        if not os.path.exists(path):
            with tvm.target.Target({"kind": "cuda", "arch": arch}):
                binary = nvcc.compile_cuda(src, target_format="fatbin", arch=arch,
                                           compiler="nvcc")
            with open(path, "wb") as f:
                f.write(bytes(binary))
        keys.append(key)
    return keys


def cpu_target(options: dict) -> dict:
    return {"kind": "llvm", "mcpu": options["mcpu"], "num-cores": options["cpu_cores"]}


def build_hgrt(label: str, onnx_path: str, options: dict, work: str, bases: Bases) -> dict:
    """One hgrt build saved into ``work/label`` without its weights; what the bundle says of
    it."""
    import hgrt

    devices, placement, kernels = BUILDS[label]
    t0 = time.perf_counter()
    res = hgrt.build(onnx_path, devices, hgrt.Placement(**placement),
                     kernels=kernels or options["kernels"], target={"cpu": cpu_target(options)},
                     cuda_arch=options["arch"])
    seconds = time.perf_counter() - t0
    hgrt.save(os.path.join(work, label), res.graph_json, res.lib, {})
    kernels = compile_kernels(res.lib, options["arch"], os.path.join(work, KERNELS_DIR))
    pow_kernels = fast_math_pow(res.lib)
    how = bases.resolve(res.params)
    copies = sum(1 for n in res.graph.nodes if n.func_name == "__copy")
    per_device = {}
    for row in res.placement_report:
        per_device[row.device] = per_device.get(row.device, 0) + 1
    print(f"  hgrt {label}: built in {seconds:.1f} s, {len(res.params)} weights, {copies} "
          f"copies, ops per device {per_device}, {len(kernels)} CUDA modules", flush=True)
    if pow_kernels:
        print(f"  hgrt {label}: WARNING: CUDA kernels calling powf under fast math (NaN for a "
              f"negative base): {pow_kernels[:4]}", flush=True)
    return {"devices": devices, "params": how, "copies": copies, "build_s": round(seconds, 2),
            "ops_per_device": per_device, "kernels": kernels, "fast_math_pow": pow_kernels}


def build_vm(label: str, onnx_path: str, options: dict, work: str, bases: Bases) -> dict:
    """The Relax VM on cuda (``vm``; ``vm_cpu``: on the CPU, for a dry run here): TVM's ONNX
    import with the weights as parameters, lifted out of ``main`` (``main_transform_params``
    runs once), TVM's default pipeline for the target (for CUDA: dlight's schedules)."""
    import onnx
    import tvm
    from tvm import relax
    from tvm.relax.frontend.onnx import from_onnx

    t0 = time.perf_counter()
    mod = from_onnx(onnx.load(onnx_path), keep_params_in_input=True)
    mod, detached = relax.frontend.detach_params(mod)
    main = mod["main"]
    num_input = int(main.attrs["num_input"])
    names = [p.name for p in main.params[num_input:]]
    values = [t.numpy() for t in detached.get("main", [])]
    mod = relax.transform.LiftTransformParams()(mod)
    target = tvm.target.Target(cpu_target(options)) if label == "vm_cpu" else \
        tvm.target.Target({"kind": "cuda", "arch": options["arch"]}, host=cpu_target(options))
    ex = tvm.compile(mod, target=target)
    os.makedirs(os.path.join(work, label), exist_ok=True)
    ex.export_library(os.path.join(work, label, "lib.so"))
    seconds = time.perf_counter() - t0
    kernels = compile_kernels(ex.mod, options["arch"], os.path.join(work, KERNELS_DIR))
    pow_kernels = fast_math_pow(ex.mod)
    how = bases.resolve(dict(zip(names, values, strict=True)))
    print(f"  Relax VM ({label}): built in {seconds:.1f} s, {len(names)} weights, "
          f"{len(kernels)} CUDA modules", flush=True)
    return {"params": [how[n] for n in names], "num_input": num_input,
            "transform": "main_transform_params" in [gv.name_hint for gv in mod.get_global_vars()],
            "build_s": round(seconds, 2), "kernels": kernels, "fast_math_pow": pow_kernels}


def unshared_recipes(builds: dict, table: dict) -> list[str]:
    """The regenerated weights that some hgrt builds use and others do not: a weight that a
    build derives from another in a way no recipe repeats (the outputs then differ)."""
    used = [{key for key, _ in b["params"].values() if "seed" in table[key]}
            for b in builds.values() if "error" not in b]
    return sorted(set.union(*used) - set.intersection(*used))


def source_of(name: str, options: dict) -> tuple[str | None, dict]:
    """A model's ONNX file (None for a check model: written at build) and its bundle entry
    (without the fingerprint)."""
    entry = {"name": name, "file": f"models/{name}.tar.xz"}
    if name in CHECKS:
        return None, {**entry, "family": "check", "check": True}
    from hgrt.corpus import spec
    from hgrt.corpus.generate import real_path
    from hgrt.corpus.specs import inputs_of

    s = spec(name)
    path = real_path(name, "dynamo", export_missing=options["export_missing"])
    return path, {**entry, "family": s.family,
                  "inputs": [list(i) for i in inputs_of(s, "real")]}


def build_all(name: str, onnx_path: str | None, options: dict, work: str) -> dict:
    """Every build of one model into ``work``, with ``model.json`` and ``small.npz``."""
    import onnx
    from onnx import numpy_helper

    bases, info, extra = Bases(), {"builds": {}}, {}
    if onnx_path is None:  # a light zoo model, calibrated, with its inputs (hgrt.testing)
        from hgrt.corpus.postprocess import postprocess_model
        from hgrt.testing import zoo_input, zoo_model

        if name == "postprocess":
            model, inputs = postprocess_model(size="real")
        else:
            model = zoo_model(name)
            inputs = zoo_input(model)
        onnx_path = os.path.join(work, "model.onnx")
        os.makedirs(work, exist_ok=True)
        onnx.save(model, onnx_path)
        inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
        extra = {f"input/{k}": v for k, v in inputs.items()}
        labels, vms = list(CHECK_BUILDS), []
    else:
        inits = None
        labels = ["cuda", "auto", "cpu"] + (["cuda_tvm"] if options["kernels"] != "tvm" else [])
        vms = ["vm"] * options["vm"] + ["vm_cpu"] * options["vm_cpu"]
    for label in labels:  # (unpacked weights first)
        try:
            info["builds"][label] = build_hgrt(label, onnx_path, options, work, bases)
        except Exception as e:  # the GPU machine runs the others; without cpu, nothing
            if label == "cpu":
                raise
            info["builds"][label] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"  hgrt {label}: NOT BUILT: {info['builds'][label]['error']}", flush=True)
    for label in vms:
        try:
            info[label] = build_vm(label, onnx_path, options, work, bases)
        except Exception as e:  # TVM's own import or pipeline: the hgrt builds still run
            info[label] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"  Relax VM ({label}): NOT BUILT: {info[label]['error']}", flush=True)
    table, arrays = recipes(name, bases.values, inits)
    info["unshared_recipes"] = unshared_recipes(info["builds"], table)
    if info["unshared_recipes"]:
        print(f"  WARNING: weights regenerated for some builds only (their outputs will "
              f"differ): {info['unshared_recipes'][:8]}", flush=True)
    write_json(os.path.join(work, MODEL_FILE), {"name": name, "bases": table, **info})
    np.savez(os.path.join(work, SMALL_FILE), **arrays, **extra)
    return {"recipes": sum(1 for r in table.values() if "seed" in r),
            "travel": sum(1 for r in table.values() if r.get("travels")),
            "from_onnx": sum(1 for r in table.values() if "onnx" in r),
            "builds": {k: {f: v[f] for f in ("copies", "build_s", "ops_per_device", "error")
                           if f in v} for k, v in info["builds"].items()}}


def prepare_model(name: str, options: dict) -> dict:
    """Build ``name`` (or take it from the cache); its entry of ``bundle.json``."""
    onnx_path, entry = source_of(name, options)
    entry["fingerprint"] = fp = fingerprint(onnx_path, options)
    archive = os.path.join(CACHE, f"{name}-{fp}.tar.xz")
    if os.path.exists(archive) and os.path.exists(archive + ".json"):
        print(f"{name}: up to date ({os.path.basename(archive)})", flush=True)
        return {**entry, **read_json(archive + ".json")}
    print(f"{name}: building" + (f" ({os.path.getsize(onnx_path) / 2**20:.0f} MiB ONNX)"
                                 if onnx_path else " (light zoo model)"), flush=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hgrt_gpu_bench_") as tmp:
        work = os.path.join(tmp, name)
        summary = build_all(name, onnx_path, options, work)
        os.makedirs(CACHE, exist_ok=True)
        with tarfile.open(archive + ".tmp", "w:xz", preset=9) as tar:
            tar.add(work, arcname=name)
    os.replace(archive + ".tmp", archive)
    for old in glob.glob(os.path.join(CACHE, f"{name}-*.tar.xz*")):  # earlier fingerprints
        if not old.startswith(archive):
            os.remove(old)
    summary.update(prepare_s=round(time.perf_counter() - t0, 1),
                   bytes=os.path.getsize(archive))
    write_json(archive + ".json", summary)
    print(f"{name}: {summary['prepare_s']} s, archive {summary['bytes'] / 2**20:.2f} MiB, "
          f"{summary['recipes']} weights as recipes, {summary['travel']} travel", flush=True)
    return {**entry, **summary}


def runtime_files(bundle: str) -> dict:
    """The tvm-ffi wheel for the GPU machine's Python, and the installed tvm package without
    its compiler, as ``tvm_runtime.tar.xz`` (with pure or abi3 fallbacks of its imports)."""
    import tvm

    wheels = sorted(glob.glob(os.path.join(REPO, ".whl", FFI_WHEEL)))
    if not wheels:
        raise SystemExit(f"no {FFI_WHEEL} in {os.path.join(REPO, '.whl')}: download it with "
                         f"`pip download apache-tvm-ffi==0.1.14.post1 --only-binary=:all: "
                         f"--python-version 3.12 --no-deps -d .whl`")
    wheel = os.path.basename(wheels[-1])
    shutil.copyfile(wheels[-1], os.path.join(bundle, wheel))
    tar_path = os.path.join(bundle, RUNTIME_TAR)
    site = os.path.dirname(os.path.dirname(os.path.abspath(tvm.__file__)))
    if not os.path.exists(tar_path):
        def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
            rel = info.name.split("/", 1)[1] if "/" in info.name else ""
            return None if any(rel == x or rel.startswith(x + "/") or f"/{x}/" in f"/{rel}/"
                               for x in TVM_LEFT_OUT) else info

        with tarfile.open(tar_path + ".tmp", "w:xz", preset=6) as tar:
            tar.add(os.path.join(site, "tvm"), arcname="tvm", filter=keep)
            for dist in glob.glob(os.path.join(site, "apache_tvm-*.dist-info")):
                tar.add(dist, arcname=os.path.basename(dist))
            for pkg in FALLBACK_PACKAGES:
                found = glob.glob(os.path.join(site, pkg)) + glob.glob(
                    os.path.join(site, f"{pkg}.py"))
                for path in found:
                    tar.add(path, arcname=f"fallback/{os.path.basename(path)}",
                            filter=lambda i: None if "__pycache__" in i.name else i)
        os.replace(tar_path + ".tmp", tar_path)
    return {"ffi_wheel": wheel, "tvm": RUNTIME_TAR, "tvm_version": tvm.__version__}


def prepare(models: list[str], options: dict) -> int:
    """Write ``.gpu/``: the runtime, one archive per model, ``bundle.json``."""
    from hgrt import providers

    for name in options["without"]:
        providers.unregister(name)  # not installed on the GPU machine
    os.makedirs(os.path.join(BUNDLE, "models"), exist_ok=True)
    t0 = time.perf_counter()
    bundle = {"format": FORMAT, "options": options, "runtime": runtime_files(BUNDLE),
              "models": []}
    for name in models:
        try:
            entry = prepare_model(name, options)
        except Exception as e:  # a model that does not build is left out, and said so
            print(f"{name}: FAILED: {type(e).__name__}: {str(e)[:2000]}", flush=True)
            continue
        shutil.copyfile(os.path.join(CACHE, f"{name}-{entry['fingerprint']}.tar.xz"),
                        os.path.join(BUNDLE, entry["file"]))
        bundle["models"].append(entry)
    kept = {os.path.basename(e["file"]) for e in bundle["models"]}
    for path in glob.glob(os.path.join(BUNDLE, "models", "*.tar.xz")):
        if os.path.basename(path) not in kept:
            os.remove(path)
    bundle["prepare_s"] = round(time.perf_counter() - t0, 1)
    write_json(os.path.join(BUNDLE, BUNDLE_FILE), bundle)
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(BUNDLE) for f in fs)
    print(f"{BUNDLE}: {len(bundle['models'])} models, {total / 2**20:.1f} MiB, prepared in "
          f"{bundle['prepare_s']} s", file=sys.stderr if total > 40 << 20 else sys.stdout)
    return 0 if len(bundle["models"]) == len(models) else 1
