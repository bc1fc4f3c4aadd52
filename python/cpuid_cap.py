"""onnxruntime on a narrower x86 ISA than the host's, for benchmarks: an AVX2 build of hgrt's
kernels against an AVX2 onnxruntime on an AVX-512 host (what an AVX2-only host would compare).

onnxruntime has no switch for its ISA: its kernel library (MLAS) reads CPUID once, when the
library loads, and its CPU-info singleton on first use. ``cap_onnxruntime("avx2")`` loads
onnxruntime (and runs one small session) while CPUID in this thread reports no AVX-512, AMX or
AVX-VNNI (Linux's CPUID faulting, ``cpuid_cap.c``), then lifts the cap: later threads and TVM,
LLVM and oneDNN see the real CPU. Measured on a Xeon with AVX-512 (2 threads): light resnet50
24 -> 37.5 ms, squeezenet 2.3 -> 3.6 ms under the cap.

Where the CPU has no CPUID faulting (``cpuid_fault`` in /proc/cpuinfo flags: Intel KVM guests
usually have it, AMD hosts do not), onnxruntime is imported from a patched copy instead (made
once into the cache: links to the installed files, its extension library copied): each CPUID
and XGETBV instruction ``objdump`` finds in that library traps to a handler that answers leaf 7
as an AVX2 machine would, and XCR0 without the AVX-512 and AMX state (other leaves as the CPU
answers them; under gdb, ``handle SIGTRAP nostop noprint pass``). The cap then holds for
onnxruntime alone, in every thread, for the life of the process; TVM, LLVM and oneDNN run
unpatched code and see the real CPU. The answer says which way took (``(CPUID capped)``,
``(CPUID capped, patched)``).

Needs Linux on x86-64 and a C compiler (``cc``); the patched copy ``objdump`` (binutils).
Where any is missing, onnxruntime runs the host's ISA and the returned line says why.
"""

from __future__ import annotations

import ctypes
import gc
import hashlib
import importlib.util
import json
import os
import platform
import re
import shutil
import struct
import subprocess
import sys
import tempfile
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
    # XCR0 (patched path only): opmask, ZMM_Hi256, Hi16_ZMM; AMX TILECFG, TILEDATA
    xcr0=sum(1 << b for b in (5, 6, 7, 17, 18)),
)
MASKS = {"avx2": _AVX2}
CAPPED = "CPUID capped"  # what cap_onnxruntime's answer says (in brackets) when the cap took


def _cache() -> Path:
    from hgrt.providers.onednn.kernels import cache_root  # (one home for hgrt's cache directory)

    return cache_root()


def _library() -> ctypes.CDLL:
    """cpuid_cap.c compiled once into the cache (keyed by its source), loaded."""
    src = SOURCE.read_bytes()
    cache = _cache()
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
    so.cpuid_trap_begin.argtypes = [ctypes.c_uint] * 4 + [
        ctypes.c_ulonglong, ctypes.POINTER(ctypes.c_ulong), ctypes.POINTER(ctypes.c_ubyte),
        ctypes.c_int, ctypes.c_char_p]
    so.cpuid_trap_hits.restype = ctypes.c_long
    return so


# what each patched instruction is, and its bytes
_SITES = {"cpuid": (0, b"\x0f\xa2"), "xgetbv": (1, b"\x0f\x01\xd0")}


def _load_segments(data: bytes) -> list[tuple[int, int, int]]:
    """(address, file offset, size in the file) of each loadable segment of a 64-bit ELF."""
    if data[:5] != b"\x7fELF\x02":
        raise OSError("not a 64-bit ELF file")
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    out = []
    for i in range(phnum):
        at = phoff + i * phentsize
        ptype, _, offset, vaddr, _, filesz = struct.unpack_from("<IIQQQQ", data, at)
        if ptype == 1:  # PT_LOAD
            out.append((vaddr, offset, filesz))
    return out


def _patch(library: Path) -> list[tuple[int, int]]:
    """Turn each CPUID / XGETBV instruction of ``library`` (as objdump disassembles it) into
    an INT3 and NOPs, in place; returns (offset from the load address, kind) of each."""
    objdump = shutil.which("objdump")
    if objdump is None:
        raise OSError("no objdump (binutils) to find CPUID instructions")
    text = subprocess.run([objdump, "-d", "--no-show-raw-insn", str(library)], check=True,
                          capture_output=True, text=True).stdout
    found = re.findall(r"^\s*([0-9a-f]+):\s+(cpuid|xgetbv)\s*$", text, re.M)
    data = bytearray(library.read_bytes())
    segments = _load_segments(data)
    sites = []
    for at, name in found:
        kind, code = _SITES[name]
        at = int(at, 16)
        offset = next((at - va + off for va, off, size in segments if va <= at < va + size), None)
        if offset is None or data[offset:offset + len(code)] != code:
            raise OSError(f"{name} at {at:#x} is not where objdump put it")
        data[offset:offset + len(code)] = b"\xcc" + b"\x90" * (len(code) - 1)
        sites.append((at, kind))
    if not sites:
        raise OSError("objdump found no CPUID instruction in it")
    library.write_bytes(bytes(data))
    return sites


def _copy_and_patch(package: Path, library: Path, into: Path) -> None:
    """``package`` as links under ``into``/onnxruntime, ``library`` copied and patched
    (``_patch``); the patched sites in ``into``/sites.json."""
    for path in package.rglob("*"):
        if "__pycache__" in path.parts:
            continue
        to = into / "onnxruntime" / path.relative_to(package)
        if path.is_dir():
            to.mkdir(parents=True, exist_ok=True)
            continue
        to.parent.mkdir(parents=True, exist_ok=True)
        if path == library:
            shutil.copyfile(path, to)
        else:
            to.symlink_to(path)
    sites = _patch(into / "onnxruntime" / library.relative_to(package))
    (into / "sites.json").write_text(json.dumps(sites))


