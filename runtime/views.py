"""Tensor views at a byte offset that TVM kernels accept, and that survive RPC.

``Tensor._create_view`` records the offset in DLTensor.byte_offset, but kernels built by TVM
require byte_offset == 0, and TVM 0.27's RPC drops the byte_offset of a tensor returned to a
client (the client reads the bytes at offset 0). TVM's own memory manager instead moves the data
pointer on devices whose pointers allow arithmetic (CPU, CUDA, ROCm); hgrt does the same through
DLPack, in one of two ways:

- a kernel view (``own_base=False``) does not own its memory: the caller holds ``base`` as
  long as the view is used, next to the pools;
- an owning view holds a reference to ``base`` until its DLPack deleter runs, so it may be
  handed out (a server's output to its client) and outlive the module it came from.

Either owns its DLPack struct until TVM frees the view (the deleter), whatever order the
objects holding views are dropped in; a kernel view's is a C allocation that TVM frees.
"""

from __future__ import annotations

import ctypes
import threading

import tvm
import tvm_ffi

from hgrt import devices as hdev
from hgrt.errors import DeviceError


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


# A kernel view's DLPack struct and shape live in one C allocation that TVM frees itself when it
# frees the view (deleter: libc's free): no Python runs then, so a view freed in any order, or
# while the interpreter shuts down, is safe. (A Python deleter crashed at shutdown; the structs
# kept in the pools' list were read after that list was freed.)
_libc = ctypes.CDLL(None)
_libc.malloc.restype = ctypes.c_void_p
_libc.malloc.argtypes = [ctypes.c_size_t]
_FREE_PTR = ctypes.cast(_libc.free, ctypes.c_void_p).value

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class _Exporter:
    """A one-shot DLPack producer for ``tvm_ffi.from_dlpack``."""

    def __init__(self, capsule, device):
        self._capsule, self._device = capsule, device

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        return self._capsule

    def __dlpack_device__(self):
        return self._device


# What each view keeps alive, by the address of its DLManagedTensor; freed by the deleter.
_LIVE: dict[int, tuple] = {}
_LOCK = threading.Lock()


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _deleter(address: int) -> None:
    with _LOCK:
        _LIVE.pop(address, None)


_DELETER_PTR = ctypes.cast(_deleter, ctypes.c_void_p).value


def pointer_view(base, shape, dtype: str, byte_offset: int = 0, own_base: bool = True,
                 device=None):
    """A view of ``base``'s bytes from ``byte_offset`` on (counted from ``base``'s own data
    pointer), whose DLTensor has byte_offset 0 and a moved data pointer. ``own_base=False``: the
    caller keeps ``base`` alive as long as the view (a module's pools); else the view does. The
    view always owns its DLPack struct (freed by the deleter when TVM frees the view): a view
    outliving a list of structs kept beside it read a freed struct's deleter field (a pool
    dropped before the steps that hold its views crashed the process in 4 runs of 6).
    ``device``: the Device the view says it is on, where not ``base``'s (pinned CUDA host memory
    shown as the CPU whose pool it is: CPU kernels accept CPU tensors only)."""
    if byte_offset == 0 and not own_base and device is None:
        return base._create_view(tuple(shape), dtype, 0)
    dev = base.device
    dl_device = hdev.dlpack_device(dev if device is None else device)
    if not hdev.takes_offset_views(dev):
        if own_base and byte_offset == 0:
            return base  # hgrt places entries at offsets only on devices that take them
        raise DeviceError(f"{dev}: tensors at byte offsets (storage pools, concat pieces) need "
                          f"pointer arithmetic on the device; plan this graph without the "
                          f"'hgrt' pool section and without __concat views")
    t = tvm.runtime.DataType(str(dtype))
    shape = tuple(int(s) for s in shape)
    if own_base:
        managed = _DLManagedTensor()
        shape_arr = (ctypes.c_int64 * max(1, len(shape)))(*shape)
    else:  # one C block, struct then shape, that TVM's call of the deleter (free) releases
        head = ctypes.sizeof(_DLManagedTensor)
        block = _libc.malloc(head + 8 * max(1, len(shape)))
        if not block:
            raise MemoryError("cannot allocate a tensor view's DLPack struct")
        ctypes.memset(block, 0, head)
        managed = _DLManagedTensor.from_address(block)
        shape_arr = (ctypes.c_int64 * max(1, len(shape))).from_address(block + head)
        shape_arr[:len(shape)] = shape
    managed.dl_tensor.data = base.data_ptr() + byte_offset
    managed.dl_tensor.device = _DLDevice(*dl_device)
    managed.dl_tensor.ndim = len(shape)
    managed.dl_tensor.dtype = _DLDataType(t.type_code, t.bits, t.lanes)
    managed.dl_tensor.shape = shape_arr
    managed.dl_tensor.byte_offset = 0
    if own_base:  # the view holds base (and its struct) until its deleter runs
        managed.deleter = _DELETER_PTR
        with _LOCK:
            _LIVE[ctypes.addressof(managed)] = (managed, shape_arr, base)
    else:
        managed.deleter = _FREE_PTR
    capsule = _capsule_new(ctypes.addressof(managed), b"dltensor", None)
    return tvm_ffi.from_dlpack(_Exporter(capsule, dl_device))
