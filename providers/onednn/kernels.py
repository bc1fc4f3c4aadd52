"""oneDNN kernels for hgrt: the optional ``onednn`` extra (``pip install -e '.[onednn]'``).

The shim (``SOURCES``: ``onednn_shim.cc`` and the files ``onednn_shim.h`` lists) is compiled
once per machine with ``tvm_ffi.cpp`` (g++ and ninja) into one library in
``~/.cache/hgrt/onednn-<hash of sources, headers, flags, oneDNN paths>`` (``HGRT_CACHE_DIR``
moves the cache) and loaded. Loading registers global functions: ``hgrt.onednn.conv2d`` and
``hgrt.onednn.dense`` are the kernels that graph nodes name (the executor falls back to
global functions for names its library lacks, ``kernel_function``); ``hgrt.onednn.pack``
packs weights at build (``providers/onednn/blob.py`` defines the header,
``onednn_blob.h`` is generated from it).

>>> from hgrt.providers.onednn import kernels as onednn
>>> onednn.unavailable_reason() or onednn.isa()  # doctest: +SKIP
'avx512_core'

Threads: a kernel runs on as many OpenMP threads as the calling thread's TVM pool has (hgrt's
one thread budget, ``runtime/threads.py``, which also keeps TVM's idle pool workers from
spinning long against oneDNN's threads: ``hgrt.spin``).
"""

from __future__ import annotations

import functools
import importlib.metadata
from pathlib import Path

import numpy as np
import tvm
import tvm_ffi

from hgrt.providers.onednn import PROVIDER
from hgrt.runtime import native
from hgrt.runtime.dispatch import dispatch, on_dispatcher
from hgrt.runtime.native import cache_root
from hgrt.runtime.threads import process_threads, set_thread_count, use_all_cores

PREFIX = PROVIDER.func_prefix  # what its kernels' graph nodes call

__all__ = ["FUNCTIONS", "INSTALL_HINT", "blob_format", "cache_root", "forget", "implementation",
           "isa", "kernel_function", "layout_name", "load", "nhwc_tag", "pack",
           "unavailable_reason", "version"]

INSTALL_HINT = "pip install -e '.[onednn]'"
# what graph nodes call
FUNCTIONS = tuple(PREFIX + f for f in ("conv2d", "dense", "concat", "split", "pool", "shuffle",
                                           "lrn", "affine", "to_nchw", "layer_norm", "softmax",
                                           "matmul", "gate"))
# the shim: its sources, compiled into one library, and the headers they include (the key of
# the cache covers them all: a changed file rebuilds)
SOURCES = tuple(Path(__file__).with_name(f"onednn_{part}.cc")
                for part in ("shim", "primitives", "pack", "winograd", "layout", "rows",
                             "swish"))
HEADERS = tuple(Path(__file__).with_name(name) for name in ("onednn_shim.h", "onednn_blob.h"))
_WHEELS = ("onednn-cpu-gomp", "onednn-devel-cpu-gomp")  # libdnnl.so + libgomp; headers


@functools.cache
def _wheel_paths() -> tuple[str, str] | None:
    """(include dir, lib dir) of the oneDNN wheels, or None when they are not installed."""
    try:
        runtime = importlib.metadata.distribution(_WHEELS[0])
        devel = importlib.metadata.distribution(_WHEELS[1])
    except importlib.metadata.PackageNotFoundError:
        return None
    libs = [f for f in runtime.files or [] if f.name.startswith("libdnnl.so")]
    headers = [f for f in devel.files or [] if f.as_posix().endswith("oneapi/dnnl/dnnl.hpp")]
    if not libs or not headers:
        return None
    header = Path(devel.locate_file(headers[0])).resolve()
    return str(header.parents[2]), str(Path(runtime.locate_file(libs[0])).resolve().parent)


def unavailable_reason() -> str | None:
    """Why oneDNN kernels cannot run in this process, or None when they can."""
    reason = native.x86_64_linux_reason("oneDNN kernels")
    if reason is None and _wheel_paths() is None:
        reason = f"oneDNN not installed: {INSTALL_HINT}"
    if reason is not None or _shim.loaded:
        return reason
    return native.tools_reason("the oneDNN kernels", INSTALL_HINT)


def _build_and_load() -> tvm_ffi.Module:
    include, lib = _wheel_paths()  # type: ignore[misc]
    return native.build_and_load("hgrt_onednn", SOURCES, HEADERS, cflags=["-O2", "-fopenmp"],
                                 ldflags=[f"-L{lib}", f"-Wl,-rpath,{lib}", "-ldnnl", "-fopenmp"],
                                 include=[include])


