"""``gpu_bench.py`` on the GPU machine: TVM's runtime only (no compiler), the CUDA backend
loaded by hand, every model of ``.gpu/`` run as hgrt cuda only, auto and cpu only, the Relax
VM on cuda, and PyTorch eager; timed, compared, tabled.

Imported after ``gpu_bench.bootstrap`` has put the runtime-only TVM on ``sys.path``.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable

import numpy as np
from gpu_bench_bundle import KERNELS_DIR, MODEL_FILE, SMALL_FILE, params_of, read_json, regenerate

BATCH_SECONDS = 0.01  # each timed repeat runs the model this long at least


# ---- the CUDA backend ---------------------------------------------------------------------
def _cudart_candidates() -> list[str]:
    """libcudart.so.13 files: CUDA toolkits, and the nvidia wheels PyTorch brings."""
    found = []
    for root in [p for p in sys.path if p and os.path.isdir(p)]:
        found += glob.glob(os.path.join(root, "nvidia", "**", "libcudart.so.13*"), recursive=True)
        found += glob.glob(os.path.join(root, "torch", "lib", "libcudart*.so.13*"))
    for pattern in ("/usr/local/cuda*/lib64/libcudart.so.13*",
                    "/usr/lib/x86_64-linux-gnu/libcudart.so.13*"):
        found += glob.glob(pattern)
    return found


def _loaded(fragment: str) -> list[str]:
    """Paths of the shared libraries mapped into this process whose name holds ``fragment``."""
    try:
        with open("/proc/self/maps") as f:
            return sorted({line.split()[-1] for line in f if fragment in line.split()[-1]})
    except OSError:
        return []


def load_cuda_backend() -> list[str]:
    """TVM's CUDA backend on this runtime-only TVM (``hgrt.devices.backends``); where its
    libcudart is not found there, the CUDA toolkits' and PyTorch's tried too. What was loaded
    from where; a RuntimeError with a diagnosis."""
    import tvm
    import tvm_ffi

    from hgrt.devices.backends import ensure_backend

    tried = []
    for attempt in (None, "libcudart.so.13", *_cudart_candidates(), "torch"):
        try:
            if attempt == "torch":  # its CUDA initialization maps the libcudart it ships
                import torch

                torch.cuda.init()
            elif attempt is not None:
                ctypes.CDLL(attempt, mode=ctypes.RTLD_GLOBAL)
            ensure_backend("cuda")
            break
        except Exception as e:  # (each attempt says why it failed)
            tried.append(f"{attempt or 'hgrt.devices.backends'}: {str(e)[:300]}")
    else:
        raise RuntimeError(f"TVM's CUDA backend cannot be loaded; tried {tried}; libcuda "
                           f"mapped: {_loaded('libcuda.so') or 'none'}")
    notes = [f"libcudart: {_loaded('libcudart')}", f"libcuda: {_loaded('libcuda.so')}",
             f"TVM's CUDA runtime: {_loaded('libtvm_runtime_cuda')}"] + tried
    for name in ("device_api.cuda", "ffi.Module.load_from_bytes.cuda"):
        if tvm_ffi.get_global_func(name, allow_missing=True) is None:
            notes.append(f"missing global function {name!r}")
    if not tvm.cuda(0).exist:
        raise RuntimeError(f"CUDA backend loaded but tvm.cuda(0).exist is False ({notes})")
    return notes


def use_prebuilt_kernels(dirs: list[str]) -> dict[str, int]:
    """Answer TVM's ``tvm_callback_cuda_compile`` (asked when a library's CUDA module holds
    source) with the binaries compiled at prepare time, by the sha256 of the source; a source
    without one goes to the hook registered before (``hgrt.devices.backends``: NVRTC). Call it
    after ``load_cuda_backend``, whose hook it must replace."""
    import tvm_ffi

    index = {}
    for d in dirs:
        for path in glob.glob(os.path.join(d, "*.fatbin")):
            index[os.path.basename(path)[:-len(".fatbin")]] = path
    previous = tvm_ffi.get_global_func("tvm_callback_cuda_compile", allow_missing=True)
    counts = {"prebuilt": 0, "compiled here": 0}

    def compile_cuda(code: str) -> bytes:
        key = hashlib.sha256(code.encode()).hexdigest()
        if key in index:
            counts["prebuilt"] += 1
            with open(index[key], "rb") as f:
                return f.read()
        counts["compiled here"] += 1
        print(f"  CUDA source {key[:12]} has no prebuilt binary: TVM's compile callback",
              flush=True)
        if previous is None:
            raise RuntimeError(f"no prebuilt kernels for CUDA source {key[:12]} and no "
                               f"tvm_callback_cuda_compile to fall back on")
        return bytes(previous(code))

    tvm_ffi.register_global_func("tvm_callback_cuda_compile", compile_cuda, override=True)
    return counts


# ---- timing -------------------------------------------------------------------------------
def time_ms(fn: Callable[[], object], sync: Callable[[], object], budget_s: float,
            repeat: int) -> float:
    """Median over ``repeat`` repeats (fewer when ``budget_s`` runs out) of the mean time of
    ``fn()`` in ms, after warm-up; ``sync()`` waits for queued GPU work."""
    fn()  # (the caller ran it once already: kernels loaded, memory allocated)
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    once = max(time.perf_counter() - t0, 1e-6)
    if once * 3 > budget_s:  # too slow to repeat within the budget: the one run it is
        return once * 1e3
    number = max(1, int(BATCH_SECONDS / once))
    repeat = max(3, min(repeat, int(budget_s / (once * number))))
    times = []
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / number)
    return statistics.median(times) * 1e3


def rel_diff(got: np.ndarray, ref: np.ndarray) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if got.shape != ref.shape:
        return float("inf")
    return float(np.max(np.abs(got - ref)) / (float(np.max(np.abs(ref))) or 1.0))


# ---- one model ----------------------------------------------------------------------------
class ModelRun:
    """One model of the bundle, unpacked in ``directory``: its weights regenerated once and
    each of its runs timed, within ``deadline`` (``time.monotonic()``)."""

    def __init__(self, entry: dict, directory: str, args, deadline: float) -> None:
        self.entry, self.dir, self.args, self.deadline = entry, directory, args, deadline
        self.meta = read_json(os.path.join(directory, MODEL_FILE))
        self.onnx = os.path.join(directory, "model.onnx") if entry.get("check") else None
        t0 = time.perf_counter()
        with np.load(os.path.join(directory, SMALL_FILE)) as small:
            small = dict(small)
        if self.onnx:  # a check model: its file's weights and inputs, onnxruntime the oracle
            import onnx
            from onnx import numpy_helper

            inits = {t.name: numpy_helper.to_array(t)
                     for t in onnx.load(self.onnx).graph.initializer}
            self.inputs = {k[len("input/"):]: v for k, v in small.items()
                           if k.startswith("input/")}
        else:
            from hgrt.corpus.manifest import seeded_inputs

            inits = None
            self.inputs = seeded_inputs([tuple(i) for i in entry["inputs"]])
        self.bases = regenerate(self.meta["bases"], small, inits)
        self.reference = "onnxruntime" if self.onnx else "cpu"
        self.row = {"name": entry["name"], "family": entry["family"], "ms": {}, "copies": {},
                    "rel_diff": {}, "notes": [], "check": bool(self.onnx),
                    "regenerate_s": round(time.perf_counter() - t0, 2)}
        self.outputs: dict[str, np.ndarray] = {}
        self.modules: dict = {}  # GPU builds loaded, timed in turns (timed_in_turns)

    def in_time(self, what: str) -> bool:
        if time.monotonic() < self.deadline:
            return True
        self.row["notes"].append(f"{what} skipped: past the time limit")
        return False

    def attempt(self, what: str, key: str, fn: Callable[[], None]) -> None:
        """``fn()``, which times ``key``; a failure is a note of the row, not the end."""
        if not self.in_time(what):
            return
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as e:
            self.row["notes"].append(f"{what} failed: {type(e).__name__}: {str(e)[:600]}")
            print(f"  {what} FAILED: {type(e).__name__}: {e}", flush=True)
        ms = self.row["ms"].get(key)
        diff = self.row["rel_diff"].get(key)
        print(f"  {what}: {'-' if ms is None else f'{ms:.3f}'} ms"
              + ("" if diff is None else f", rel diff {diff:.2e}")
              + f" ({time.perf_counter() - t0:.1f} s in all)", flush=True)

    def timed_in_turns(self) -> None:
        """The GPU builds loaded (``hgrt``) timed in turns, one batch of each per round, so
        that a drift of the GPU's clocks or of the host falls on every build alike; each
        build's median over the rounds. Closes them."""
        modules, self.modules = self.modules, {}
        try:
            if not modules:
                return
            once = {}
            for label, m in modules.items():
                m.run()
                m.sync()
                t0 = time.perf_counter()
                m.run()
                m.sync()
                once[label] = max(time.perf_counter() - t0, 1e-6)
            number = {k: max(1, int(BATCH_SECONDS / v)) for k, v in once.items()}
            per_round = sum(once[k] * number[k] for k in modules)
            rounds = max(3, min(self.args.repeat,
                                int(self.args.budget_per_run * len(modules) / per_round)))
            times: dict[str, list[float]] = {k: [] for k in modules}
            for _ in range(rounds):
                for label, m in modules.items():
                    m.sync()
                    t0 = time.perf_counter()
                    for _ in range(number[label]):
                        m.run()
                    m.sync()
                    times[label].append((time.perf_counter() - t0) / number[label])
            for label, ts in times.items():
                self.row["ms"][label] = statistics.median(ts) * 1e3
                print(f"  {label}: {self.row['ms'][label]:.3f} ms (median of {rounds} rounds "
                      f"timed in turns)", flush=True)
        finally:
            for m in modules.values():
                m.close()

    def hgrt(self, label: str, pageable: bool = False) -> None:
        """Build ``label`` loaded and run once; ``pageable``: its CPU pools in pageable memory
        (``HGRT_PIN_HOST=0``), timed as ``<label>_pageable`` beside the pinned one."""
        import hgrt
        from hgrt.api import create_loaded
        from hgrt.graph import Graph

        build = self.meta["builds"][label]
        if "error" in build:
            raise RuntimeError(f"not built at prepare: {build['error']}")
        with open(os.path.join(self.dir, label, "graph.json")) as f:
            graph = Graph.from_json(f.read())
        devices = [hgrt.devices.runtime_device(d) for d in build["devices"]]
        before = os.environ.get("HGRT_PIN_HOST")
        os.environ["HGRT_PIN_HOST"] = "0" if pageable else "1"
        try:
            m = create_loaded(graph, os.path.join(self.dir, label, "lib.so"), devices,
                              params_of(build["params"], self.bases))
        finally:
            if before is None:
                del os.environ["HGRT_PIN_HOST"]
            else:
                os.environ["HGRT_PIN_HOST"] = before
        label = f"{label}_pageable" if pageable else label
        try:
            m.set_input(**self.inputs)
            m.run()
            self.outputs[label] = m.get_output(0).numpy()
            self.row["copies"][label] = build["copies"]
        except BaseException:
            m.close()
            raise
        if label == "cpu":  # timed alone: the GPU builds are timed in turns (timed_in_turns)
            try:
                self.row["ms"][label] = time_ms(m.run, m.sync, self.args.budget_per_run,
                                                self.args.repeat)
            finally:
                m.close()
        else:
            self.modules[label] = m
        out = self.outputs[label]
        self.check_finite(f"hgrt {label}", out, build.get("fast_math_pow", []))
        if build["copies"] and not pageable and label != "cpu":
            self.attempt(f"hgrt {label}, pageable host memory", f"{label}_pageable",
                         lambda: self.hgrt(label, pageable=True))
        if label == "cpu" and np.all(np.isfinite(out)) and not np.std(out) > 0:
            self.row["notes"].append(f"hgrt cpu's output is not informative (std "
                                     f"{np.std(out):.2e})")
        if label != self.reference and self.reference in self.outputs:
            self.row["rel_diff"][label] = rel_diff(out, self.outputs[self.reference])

    def check_finite(self, what: str, out: np.ndarray, pow_kernels: list[str]) -> None:
        """A note where ``out`` holds NaN or inf, naming the kernels that call ``powf`` under
        fast math (NaN for a negative base) where the build has any."""
        nan, inf = int(np.isnan(out).sum()), int(np.isinf(out).sum())
        if nan or inf:
            self.row["notes"].append(
                f"{what}'s output has {nan} NaN and {inf} inf of {out.size}" + (
                    f" (its CUDA kernels {pow_kernels[:3]} call powf, which nvcc's "
                    f"--use_fast_math makes exp2(y * log2(x)): NaN for x < 0)"
                    if pow_kernels else ""))

    def onnxruntime(self) -> None:
        from hgrt.testing import onnx_reference

        self.outputs["onnxruntime"] = onnx_reference(self.onnx, self.inputs)[0]

    def vm(self, label: str, device: str) -> None:
        import tvm
        from tvm.runtime.vm import VirtualMachine

        from hgrt.devices import runtime_device

        spec = self.meta[label]
        if "error" in spec:
            raise RuntimeError(f"not built at prepare: {spec['error']}")
        dev = runtime_device(device)  # (the VM's figures go under "vm" either way)
        vm = VirtualMachine(tvm.runtime.load_module(os.path.join(self.dir, label, "lib.so")),
                            dev)
        weights = [tvm.runtime.tensor(self.bases[key], dev) for key, _ in spec["params"]]
        if spec["transform"]:
            weights = list(vm["main_transform_params"](weights))
        args = [tvm.runtime.tensor(self.inputs[name], dev) for name, *_ in self.entry["inputs"]]
        main = vm["main"]
        out = main(*args, *weights)
        out = out if hasattr(out, "numpy") else out[0]
        self.outputs["vm"] = out.numpy()
        self.row["ms"]["vm"] = time_ms(lambda: main(*args, *weights), dev.sync,
                                       self.args.budget_per_run, self.args.repeat)
        self.check_finite("Relax VM", self.outputs["vm"], spec.get("fast_math_pow", []))
        # the same function where both regenerate the same weights (the others travel: the
        # VM's own constants and the hgrt build's folded ones are the model's either way)
        table = self.meta["bases"]

        def regenerated(keys: list[str]) -> set[str]:
            return {key for key in keys if "seed" in table[key]}

        cpu_keys = [key for key, _ in self.meta["builds"]["cpu"]["params"].values()]  # (always)
        if "cpu" in self.outputs and regenerated([k for k, _ in spec["params"]]) == \
                regenerated(cpu_keys):
            self.row["rel_diff"]["vm"] = rel_diff(self.outputs["vm"], self.outputs["cpu"])

    def torch(self, device: str) -> None:
        import torch

        from hgrt.corpus import spec
        from hgrt.corpus.builders import build, torch_args

        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        s = spec(self.entry["name"])
        with torch.no_grad():
            model = build(s, "real").to(device)
            args = tuple(a.to(device) for a in torch_args(s, "real"))
            sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
            model(*args)
            self.row["ms"]["torch"] = time_ms(lambda: model(*args), sync,
                                              self.args.budget_per_run, self.args.repeat)


