"""The CPU that code runs on: architectures (``machine_arch``) and the triple of a target's CPU
code, this host's cores, feature flags and LLVM target (``host_target``), what code built for a
target needs of a CPU (``cpu_requirements``, ``check_runs_here``) and the vector ISA its kernels
use (``vector_isa``).
"""

from __future__ import annotations

import os
import platform
import re
from dataclasses import dataclass

import tvm

from hgrt.errors import DeviceError


def target_triple(target: tvm.target.Target) -> str:
    """The LLVM triple of a target's CPU code (a GPU target's host), this host's by default."""
    cpu = target.host if target.kind.name != "llvm" and target.host is not None else target
    triple = str(cpu.attrs.get("mtriple", "") or "") if cpu.kind.name == "llvm" else ""
    return triple or str(tvm.target.codegen.llvm_get_system_triple())


# `uname -m` and triple names -> one name per architecture (as ELF headers name them)
ARCHES = {"x86_64": "x86_64", "amd64": "x86_64", "i386": "x86", "i686": "x86",
          "aarch64": "aarch64", "arm64": "aarch64", "aarch64_be": "aarch64", "arm": "arm",
          "riscv64": "riscv", "riscv32": "riscv", "ppc64le": "ppc64", "ppc64": "ppc64",
          "mips": "mips", "loongarch64": "loongarch"}


def machine_arch(name: str) -> str:
    """One name per architecture for a ``uname -m`` or the first part of a triple:
    ``arm64``/``aarch64`` -> ``aarch64``, ``amd64`` -> ``x86_64``, ``armv8l`` -> ``arm``."""
    name = str(name).split("-")[0].lower()
    if name in ARCHES:
        return ARCHES[name]
    if name.startswith(("armv", "thumb")):
        return "arm"
    return name


def is_host_triple(triple: str) -> bool:
    """Whether code for ``triple`` runs on this machine's architecture."""
    return machine_arch(triple) == machine_arch(platform.machine())


# The process's affinity mask when hgrt is imported: a TVM thread pool that starts with TVM's
# default mode pins its calling thread to one core, after which sched_getaffinity(0) answers 1.
_AFFINITY = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0


def usable_cores() -> int:
    """Cores this process may run on: its affinity mask; when that is one core, the mask when
    hgrt was imported (TVM's pinning, not the user's choice), at least 1."""
    if hasattr(os, "sched_getaffinity"):
        now = len(os.sched_getaffinity(0))
        return max(1, _AFFINITY if now == 1 else now)
    return os.cpu_count() or 1


def cpu_flags() -> set[str]:
    """The host CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"^flags\s*:(.*)$", f.read(), re.M)
        return set(m.group(1).split()) if m else set()
    except OSError:
        return set()


# LLVM's names of the x86 instruction-set extensions that generated code may use, and the
# /proc/cpuinfo flag that shows each: code built for a target runs only where every one that
# its mcpu/mattr enables is there (else SIGILL: an AVX-512 build on an AVX2 host)
X86_FEATURE_FLAGS = {
    "ssse3": "ssse3", "sse4.1": "sse4_1", "sse4.2": "sse4_2", "popcnt": "popcnt",
    "avx": "avx", "avx2": "avx2", "fma": "fma", "f16c": "f16c", "bmi": "bmi1", "bmi2": "bmi2",
    "lzcnt": "abm", "movbe": "movbe", "avx512f": "avx512f", "avx512bw": "avx512bw",
    "avx512dq": "avx512dq", "avx512vl": "avx512vl", "avx512cd": "avx512cd",
    "avx512vnni": "avx512_vnni", "avx512bf16": "avx512_bf16", "avx512fp16": "avx512_fp16",
    "avx512vbmi": "avx512vbmi", "avx512vbmi2": "avx512_vbmi2", "avx512ifma": "avx512ifma",
    "avx512bitalg": "avx512_bitalg", "avx512vpopcntdq": "avx512_vpopcntdq",
    "avxvnni": "avx_vnni", "amx-tile": "amx_tile", "amx-bf16": "amx_bf16",
    "amx-int8": "amx_int8",
}


def cpu_requirements(target: tvm.target.Target) -> dict | None:
    """What code built for the CPU ``target`` needs of the machine that runs it: its
    architecture and (x86) the instruction-set extensions LLVM enables for the target's
    ``mcpu``/``mattr``; None for a target that is not a CPU's."""
    if target.kind.name != "llvm":
        return None
    triple = target_triple(target) if "mtriple" in target.attrs else platform.machine()
    arch = machine_arch(triple)
    features: list[str] = []
    if arch == "x86_64":
        from tvm.target.codegen import llvm_get_cpu_features

        features = sorted(set(llvm_get_cpu_features(target)) & set(X86_FEATURE_FLAGS))
    return {"arch": arch, "features": features}


