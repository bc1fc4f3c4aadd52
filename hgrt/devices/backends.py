"""GPU backends on a runtime-only TVM: a deployment machine that runs what another machine
built needs no TVM compiler (``TVM_USE_RUNTIME_LIB=1``, or a TVM without
``libtvm_compiler.so``), but then ``import tvm`` loads no GPU backend, and TVM 0.27's CUDA
modules compile their source when loaded (``fmt == "cuda"``) through a hook whose default asks
the compiler for the current target. ``ensure_backend("cuda")`` loads the CUDA runtime library
that TVM ships (``tvm/lib/libtvm_runtime_cuda.so``, after the CUDA runtime of the
nvidia-cuda-runtime wheel where one is installed) and registers that hook with the GPU's own
architecture (NVRTC, or nvcc where ``TVM_CUDA_COMPILE_MODE=nvcc``). With TVM's compiler loaded
it does nothing: TVM loaded the backends itself. For every kind it loads TVM's runtime extras
(``libtvm_runtime_extra.so``: the sort and top-k functions CPU kernels call).
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import os
import threading

import tvm
import tvm_ffi

from hgrt.errors import DeviceError

__all__ = ["ensure_backend", "runtime_only"]

_lock = threading.Lock()
_done: set[str] = set()


def runtime_only() -> bool:
    """Whether this process's TVM is its runtime alone (no compiler)."""
    return bool(getattr(tvm.base, "_RUNTIME_ONLY", False))


def _preload_cudart() -> None:
    """The CUDA runtime of an installed nvidia-cuda-runtime wheel, loaded globally, so that
    TVM's CUDA library finds its ``libcudart.so`` outside the loader's default paths."""
    for name in ("nvidia-cuda-runtime", "nvidia-cuda-runtime-cu12"):
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        for f in dist.files or []:
            if f.name.startswith("libcudart.so."):
                ctypes.CDLL(str(dist.locate_file(f)), mode=ctypes.RTLD_GLOBAL)
                return


def _compile_hook(code: str) -> bytes:
    from tvm.support import nvcc

    major, minor = tvm.cuda(0).compute_version.split(".")
    arch = f"sm_{major}{minor}"
    if os.environ.get("TVM_CUDA_COMPILE_MODE", "nvrtc").lower() == "nvcc":
        return nvcc.compile_cuda(code, target_format="fatbin", arch=arch, compiler="nvcc")
    return nvcc.compile_cuda(code, target_format="cubin", arch=arch, compiler="nvrtc")


def _load_extra() -> None:
    """TVM's ``libtvm_runtime_extra.so``: the runtime's contrib functions (sort, topk, ...)
    that CPU kernels call, which ``import tvm`` loads only with its compiler."""
    if tvm.get_global_func("tvm.contrib.sort.topk", allow_missing=True) is not None:
        return
    path = os.path.join(os.path.dirname(tvm.__file__), "lib", "libtvm_runtime_extra.so")
    if os.path.exists(path):
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            raise DeviceError(f"TVM's runtime library {path} cannot be loaded on this "
                              f"runtime-only TVM: {e}") from e


def ensure_backend(kind: str) -> None:
    """Make ``kind``'s devices usable on a runtime-only TVM (see module doc); a DeviceError
    says what is missing."""
    if kind in _done or not runtime_only():
        return
    with _lock:
        if kind in _done:
            return
        if "extra" not in _done:
            _load_extra()
            _done.add("extra")
        if kind != "cuda":
            _done.add(kind)
            return
        if tvm.get_global_func("device_api.cuda", allow_missing=True) is None:
            path = os.path.join(os.path.dirname(tvm.__file__), "lib", "libtvm_runtime_cuda.so")
            try:
                _preload_cudart()
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError as e:
                raise DeviceError(f"cuda: TVM's CUDA runtime ({path}) cannot be loaded on this "
                                  f"runtime-only TVM: {e}") from e
        tvm_ffi.register_global_func("tvm_callback_cuda_compile", _compile_hook, override=True)
        _done.add(kind)