def run_check(entry: dict, directory: str, args, deadline: float, cuda: bool) -> dict:
    """A light zoo model: every build against onnxruntime (CPU) on the ONNX file."""
    r = ModelRun(entry, directory, args, deadline)
    print(f"{entry['name']} (checked against onnxruntime):", flush=True)
    r.attempt("onnxruntime (CPU)", "onnxruntime", r.onnxruntime)
    for label in ("cpu", "cuda", "split", "auto") if cuda else ("cpu",):
        if label in r.meta["builds"]:
            r.attempt(f"hgrt {label}", label, lambda label=label: r.hgrt(label))
    r.timed_in_turns()
    for label, value in r.row["rel_diff"].items():
        if not value <= args.tolerance:
            r.row["notes"].append(f"{label}: rel diff to onnxruntime {value:.2e} over "
                                  f"{args.tolerance:g}")
    return r.row


def run_model(entry: dict, directory: str, args, deadline: float, cuda: bool) -> dict:
    r = ModelRun(entry, directory, args, deadline)
    print(f"{entry['name']}: weights regenerated in {r.row['regenerate_s']} s", flush=True)
    if r.meta.get("unshared_recipes"):
        r.row["notes"].append(f"builds regenerate different weights "
                              f"({r.meta['unshared_recipes'][:3]}): rel diffs are not meaningful")
    r.attempt("hgrt cpu only", "cpu", lambda: r.hgrt("cpu"))
    if cuda:
        r.attempt("hgrt cuda only", "cuda", lambda: r.hgrt("cuda"))
        if "cuda_tvm" in r.meta["builds"]:
            r.attempt("hgrt cuda only, TVM's kernels", "cuda_tvm", lambda: r.hgrt("cuda_tvm"))
        r.attempt("hgrt auto", "auto", lambda: r.hgrt("auto"))
        r.timed_in_turns()
    vm = "vm" if cuda else "vm_cpu"
    if vm in r.meta and not args.no_vm:
        r.attempt(f"Relax VM on {'cuda' if cuda else 'cpu'}", "vm",
                  lambda: r.vm(vm, "cuda:0" if cuda else "cpu:0"))
    if not args.no_torch:
        r.attempt(f"PyTorch eager on {'cuda' if cuda else 'cpu'}", "torch",
                  lambda: r.torch("cuda" if cuda else "cpu"))
    for label, value in r.row["rel_diff"].items():
        if not value <= args.tolerance:
            r.row["notes"].append(f"{label}: rel diff {value:.2e} over {args.tolerance:g}")
    return r.row


