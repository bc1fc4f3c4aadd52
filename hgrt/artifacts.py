"""Artifacts on disk: ``graph.json`` + ``lib.so`` + ``params.bin`` in one directory (the format;
``hgrt.load`` in hgrt/api.py puts them onto devices)."""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import struct
import tarfile
import uuid
from collections.abc import Iterator, Mapping
from typing import Any, BinaryIO

import numpy as np
import tvm

from hgrt.devices import is_host_triple, machine_arch
from hgrt.errors import BuildError, GraphError, HgrtError, ParamError

GRAPH_FILE = "graph.json"
LIB_FILE = "lib.so"
PARAMS_FILE = "params.bin"
_LIST_MAGIC = 0xF7E58D4F05049CB7  # TVM's kTVMNDArrayListMagic: a save_param_dict blob
_TENSOR_MAGIC = 0xDD5E40F096B4A13F  # kTVMNDArrayMagic: one tensor in it
_TYPE_CODES = {0: "int", 1: "uint", 2: "float", 6: "bool"}  # DLPack type codes numpy holds


class ArtifactError(HgrtError, FileNotFoundError):
    """An artifact directory is missing a file or holds an unreadable one."""


def params_to_bytes(params: bytes | Mapping | None) -> bytes:
    """Params as TVM's ``save_param_dict`` bytes (numpy arrays and TVM tensors accepted)."""
    if params is None:
        return bytes(tvm.runtime.save_param_dict({}))
    if isinstance(params, (bytes, bytearray)):
        return bytes(params)
    if not isinstance(params, Mapping):
        raise ParamError(f"params must be bytes or a dict, got {type(params).__name__}")
    tensors = {}
    for name, value in params.items():
        if not isinstance(value, tvm.runtime.Tensor):
            # (not ascontiguousarray: it makes a 0-d weight 1-d)
            value = tvm.runtime.tensor(np.asarray(value, order="C"), tvm.cpu(0))
        tensors[name] = value
    return bytes(tvm.runtime.save_param_dict(tensors))


