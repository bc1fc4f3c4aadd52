"""The device vocabulary: one grammar, ``kind[:id]``, for every layer of hgrt.

``"cpu"``, ``"cpu:1"``, ``"cuda:0"``; ``"llvm"`` is another name of cpu and ``"gpu"`` of cuda.
Here a name becomes a build device (``DeviceSpec``: its TVM target and position in the device
list), a runtime device (``tvm.cpu(1)``, or a device of an RPC session), and every question
"is it a GPU / a CPU / remote / can a tensor at a byte offset be a view" is answered once: no
other module splits a device name or compares DLPack device types.

Four modules, every name importable from ``hgrt.devices``: ``identity`` (the kinds, the name
grammar, DLPack device types, kind predicates, runtime devices, ``DeviceSpec``), ``targets``
(the TVM target of each build device, ``parse_devices``), ``host_cpu`` (architectures, this
host's CPU and target, what built code needs of a CPU, vector ISAs) and ``links`` (what a copy
between devices costs, measured once per machine; hgrt's cache directory).

A device built for another machine than this one carries its target: ``targets={"cpu":
"raspberry-pi/4b-aarch64"}`` (a TVM target tag, a JSON/dict target or a ``Target``) for every
device of a kind, or ``device_spec("cpu:1", target)`` for one.

>>> split_device("gpu:1")
('cuda', 1)
>>> [d.name for d in parse_devices(["cpu", "cpu:1"])]  # doctest: +SKIP
['cpu:0', 'cpu:1']
>>> [d.name for d in parse_devices(["cpu:0", "cpu:1"],
...                                targets={"cpu": "raspberry-pi/4b-aarch64"})]  # doctest: +SKIP
['cpu:0', 'cpu:1']
"""

from hgrt.devices.host_cpu import (
    ARCHES,
    X86_FEATURE_FLAGS,
    VectorISA,
    check_runs_here,
    cpu_flags,
    cpu_requirements,
    host_target,
    is_host_triple,
    machine_arch,
    target_triple,
    usable_cores,
    vector_isa,
)
from hgrt.devices.identity import (
    ALIASES,
    KDL_CUDA_HOST,
    KDL_CUDA_MANAGED,
    KDL_ROCM_HOST,
    KINDS,
    DeviceSpec,
    Kind,
    canonical_name,
    device_list,
    device_name,
    dlpack_device,
    format_device,
    is_cpu,
    is_gpu,
    is_local_cpu,
    is_local_cuda,
    is_numpy_device,
    is_pinned_host,
    is_remote,
    kind_of,
    normalize_devices,
    pinned_host_device,
    resolve_device,
    resolve_dl_device,
    rpc_session_index,
    runtime_device,
    split_device,
    sync,
    takes_offset_views,
)
from hgrt.devices.links import DEFAULT_LINK, Link, cache_root, link_of
from hgrt.devices.targets import (
    DEFAULT_CUDA_ARCH,
    as_target,
    device_spec,
    device_target,
    kind_targets,
    parse_device,
    parse_devices,
    target_for,
)

__all__ = [
    "ALIASES", "ARCHES", "DEFAULT_CUDA_ARCH", "DEFAULT_LINK", "DeviceSpec", "KDL_CUDA_HOST",
    "KDL_CUDA_MANAGED", "KDL_ROCM_HOST", "KINDS", "Kind", "Link", "VectorISA", "X86_FEATURE_FLAGS",
    "as_target", "cache_root", "canonical_name", "check_runs_here", "cpu_flags",
    "cpu_requirements", "device_list", "device_name", "device_spec", "device_target",
    "dlpack_device", "format_device", "host_target", "is_cpu", "is_gpu", "is_host_triple",
    "is_local_cpu", "is_local_cuda", "is_numpy_device", "is_pinned_host",
    "is_remote", "kind_of", "kind_targets",
    "link_of", "machine_arch", "normalize_devices", "parse_device", "parse_devices",
    "pinned_host_device", "resolve_device",
    "resolve_dl_device", "rpc_session_index", "runtime_device", "split_device", "sync",
    "takes_offset_views", "target_for", "target_triple", "usable_cores", "vector_isa"
]
