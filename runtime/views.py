"""Tensor views at a byte offset that TVM kernels accept.

``Tensor._create_view`` records the offset in DLTensor.byte_offset, and kernels built by TVM
require byte_offset == 0. TVM's own memory manager instead moves the data pointer on devices
whose pointers allow arithmetic (CPU, CUDA, ROCm); hgrt does the same through DLPack.

The views made here do not own their memory, and the DLPack struct (its shape array) must outlive
them: the caller passes a ``keep`` list that it holds as long as the views, next to the pools.
They never leave the GraphModule; tensors handed to users are owning ``_create_view`` views.
"""

from __future__ import annotations

import ctypes

import tvm
import tvm_ffi

from hgrt.errors import DeviceError

# DLPack device types whose device pointers support arithmetic (CPU, CUDA, CUDA host, ROCm,
# CUDA managed, ROCm host).
POINTER_ARITHMETIC_DEVICES = {1, 2, 3, 10, 11, 13}


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


def pointer_view(base, shape, dtype: str, byte_offset: int, keep: list):
    """A view of ``base``'s bytes at ``byte_offset`` with byte_offset 0 and a moved data pointer.

    The caller must keep ``base`` and ``keep`` alive for as long as the view is used.
    """
    if byte_offset == 0:
        return base._create_view(tuple(shape), dtype, 0)
    dev = base.device
    dev_type = dev.dlpack_device_type()
    if dev_type not in POINTER_ARITHMETIC_DEVICES:
        raise DeviceError(f"{dev}: storage pools at byte offsets need pointer arithmetic on the "
                          f"device; plan this graph without the 'hgrt' pool section")
    t = tvm.runtime.DataType(dtype)
    shape = tuple(int(s) for s in shape)
    managed = _DLManagedTensor()
    shape_arr = (ctypes.c_int64 * max(1, len(shape)))(*shape)
    managed.dl_tensor.data = base.data_ptr() + byte_offset
    managed.dl_tensor.device = _DLDevice(dev_type, dev.index)
    managed.dl_tensor.ndim = len(shape)
    managed.dl_tensor.dtype = _DLDataType(t.type_code, t.bits, t.lanes)
    managed.dl_tensor.shape = shape_arr
    managed.dl_tensor.byte_offset = 0
    capsule = _capsule_new(ctypes.addressof(managed), b"dltensor", None)
    view = tvm_ffi.from_dlpack(_Exporter(capsule, (dev_type, dev.index)))
    keep.append((managed, shape_arr))  # the tensor points at these; no deleter frees them
    return view
