"""Tensors the server hands to a client: owning, and with byte_offset 0.

TVM 0.27's RPC drops ``DLTensor.byte_offset`` of a tensor returned to the client: a view made
with ``Tensor._create_view(shape, dtype, offset)`` reads as the bytes at offset 0 once it is on
the client. A GraphModule's outputs live at byte offsets in its pools, so the server returns a
view whose data pointer is moved instead, and which owns a reference to the tensor it views
(through the DLPack deleter), so it stays valid even after the client drops the module.
"""

from __future__ import annotations

import ctypes
import threading

import tvm
import tvm_ffi

from hgrt.runtime.views import (
    POINTER_ARITHMETIC_DEVICES,
    _capsule_new,
    _DLDataType,
    _DLDevice,
    _DLManagedTensor,
    _Exporter,
)

# What each live view keeps alive, by the address of its DLManagedTensor; freed by the deleter.
_LIVE: dict[int, tuple] = {}
_LOCK = threading.Lock()


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _deleter(address: int) -> None:
    with _LOCK:
        _LIVE.pop(address, None)


_DELETER_PTR = ctypes.cast(_deleter, ctypes.c_void_p).value


def rpc_safe_view(t):
    """``t`` as a tensor whose byte_offset is 0 and which keeps ``t`` (and its buffer) alive."""
    dev = t.device
    dev_type = dev.dlpack_device_type()
    if dev_type not in POINTER_ARITHMETIC_DEVICES:
        return t  # hgrt only places entries at offsets on these devices
    shape = tuple(int(s) for s in t.shape)
    dtype = tvm.runtime.DataType(str(t.dtype))
    managed = _DLManagedTensor()
    shape_arr = (ctypes.c_int64 * max(1, len(shape)))(*shape)
    managed.dl_tensor.data = t.data_ptr()  # data + byte_offset
    managed.dl_tensor.device = _DLDevice(dev_type, dev.index)
    managed.dl_tensor.ndim = len(shape)
    managed.dl_tensor.dtype = _DLDataType(dtype.type_code, dtype.bits, dtype.lanes)
    managed.dl_tensor.shape = shape_arr
    managed.dl_tensor.byte_offset = 0
    managed.deleter = _DELETER_PTR
    address = ctypes.addressof(managed)
    with _LOCK:
        _LIVE[address] = (managed, shape_arr, t)
    capsule = _capsule_new(address, b"dltensor", None)
    return tvm_ffi.from_dlpack(_Exporter(capsule, (dev_type, dev.index)))