def _patched_onnxruntime() -> tuple[Path, list[tuple[int, int]]]:
    """A copy of the installed onnxruntime package whose extension library is patched
    (``_patch``), made once into the cache; returns the directory to import it from and the
    patched sites."""
    package = Path(importlib.util.find_spec("onnxruntime").submodule_search_locations[0])
    libs = sorted(package.glob("capi/onnxruntime_pybind11_state*.so"))
    if len(libs) != 1:
        raise OSError(f"{len(libs)} onnxruntime extension libraries in {package / 'capi'}")
    st = libs[0].stat()
    # the installed library, and how this file and cpuid_cap.c patch and answer it
    how = hashlib.sha256(Path(__file__).read_bytes() + SOURCE.read_bytes()).hexdigest()
    key = hashlib.sha256(f"{libs[0]}:{st.st_size}:{st.st_mtime_ns}:{how}".encode()).hexdigest()
    root = _cache() / f"onnxruntime-cpuid-{key[:12]}"
    if not (root / "sites.json").exists():
        root.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{root.name}.", suffix=".tmp", dir=root.parent))
        try:
            _copy_and_patch(package, libs[0], tmp)
            tmp.replace(root)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not (root / "sites.json").exists():  # (else another process made it first)
                raise
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return root, [tuple(s) for s in json.loads((root / "sites.json").read_text())]


def _cap_by_patching(so: ctypes.CDLL, isa: str, host_isa: str) -> str:
    """onnxruntime imported from its patched copy, its CPUID answered as ``isa``'s."""
    try:
        root, sites = _patched_onnxruntime()
    except (OSError, subprocess.CalledProcessError) as e:
        return f"{host_isa} (no CPUID faulting, and onnxruntime not patched: {e})"
    mask = MASKS[isa]
    at = (ctypes.c_ulong * len(sites))(*(s[0] for s in sites))
    kinds = (ctypes.c_ubyte * len(sites))(*(s[1] for s in sites))
    if so.cpuid_trap_begin(mask["leaf7_ebx"], mask["leaf7_ecx"], mask["leaf7_edx"],
                           mask["leaf7_1_eax"], mask["xcr0"], at, kinds, len(sites),
                           root.name.encode()) != 0:
        return f"{host_isa} (the CPUID trap handler was not installed)"
    sys.path.insert(0, str(root))
    try:
        _load_onnxruntime()
    except Exception as e:  # noqa: BLE001  (the answer says why, as for every other way out)
        return f"{host_isa} (the patched onnxruntime did not load: {str(e).splitlines()[0][:80]})"
    import onnxruntime

    if Path(onnxruntime.__file__).parent != root / "onnxruntime":
        return f"{host_isa} (onnxruntime came from {onnxruntime.__file__}, not the patched copy)"
    if so.cpuid_trap_hits() == 0:
        return f"{host_isa} (the patched onnxruntime asked no CPUID)"
    return f"{isa} ({CAPPED}, patched)"


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


def cap_onnxruntime(isa: str, host_isa: str, *, patch: bool | None = None) -> str:
    """Load onnxruntime so that it runs ``isa`` (hgrt's vector ISA names) on a host of
    ``host_isa``; returns the ISA it runs, with the reason where that is the host's. Call before
    anything imports onnxruntime. ``patch``: True patches even where CPUID faults (tests),
    False never patches; by default, only where it does not."""
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
    fault = {k: v for k, v in mask.items() if k != "xcr0"}
    if patch or so.cpuid_cap_begin(*fault.values()) != 0:
        so.cpuid_cap_end()
        if patch is False:
            return f"{host_isa} (no CPUID faulting on this machine)"
        return _cap_by_patching(so, isa, host_isa)
    try:
        if so.cpuid_leaf7_ebx() & mask["leaf7_ebx"]:
            return f"{host_isa} (the CPUID cap did not take)"
        _load_onnxruntime()
    finally:
        so.cpuid_cap_end()
    return f"{isa} ({CAPPED})"


def main(argv: list[str] | None = None) -> None:
    """Time onnxruntime alone on zoo models, capped or not: what the cap does to it here."""
    import argparse
    import statistics
    import time

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("models", nargs="+", help="zoo names (squeezenet, resnet50, ...)")
    ap.add_argument("--isa", default=None, help="cap onnxruntime to this ISA (avx2)")
    ap.add_argument("--patch", action="store_true", help="the patched copy even where CPUID faults")
    ap.add_argument("--runs", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(SOURCE.parent.parent))
    from hgrt.devices import host_target, vector_isa
    from hgrt.zoo import light_input, light_model

    host = vector_isa(host_target()).name
    said = cap_onnxruntime(args.isa, host, patch=args.patch or None) if args.isa else host
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = args.threads
    print(f"onnxruntime {ort.__version__} runs {said}, {args.threads} threads")
    for name in args.models:
        model = light_model(name)
        sess = ort.InferenceSession(model.SerializeToString(), opts,
                                    providers=["CPUExecutionProvider"])
        feed = light_input(model)
        for _ in range(10):
            sess.run(None, feed)
        times = []
        for _ in range(args.runs):
            t = time.perf_counter()
            sess.run(None, feed)
            times.append(time.perf_counter() - t)
        print(f"{name}: median {1e3 * statistics.median(times):.2f} ms of {args.runs} runs")


if __name__ == "__main__":
    main()