def save(directory: str, graph_json: Any, lib=None, params=None, *, cc: str | None = None) -> str:
    """Write ``graph.json``, ``lib.so`` and ``params.bin`` into ``directory``.

    ``graph_json`` may also be a build result (anything with ``graph_json``, ``lib`` and
    ``params`` attributes): ``hgrt.save("out/", hgrt.build(...))``.
    ``lib.so`` is linked for the machine its code is for: by this host's compiler, or for
    another architecture by the cross compiler its triple names (``aarch64-linux-gnu-g++``);
    ``cc`` names another compiler (on PATH, or a path). The three files are written into a
    temporary directory beside ``directory`` and moved there only once all are complete: a
    failed save leaves ``directory`` as it was.

    >>> hgrt.save("out/", hgrt.build(model, ["cpu:0", "cpu:1"],
    ...                              target={"cpu": "raspberry-pi/4b-aarch64"}))  # doctest: +SKIP
    """
    if hasattr(graph_json, "graph_json") and lib is None:
        art = graph_json
        graph_json, lib, params = art.graph_json, art.lib, art.params
    if lib is None:
        raise ArtifactError("save: no library given")
    fcompile = link_compiler(lib, cc)
    final = os.path.abspath(directory)
    os.makedirs(os.path.dirname(final), exist_ok=True)
    tmp = f"{os.path.dirname(final)}/.{os.path.basename(final)}.partial-{uuid.uuid4().hex[:8]}"
    os.mkdir(tmp)
    try:
        with open(os.path.join(tmp, GRAPH_FILE), "w") as f:
            f.write(graph_json if isinstance(graph_json, str) else graph_json.to_json())
        try:
            lib.export_library(os.path.join(tmp, LIB_FILE), fcompile=fcompile)
        except Exception as e:
            raise BuildError(f"save {directory}: linking {LIB_FILE} for "
                             f"{library_triple(lib) or 'this host'} failed: {e}") from e
        with open(os.path.join(tmp, PARAMS_FILE), "wb") as f:
            f.write(params_to_bytes(params))
        if not os.path.isdir(final):
            os.rename(tmp, final)  # the whole directory appears at once
        for name in (GRAPH_FILE, PARAMS_FILE, LIB_FILE):  # (left after a rename: none)
            if os.path.exists(os.path.join(tmp, name)):
                os.replace(os.path.join(tmp, name), os.path.join(final, name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


def library_triple(lib: tvm.runtime.Module) -> str | None:
    """The LLVM triple of a built library's host code (None: not known, this host's)."""
    try:
        if lib.kind != "llvm":
            return None
        return json.loads(lib.get_function("_get_target_string")()).get("mtriple") or None
    except Exception:  # not a module built here (a loaded .so), or no target string
        return None


def cross_compiler_name(triple: str) -> str:
    """Debian's name of the g++ that links for ``triple``: ``aarch64-unknown-linux-gnu`` ->
    ``aarch64-linux-gnu-g++``, ``armv8l-linux-gnueabihf`` -> ``arm-linux-gnueabihf-g++``."""
    parts = triple.split("-")
    if len(parts) == 4:  # arch-vendor-os-abi: Debian's names have no vendor
        del parts[1]
    if machine_arch(parts[0]) == "arm":
        parts[0] = "arm"
    return "-".join(parts) + "-g++"


def link_compiler(lib: tvm.runtime.Module, cc: str | None = None):
    """The ``fcompile`` that links ``lib``: None (TVM's default: this host's g++) for host
    code, else ``cc`` or the cross compiler of the library's triple, which must exist."""
    triple = library_triple(lib)
    if cc is None:
        if triple is None or is_host_triple(triple):
            return None
        cc = cross_compiler_name(triple)
        if shutil.which(cc) is None:
            raise BuildError(f"linking lib.so for {triple} needs the cross compiler {cc!r}, "
                             f"which is not installed (Debian/Ubuntu: apt-get install "
                             f"g++-{cc.removesuffix('-g++')}); or name one with cc= "
                             f"(`hgrt compile --cc`)")
    elif shutil.which(cc) is None:
        raise BuildError(f"the compiler {cc!r} given to link lib.so is not on PATH")
    return tvm.support.cc.cross_compiler(cc)


def paths(directory: str) -> dict[str, str]:
    """File name -> path of each artifact in ``directory``; an ArtifactError if one is missing."""
    found = {n: os.path.join(directory, n) for n in (GRAPH_FILE, LIB_FILE, PARAMS_FILE)}
    for name, path in found.items():
        if not os.path.exists(path):
            present = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
            raise ArtifactError(f"{directory!r} has no {name} (holds {present}); "
                                f"write one with hgrt.save or `hgrt compile`")
    return found


def read_graph_text(path: str) -> str:
    """The text of a graph JSON file; a ``GraphError`` naming it when it is not UTF-8."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise GraphError(f"{path}: not a graph JSON (not UTF-8 text: byte {e.start} is "
                         f"{raw[e.start]:#04x})") from None


def read(directory: str) -> tuple[str, str, bytes]:
    """``(graph_json, lib_path, params_bytes)`` of an artifact directory."""
    found = paths(directory)
    graph_json = read_graph_text(found[GRAPH_FILE])
    with open(found[PARAMS_FILE], "rb") as f:
        params = f.read()
    return graph_json, found[LIB_FILE], params


def iter_params(source: str | bytes | Mapping) -> Iterator[tuple[str, Any]]:
    """``(name, array)`` for each param, one at a time. ``source`` is a ``save_param_dict`` file
    (a path), read piecewise so that host memory holds one weight, not all of them; its bytes;
    or a dict (iterated as it is).

    >>> next(iter_params(params_to_bytes({"w": np.ones(2, "float32")})))
    ('w', array([1., 1.], dtype=float32))
    """
    if isinstance(source, Mapping):
        yield from source.items()
        return
    if isinstance(source, (bytes, bytearray)):
        yield from _read_params(io.BytesIO(source), "params blob")
        return
    with open(source, "rb") as f:
        yield from _read_params(f, repr(os.fspath(source)))


def _read_params(f: BinaryIO, where: str) -> Iterator[tuple[str, np.ndarray]]:
    # TVM's layout: list magic, reserved, the names (count, then length + bytes each), then the
    # tensors (count, then each: header, shape, byte count, data), all little-endian. Every
    # count and size is checked against the bytes left before it is used: a corrupt file is a
    # ParamError naming the record, never a huge allocation or a raw numpy/struct error.
    end = f.seek(0, io.SEEK_END)
    f.seek(0)

    def left() -> int:
        return end - f.tell()

    if end < 16:
        raise ParamError(f"{where} is not in TVM's save_param_dict format ({end} bytes: "
                         f"shorter than its header)")
    magic, _ = _unpack(f, "<QQ", where, "header")
    if magic != _LIST_MAGIC:
        raise ParamError(f"{where} is not in TVM's save_param_dict format (magic {magic:#x})")
    (count,) = _unpack(f, "<Q", where, "header")
    if count * 8 > left():
        raise ParamError(f"{where}: says {count} params, more than its {end} bytes can hold")
    names = []
    for i in range(count):
        (length,) = _unpack(f, "<Q", where, f"name {i}")
        if length > left():
            raise ParamError(f"{where} ends inside the name of param {i}: truncated")
        raw = f.read(length)
        try:
            names.append(raw.decode())
        except UnicodeDecodeError:
            raise ParamError(f"{where}: the name of param {i} is not UTF-8 text ({raw[:32]!r})"
                             ) from None
    if _unpack(f, "<Q", where, "header")[0] != count:
        raise ParamError(f"{where}: {count} names but another number of tensors")
    for name in names:
        head = _unpack(f, "<QQiiiBBH", where, name)
        magic, _, _, _, ndim, code, bits, lanes = head
        if magic != _TENSOR_MAGIC or not 0 <= ndim <= 32 or bits == 0 or lanes == 0:
            raise ParamError(f"{where}: param {name!r} has a header hgrt cannot read (magic "
                             f"{magic:#x}, dtype code {code}, {bits} bits, {lanes} lanes, "
                             f"{ndim} dims)")
        shape = _unpack(f, f"<{ndim}q", where, name)
        (nbytes,) = _unpack(f, "<Q", where, name)
        native = code in _TYPE_CODES and bits in (8, 16, 32, 64) and lanes == 1 \
            and (code != 6 or bits == 8)
        dtype = f"{_TYPE_CODES[code]}{bits if code != 6 else ''}" if native else \
            f"dtype code {code} of {bits} bits x {lanes}"
        expect = (math.prod(shape) * bits * lanes + 7) // 8  # sub-byte types are packed
        if min(shape, default=0) < 0 or expect != nbytes:
            raise ParamError(f"{where}: param {name!r} of shape {shape} and {dtype} records "
                             f"{nbytes} bytes of data, not {expect}")
        if nbytes > left():
            raise ParamError(f"{where}: param {name!r} {shape} is truncated ({left()} of its "
                             f"{nbytes} bytes are there)")
        if native:
            value = np.empty(shape, np.dtype(dtype))
            if f.readinto(value.reshape(-1).view(np.uint8)) != nbytes:
                raise ParamError(f"{where}: param {name!r} {shape} is truncated")
        else:  # bfloat16, float8, int4, vector lanes: TVM's reader, on this tensor alone
            value = _tvm_tensor(name, struct.pack("<QQiiiBBH", *head), shape, f.read(nbytes),
                                where)
        yield name, value
        del value  # before the next one is read: one weight in host memory at a time


def _tvm_tensor(name: str, head: bytes, shape: tuple, data: bytes, where: str) -> Any:
    """One tensor of a dtype numpy lacks, read by TVM from a blob of that tensor alone, whose
    sizes were checked above (TVM's reader checks none of them)."""
    blob = b"".join([struct.pack("<QQQ", _LIST_MAGIC, 0, 1), struct.pack("<Q", len(name.encode())),
                     name.encode(), struct.pack("<Q", 1), head,
                     struct.pack(f"<{len(shape)}q", *shape), struct.pack("<Q", len(data)), data])
    try:
        return tvm.runtime.load_param_dict(blob)[name]
    except Exception as e:
        raise ParamError(f"{where}: param {name!r}: TVM cannot read its dtype: {e}") from None


def _unpack(f: BinaryIO, fmt: str, where: str, what: str) -> tuple:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise ParamError(f"{where} ends inside the {what!r} record: truncated")
    return struct.unpack(fmt, data)


# ---- libraries: what an ELF file's header says ------------------------------------------------
# ELF machine codes, named as hgrt.devices.machine_arch names a machine's `uname -m`
_ELF_MACHINES = {3: "x86", 8: "mips", 20: "ppc", 21: "ppc64", 40: "arm", 62: "x86_64",
                 183: "aarch64", 243: "riscv", 258: "loongarch"}
# (class 1 = 32-bit, 2 = 64-bit): the header fields that place the program headers (e_phoff,
# e_phentsize, e_phnum), the section headers (e_shoff, e_shentsize, e_shnum), and in a program
# header its type, file offset and size in the file (p_type, p_offset, p_filesz)
_ELF_LAYOUT = {1: ("I", 28, 42, 44, 32, 46, 48, "I", 0, 4, 16),
               2: ("Q", 32, 54, 56, 40, 58, 60, "Q", 0, 8, 32)}
_PT_LOAD = 1


def elf_machine(head: bytes) -> str | None:
    """The architecture an ELF file is for, from its first 20 bytes; None if not ELF."""
    if len(head) < 20 or head[:4] != b"\x7fELF":
        return None
    order = "<" if head[5] == 1 else ">"
    code = struct.unpack(order + "H", head[18:20])[0]
    return _ELF_MACHINES.get(code, f"ELF machine {code}")


def library_machine(path: str) -> str | None:
    """The architecture a library is built for ('x86_64', 'aarch64', ...): from the ELF header
    of a .so, or of the objects in a .tar (``export_library("lib.tar")``, linked by the server).
    None when it cannot be told (not ELF: a .dylib, say)."""
    if tarfile.is_tarfile(path):
        with tarfile.open(path) as tar:
            for member in tar.getmembers():
                if member.isfile() and member.name.endswith(".o"):
                    f = tar.extractfile(member)
                    machine = elf_machine(f.read(20)) if f is not None else None
                    if machine is not None:
                        return machine
        return None
    with open(path, "rb") as f:
        return elf_machine(f.read(20))


def elf_end(path: str) -> int | None:
    """The least size an ELF file must have for what its headers place in it (its program and
    section header tables, and every loadable segment's bytes); None if it is not an ELF file
    of a class hgrt knows."""
    with open(path, "rb") as f:
        head = f.read(64)
        if len(head) < 5 or head[:4] != b"\x7fELF" or head[4] not in _ELF_LAYOUT:
            return None
        if len(head) < (52 if head[4] == 1 else 64):
            return 52 if head[4] == 1 else 64  # cut inside its own header
        (word, phoff_at, phentsize_at, phnum_at, shoff_at, shentsize_at, shnum_at,
         pword, ptype_at, poffset_at, pfilesz_at) = _ELF_LAYOUT[head[4]]
        order = "<" if head[5] == 1 else ">"

        def field(data: bytes, fmt: str, at: int) -> int:
            return struct.unpack_from(order + fmt, data, at)[0]

        phoff, shoff = field(head, word, phoff_at), field(head, word, shoff_at)
        phentsize, phnum = field(head, "H", phentsize_at), field(head, "H", phnum_at)
        if phnum == 0xFFFF:  # PN_XNUM: the count lives in section 0; the table end is enough
            phnum = 0
        end = max(phoff + phentsize * phnum,
                  shoff + field(head, "H", shentsize_at) * field(head, "H", shnum_at))
        f.seek(phoff)
        table = f.read(phentsize * phnum)
    for i in range(phnum if len(table) == phentsize * phnum else 0):
        entry = table[i * phentsize:(i + 1) * phentsize]
        if len(entry) > pfilesz_at and field(entry, "I", ptype_at) == _PT_LOAD:
            end = max(end, field(entry, pword, poffset_at) + field(entry, pword, pfilesz_at))
    return end


def check_library_file(path: str) -> None:
    """Refuse a library file cut short (a copy or download that stopped): the loader maps its
    segments as the headers say, and touching a page past the end of the file kills the
    process with SIGBUS, before any error could be raised."""
    if not os.path.isfile(path):
        raise ArtifactError(f"no library at {path!r}")
    try:
        need, size = elf_end(path), os.path.getsize(path)
    except (struct.error, OverflowError, ValueError) as e:  # sizes and offsets past reason
        raise ArtifactError(f"{path}: its ELF headers are corrupt ({e}); copy it again or "
                            f"rebuild it") from None
    if need is not None and size < need:
        raise ArtifactError(f"{path} is truncated: {size} bytes, but its ELF headers place "
                            f"data up to byte {need}; copy it again or rebuild it")


def load_library(path: str) -> tvm.runtime.Module:
    """Load a compiled library on this machine (checked first: a truncated file is an
    ``ArtifactError``, not a crash)."""
    check_library_file(path)
    try:
        return tvm.runtime.load_module(path)
    except Exception as e:
        raise ArtifactError(f"cannot load {path}: {e}") from e
