"""onnxruntime on a narrower x86 ISA than the host's, for benchmarks: an AVX2 build of hgrt's
kernels against an AVX2 onnxruntime on an AVX-512 host (what an AVX2-only host would compare).

onnxruntime has no switch for its ISA: its kernel library (MLAS) reads CPUID once, when the
library loads, and its CPU-info singleton on first use. ``cap_onnxruntime("avx2")`` loads
onnxruntime (and runs one small session) while CPUID in this thread reports no AVX-512, AMX or
AVX-VNNI (Linux's CPUID faulting, ``cpuid_cap.c``), then lifts the cap: later threads and TVM,
LLVM and oneDNN see the real CPU. Measured on a Xeon with AVX-512 (2 threads): light resnet50
24 -> 37.5 ms, squeezenet 2.3 -> 3.6 ms under the cap.

Needs Linux on x86-64, a C compiler (``cc``) and CPUID faulting (``cpuid_fault`` in
/proc/cpuinfo flags; KVM guests usually have it). Where any is missing, onnxruntime runs the
host's ISA and the returned line says why.
"""

from __future__ import annotations

import ctypes
import gc
import hashlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

SOURCE = Path(__file__).with_name("cpuid_cap.c")

# CPUID bits that an AVX2 machine (Haswell and later, before AVX-512) does not report
_AVX2 = dict(
    # leaf 7.0 EBX: AVX512F, DQ, IFMA, PF, ER, CD, BW, VL
    leaf7_ebx=sum(1 << b for b in (16, 17, 21, 26, 27, 28, 30, 31)),
    # leaf 7.0 ECX: AVX512_VBMI, VBMI2, VNNI, BITALG, VPOPCNTDQ
    leaf7_ecx=sum(1 << b for b in (1, 6, 11, 12, 14)),
    # leaf 7.0 EDX: AVX512_4VNNIW, 4FMAPS, VP2INTERSECT, AMX_BF16, AVX512_FP16, AMX_TILE, AMX_INT8
    leaf7_edx=sum(1 << b for b in (2, 3, 8, 22, 23, 24, 25)),
    # leaf 7.1 EAX: AVX_VNNI, AVX512_BF16
    leaf7_1_eax=sum(1 << b for b in (4, 5)),
)
MASKS = {"avx2": _AVX2}
CAPPED = "CPUID capped"  # what cap_onnxruntime's answer ends with when the cap took


def _library() -> ctypes.CDLL:
    """cpuid_cap.c compiled once into the cache (keyed by its source), loaded."""
    src = SOURCE.read_bytes()
    cache = Path(os.environ.get("HGRT_CACHE_DIR", Path.home() / ".cache" / "hgrt"))
    lib = cache / f"cpuid_cap-{hashlib.sha256(src).hexdigest()[:12]}.so"
    if not lib.exists():
        cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
        if cc is None:
            raise OSError("no C compiler (cc) to build cpuid_cap.c")
        cache.mkdir(parents=True, exist_ok=True)
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        subprocess.run([cc, "-O2", "-shared", "-fPIC", str(SOURCE), "-o", str(tmp)],
                       check=True, capture_output=True)
        tmp.replace(lib)
    so = ctypes.CDLL(str(lib))
    so.cpuid_cap_begin.argtypes = [ctypes.c_uint] * 4
    so.cpuid_leaf7_ebx.restype = ctypes.c_uint
    return so


def _load_onnxruntime() -> None:
    """Import onnxruntime and run one small session (its lazily read CPU info)."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [16, 16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [16, 16])
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "x"], ["y"])], "cap", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    sess.run(None, {"x": np.ones((16, 16), np.float32)})
    del sess  # its pool threads, created under the cap, end with it
    gc.collect()


def cap_onnxruntime(isa: str, host_isa: str) -> str:
    """Load onnxruntime so that it runs ``isa`` (hgrt's vector ISA names) on a host of
    ``host_isa``; returns the ISA it runs, with the reason where that is the host's. Call before
    anything imports onnxruntime."""
    if isa == host_isa or isa not in MASKS:
        return host_isa if isa == host_isa else f"{host_isa} (no CPUID cap for {isa})"
    if importlib.util.find_spec("onnxruntime") is None:
        return f"{host_isa} (onnxruntime not installed)"
    if "onnxruntime" in sys.modules:
        return f"{host_isa} (onnxruntime was loaded before the CPUID cap)"
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"{host_isa} (CPUID faulting needs Linux on x86-64)"
    import tvm  # noqa: F401  (TVM installs its SIGSEGV handler at import: ours must chain to it)

    try:
        so = _library()
    except (OSError, subprocess.CalledProcessError) as e:
        return f"{host_isa} (cpuid_cap.c not built: {str(e).splitlines()[0][:80]})"
    mask = MASKS[isa]
    if so.cpuid_cap_begin(*mask.values()) != 0:
        so.cpuid_cap_end()
        return f"{host_isa} (no CPUID faulting on this machine)"
    try:
        if so.cpuid_leaf7_ebx() & mask["leaf7_ebx"]:
            return f"{host_isa} (the CPUID cap did not take)"
        _load_onnxruntime()
    finally:
        so.cpuid_cap_end()
    return f"{isa} ({CAPPED})"