# ---- the whole run ------------------------------------------------------------------------
def machine(cuda: bool) -> dict:
    import tvm

    m = {"python": platform.python_version(), "tvm": tvm.__version__,
         "cores": len(os.sched_getaffinity(0))}
    try:
        with open("/proc/cpuinfo") as f:
            m["cpu"] = next(x.split(":", 1)[1].strip() for x in f if x.startswith("model name"))
    except (OSError, StopIteration):
        m["cpu"] = platform.processor()
    try:
        import torch

        m["torch"] = torch.__version__
    except ImportError:
        pass
    from hgrt.runtime import native

    m["step_loop"] = f"Python ({native.missing_tools()})" if native.missing_tools() else "native"
    if cuda:
        dev = tvm.cuda(0)
        m.update(gpu=dev.device_name, compute=dev.compute_version,
                 gpu_gib=dev.total_global_memory / 2**30)
        try:
            m["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=10).stdout.strip() or "?"
        except (OSError, subprocess.SubprocessError):
            m["driver"] = "?"
    return m


def unpack(bundle_dir: str, entry: dict, into: str) -> str:
    with tarfile.open(os.path.join(bundle_dir, entry["file"])) as tar:
        tar.extractall(into, filter="data")
    return os.path.join(into, entry["name"])


def run(bundle_dir: str, bundle: dict, args, started: float, save: Callable) -> dict:
    """Every model of ``bundle`` (those named by ``args.models``), within ``args.budget``
    seconds of ``started``; ``save(report)`` after each model."""
    deadline = started + args.budget
    report = {"dry_run": args.dry_run, "date": time.strftime("%Y-%m-%d"),
              "repeat": args.repeat, "notes": [], "rows": []}
    cuda = not args.dry_run
    if cuda:
        for note in load_cuda_backend():
            print(note, flush=True)
    report["machine"] = machine(cuda)
    print(report["machine"], flush=True)
    entries = [e for e in bundle["models"] if not args.models or e["name"] in args.models]
    work = os.path.join(args.site, "models")
    dirs = [unpack(bundle_dir, e, work) for e in entries]
    counts = use_prebuilt_kernels([os.path.join(d, KERNELS_DIR) for d in dirs])
    for entry, directory in zip(entries, dirs, strict=True):
        left = deadline - time.monotonic()
        if left < args.model_min_s:
            report["notes"].append(f"{entry['name']} skipped: {left:.0f} s left of the "
                                   f"{args.budget:.0f} s limit")
            print(report["notes"][-1], flush=True)
            continue
        runner = run_check if entry.get("check") else run_model
        report["rows"].append(runner(entry, directory, args, deadline, cuda))
        report["kernels"] = dict(counts)
        report["seconds"] = round(time.monotonic() - started, 1)
        save(report)
    return report