# the kernels size their OpenMP team by the calling thread's TVM pool, and their first call
# starts that pool: TVM's pools get every usable core first, as ``create`` does (a pool started
# before keeps TVM's default size for good)
_shim = native.Shim("oneDNN kernels", lambda: unavailable_reason(), _build_and_load,
                    use_all_cores)  # (the reason looked up at load: tests replace it)


def load() -> tvm_ffi.Module:
    """The shim, compiled on first use on this machine and loaded once per process; raises
    ``GraphError`` saying why when oneDNN kernels cannot run here."""
    return _shim.load()


def kernel_function(name: str):
    """The global function ``name`` (oneDNN's kernels are loaded first when it names one of
    them), or None: what the executor binds when its library lacks ``name``."""
    if name.startswith(PREFIX):
        load()
    return tvm.get_global_func(name, allow_missing=True)


def forget(ranges: list[tuple[int, int]]) -> None:
    """Drop what the kernels cache for weights in the byte ranges ``[begin, end)`` (memory a
    module frees: its entries and any re-packed weights would otherwise stay until the caches
    fill); nothing to do where the shim was never loaded."""
    if _shim.loaded:
        f = tvm.get_global_func(PREFIX + "forget")
        for begin, end in ranges:
            f(begin, end)


def _call(name: str, *args):
    load()
    return tvm.get_global_func(PREFIX + name)(*args)


def pack(header: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """``weight`` (plain OIHW, or OI for dense; float32, or int8 where the header says the
    kernel computes in int8, ``bias`` then followed by the weights' scales per output channel)
    and ``bias`` packed for this machine behind ``header`` (int64 slots,
    ``onednn_blob.HEADER_SLOTS``): the blob a kernel node reads.
    Packed on a dispatcher, as kernels run: its OpenMP work never makes another thread an
    OpenMP master (``runtime/dispatch.py``)."""
    cpu = tvm.cpu(0)
    head = tvm.runtime.tensor(np.ascontiguousarray(header, dtype="int64"), cpu)
    w = tvm.runtime.tensor(np.ascontiguousarray(
        weight, "int8" if weight.dtype == np.int8 else "float32"), cpu)
    b = tvm.runtime.tensor(np.ascontiguousarray(bias, "float32"), cpu)
    n = process_threads()

    def job():
        set_thread_count(n)
        blob = tvm.runtime.empty((int(_call("packed_bytes", head)),), "uint8", cpu)
        _call("pack", head, w, b, blob)
        return blob

    return (job() if on_dispatcher() else dispatch(job, n)).numpy()


def implementation(blob: np.ndarray) -> str:
    """The implementation oneDNN runs for a packed blob here (``brg:avx512_core``, ...)."""
    return str(_call("implementation", tvm.runtime.tensor(blob, tvm.cpu(0))))


def layout_name(tag: int) -> str:
    """oneDNN's name of a layout tag (``nChw16c``); 0 is plain (``nchw``, or ``ab`` for 2-D)."""
    return str(_call("layout_name", int(tag))) if tag > 0 else "plain"


def nhwc_tag() -> int:
    """oneDNN's layout tag of NHWC activations (what a header's ``src_tag`` etc. hold)."""
    return int(_call("nhwc_tag"))


def blocked_tag() -> tuple[int, int]:
    """(block, oneDNN's layout tag) of the blocked layout its direct convolutions run here:
    16 channels a block on AVX-512 (nChw16c), 8 on AVX2 (nChw8c); (0, 0) on a lesser ISA."""
    block, tag = (int(v) for v in str(_call("blocked_tag")).split())
    return block, tag


def blob_format() -> dict[str, int]:
    """The blob header's format as the loaded shim was compiled with it, every number by name:
    what ``providers/onednn/blob.py``'s ``blob_format()`` says, when the two agree."""
    lines = str(_call("blob_format")).splitlines()
    return {name: int(value) for name, _, value in (line.partition("=") for line in lines)}


def isa() -> str:
    """The instruction set oneDNN's kernels use on this machine (``ONEDNN_MAX_CPU_ISA`` caps
    it), e.g. ``avx2`` or ``avx512_core``."""
    return str(_call("isa"))


def version() -> str:
    v = int(_call("version"))
    return f"{v // 10000}.{v // 100 % 100}.{v % 100}"