def check_runs_here(needs: dict, device: str) -> None:
    """A ``DeviceError`` when this machine cannot run code that ``needs`` (``cpu_requirements``)
    on ``device``: another architecture, or an instruction-set extension its CPU lacks."""
    here = machine_arch(platform.machine())
    if needs["arch"] != here:
        raise DeviceError(f"{device}: the library was built for {needs['arch']}, this machine "
                          f"is {here}: run it on such a board through RPC (hgrt.load(..., "
                          f"session=...) or hgrt run --rpc-tracker), or rebuild for this host")
    flags = cpu_flags()
    missing = [f for f in needs["features"] if flags and X86_FEATURE_FLAGS.get(f, f) not in flags]
    if missing and os.environ.get("HGRT_CPU_CHECK", "1") != "0":
        raise DeviceError(f"{device}: the library was built for {', '.join(missing)}, which "
                          f"this CPU lacks (a kernel that uses one dies of an illegal "
                          f"instruction): rebuild on this host, or for it with --target "
                          f"'cpu=llvm -mcpu=...' (hgrt compile prints the ISA it built for); "
                          f"HGRT_CPU_CHECK=0 runs it anyway")


@dataclass(frozen=True)
class VectorISA:
    """What a CPU target's kernels can use: its widest vector ISA, the vector width and the
    number of vector registers (what a register tile must fit in)."""

    name: str  # "avx512", "avx2", "avx", "sse", "neon", "scalar"
    bits: int
    registers: int

    def lanes(self, dtype_bits: int = 32) -> int:
        return max(1, self.bits // dtype_bits)


def vector_isa(target: tvm.target.Target) -> VectorISA:
    """The vector ISA that code built for ``target`` runs with, from LLVM's features of its
    ``mcpu``/``mattr`` (TVM 0.27's ``llvm_get_vector_width`` answers 512 for every x86 target,
    so it is not asked). An x86 target without ``mcpu`` is generic x86-64: SSE2."""
    from tvm.target.codegen import target_has_features

    triple = target_triple(target) if "mtriple" in target.attrs else platform.machine()
    arch = machine_arch(triple)
    if arch == "aarch64":
        return VectorISA("neon", 128, 32)
    if arch != "x86_64":
        return VectorISA("scalar", 128, 16)

    def has(*features: str) -> bool:
        try:
            return bool(target_has_features(list(features), target))
        except Exception:  # an mcpu LLVM does not know
            return False

    if has("avx512f"):
        return VectorISA("avx512", 512, 32)
    if has("avx2", "fma"):
        return VectorISA("avx2", 256, 16)
    if has("avx"):
        return VectorISA("avx", 256, 16)
    return VectorISA("sse", 128, 16)


# an LLVM CPU name per vector ISA the host's flags show, for hosts LLVM cannot name (or names a
# CPU with features the host hides, as a VM may do with AVX-512): the oldest CPU that has them
_CPU_BY_FLAGS = (({"avx512f", "avx512bw", "avx512vl", "avx512dq"}, "skylake-avx512"),
                 ({"avx2", "fma", "bmi2"}, "haswell"), ({"avx"}, "sandybridge"),
                 ({"sse4_2"}, "nehalem"))


def host_target(num_cores: int | None = None) -> tvm.target.Target:
    """An llvm target for this machine: its CPU (vector features) and its core count.

    ``mcpu`` is LLVM's name for the host CPU (``llvm_get_system_cpu``), kept when /proc/cpuinfo
    has every instruction-set extension that name implies (``cpu_requirements``: a VM may hide
    AVX-512 from a CPU that has it); otherwise the oldest CPU with the ISA the flags show
    (``haswell`` for AVX2 + FMA) whose extensions are all there, so a build is never silently
    generic x86-64 and always runs where it was built. ``num-cores``: the cores this process
    may run on.

    >>> host_target(2)  # doctest: +SKIP
    {"kind":"llvm","mcpu":"znver4","num-cores":2,...}
    """
    from tvm.target.codegen import llvm_get_system_cpu

    spec: dict = {"kind": "llvm", "num-cores": int(num_cores or usable_cores())}
    cpu = llvm_get_system_cpu()
    flags = cpu_flags()
    def fits(mcpu: str) -> bool:  # every extension LLVM enables for it is in the flags
        needs = cpu_requirements(tvm.target.Target({"kind": "llvm", "mcpu": mcpu}))
        return not flags or all(X86_FEATURE_FLAGS.get(f, f) in flags for f in needs["features"])

    if cpu and cpu != "generic" and fits(cpu):
        spec["mcpu"] = cpu
    if "mcpu" not in spec and machine_arch(platform.machine()) == "x86_64":
        spec["mcpu"] = next((name for need, name in _CPU_BY_FLAGS
                             if need <= flags and fits(name)), "x86-64")
    return tvm.target.Target(spec)
