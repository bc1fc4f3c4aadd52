"""cuBLAS / cuDNN kernels for hgrt: the optional ``cuda`` extra (``pip install -e '.[cuda]'``:
the nvidia-cublas, nvidia-cudnn-cu13 and nvidia-cuda-runtime wheels, which PyTorch's CUDA
builds install too).

The shim (``cudalibs_shim.cc``) is compiled once per machine with ``tvm_ffi.cpp`` (g++ and
ninja; no nvcc: it launches no kernel of its own) against the wheels' headers into
``~/.cache/hgrt/cudalibs-<hash>`` and loaded. Graph nodes name a kernel with its attributes
(``hgrt.cudalibs.conv2d_s1x1_p1x1_d1x1_g1_relu``, ``names.py``); ``kernel_function`` asks the
shim's ``hgrt.cudalibs.make`` for that kernel, parsed once per node.

>>> from hgrt.providers.cudalibs import kernels as cudalibs
>>> cudalibs.unavailable_reason() or cudalibs.versions()  # doctest: +SKIP
'cublasLt 131000, cudnn 92801, cudart 13050'
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import shutil
from pathlib import Path

import tvm
import tvm_ffi

from hgrt.errors import GraphError
from hgrt.providers.cudalibs import PROVIDER
from hgrt.runtime import native

PREFIX = PROVIDER.func_prefix

__all__ = ["INSTALL_HINT", "forget", "kernel_function", "load", "paths", "unavailable_reason",
           "versions"]

INSTALL_HINT = "pip install -e '.[cuda]'"
SOURCES = (Path(__file__).with_name("cudalibs_shim.cc"),)
# (distribution names, newest first; a header it holds; the library's file name prefix)
_PARTS = {
    "cublas": (("nvidia-cublas", "nvidia-cublas-cu12"), "cublasLt.h", "libcublasLt.so."),
    "cudnn": (("nvidia-cudnn-cu13", "nvidia-cudnn-cu12"), "cudnn.h", "libcudnn.so."),
    "cudart": (("nvidia-cuda-runtime", "nvidia-cuda-runtime-cu12"), "cuda_runtime_api.h",
               "libcudart.so."),
}


def _find(dists: tuple[str, ...], header: str, lib: str) -> tuple[str, str, str] | None:
    """(include dir, lib dir, library file name) from the first installed distribution that
    holds both ``header`` and a ``lib*`` shared library."""
    for name in dists:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        files = dist.files or []
        heads = [f for f in files if f.name == header]
        libs = [f for f in files if f.name.startswith(lib)]
        if heads and libs:
            so = Path(dist.locate_file(libs[0])).resolve()
            return str(Path(dist.locate_file(heads[0])).resolve().parent), str(so.parent), so.name
    return None


# headers the CUDA runtime's headers include, and the wheels that hold them where no toolkit
# is installed (nvidia-cuda-runtime's own folder lacks them)
_CUDA_HEADERS = {"crt/host_defines.h": "nvidia-cuda-crt", "nv/target": "nvidia-cuda-cccl"}


def _cuda_includes(beside: str) -> list[str] | None:
    """Folders that hold what the CUDA runtime's headers include (``crt/``, ``nv/target``):
    beside them, the nvidia-cuda-crt / nvidia-cuda-cccl wheels, or the CUDA toolkit's
    (CUDA_HOME, nvcc's, /usr/local/cuda); None when one is missing."""
    nvcc = shutil.which("nvcc")
    roots = [os.environ.get("CUDA_HOME", ""), str(Path(nvcc).resolve().parents[1]) if nvcc else "",
             "/usr/local/cuda"]
    toolkit = [os.path.join(r, "include") for r in roots if r]
    found = []
    for header, wheel in _CUDA_HEADERS.items():
        candidates = [beside]
        try:
            dist = importlib.metadata.distribution(wheel)
            candidates += [str(Path(dist.locate_file(f)).resolve().parents[header.count("/")])
                           for f in dist.files or [] if f.as_posix().endswith("include/" + header)]
        except importlib.metadata.PackageNotFoundError:
            pass
        where = next((c for c in candidates + toolkit
                      if os.path.exists(os.path.join(c, header))), None)
        if where is None:
            return None
        found.append(where)
    return found


@functools.cache
def paths() -> dict[str, tuple[str, str, str]] | None:
    """{part: (include dir, lib dir, library)} for cuBLASLt, cuDNN and the CUDA runtime, and
    the folders of the headers these include, or None when a part is missing."""
    found = {part: _find(*spec) for part, spec in _PARTS.items()}
    if any(v is None for v in found.values()):
        return None
    more = _cuda_includes(found["cudart"][0])  # type: ignore[index]
    if more is None:
        return None
    return {**found, **{f"include{i}": (inc, "", "") for i, inc in enumerate(more)}}


def unavailable_reason() -> str | None:
    """Why cuBLAS/cuDNN kernels cannot be built in this process, or None when they can (a GPU
    is not needed to build them; a kernel says so when it runs without one)."""
    reason = native.x86_64_linux_reason("cuBLAS/cuDNN kernels")
    if reason is None and paths() is None:
        missing = [p for p, spec in _PARTS.items() if _find(*spec) is None] or \
            ["the CUDA headers' crt/ and nv/ (nvidia-cuda-crt, nvidia-cuda-cccl)"]
        reason = f"{', '.join(missing)} not installed: {INSTALL_HINT}"
    if reason is not None or _shim.loaded:
        return reason
    return native.tools_reason("the cuBLAS/cuDNN kernels", INSTALL_HINT)


def _build_and_load() -> tvm_ffi.Module:
    found = paths()
    assert found is not None
    include = [inc for inc, _, _ in found.values()]
    ldflags = []
    for _, lib, so in found.values():
        if so:
            ldflags += [f"-L{lib}", f"-Wl,-rpath,{lib}", f"-l:{so}"]
    return native.build_and_load("hgrt_cudalibs", SOURCES, (),
                                 cflags=["-O2", "-Wno-deprecated-declarations"],
                                 ldflags=ldflags, include=list(dict.fromkeys(include)))


_shim = native.Shim("cuBLAS/cuDNN kernels", lambda: unavailable_reason(), _build_and_load)


def load() -> tvm_ffi.Module:
    """The shim, compiled on first use on this machine and loaded once per process; raises
    ``GraphError`` saying why when it cannot be."""
    return _shim.load()


def kernel_function(name: str):
    """The kernel a graph node names (``hgrt.cudalibs.<kind>_<attrs>``), made by the shim for
    that node; a GraphError names the attribute the shim does not know."""
    load()
    try:
        return tvm.get_global_func(PREFIX + "make")(name)
    except Exception as e:  # noqa: BLE001 - the shim's message names the attribute
        raise GraphError(f"graph node function {name!r}: {e}") from e


def parse(name: str) -> str:
    """What the shim reads from a kernel's name (the attributes it will compute with)."""
    load()
    return str(tvm.get_global_func(PREFIX + "parse")(name))


def versions() -> str:
    """The versions of cuBLASLt, cuDNN and the CUDA runtime the shim was linked with."""
    load()
    return str(tvm.get_global_func(PREFIX + "versions")())


def forget(ranges: list[tuple[int, int]]) -> None:
    """Nothing is cached about memory a module frees (plans are per shape, not per buffer)."""
    del ranges
