"""hgrt's C++ parts, compiled once per machine and loaded: the build they share.

``tvm_ffi.cpp`` compiles sources with g++ and ninja into ``<cache>/<name>-<hash>/<name>.so``;
the hash covers the sources, the headers they include and the flags, so a changed file builds
anew. The cache is ``HGRT_CACHE_DIR``, else ``~/.cache/hgrt``. Loading a library registers its
global functions (``hgrt.onednn.*``, ``hgrt.steps.*``).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import shutil
from collections.abc import Sequence
from pathlib import Path

import tvm_ffi

from hgrt.devices import cache_root  # (its one home: the links measured there too)


def ninja() -> str | None:
    found = shutil.which("ninja")
    if found:
        return found
    try:
        import ninja as wheel  # the `ninja` wheel
    except ImportError:
        return None
    path = Path(wheel.BIN_DIR) / "ninja"
    return str(path) if path.exists() else None


def missing_tools() -> str | None:
    """What is missing to compile hgrt's C++ parts here, or None."""
    if not shutil.which(os.environ.get("CXX", "g++")):
        return "no C++ compiler (g++)"
    if ninja() is None:
        return "no ninja"
    return None


def cache_dir(name: str, files: Sequence[Path], flags: Sequence[str]) -> Path:
    """Where ``name`` built from ``files`` (sources and the headers they include) with
    ``flags`` lives: a changed byte in any of them is another folder."""
    key = hashlib.sha256()
    for path in files:
        key.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    key.update("\0".join([*flags, tvm_ffi.__version__]).encode())
    if platform.machine() not in ("x86_64", "AMD64"):  # (x86-64 keeps the keys it had)
        key.update(platform.machine().encode())  # an emulated board shares the host's disk
    return cache_root() / f"{name.removeprefix('hgrt_')}-{key.hexdigest()[:16]}"


def build_and_load(name: str, sources: Sequence[Path], headers: Sequence[Path] = (),
                   cflags: Sequence[str] = ("-O2",), ldflags: Sequence[str] = (),
                   include: Sequence[str] = ()) -> tvm_ffi.Module:
    """``sources`` compiled into ``name``.so in the cache (once per content and flags), loaded."""
    build_dir = cache_dir(name, [*sources, *headers], [*include, *ldflags, *cflags])
    built = build_dir / f"{name}.so"
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        lock = open(build_dir / ".hgrt-lock", "w")  # noqa: SIM115 - held below
    except OSError:  # a cache this process may only read: what is there is whole
        if built.exists():
            return tvm_ffi.load_module(str(built))
        raise
    with lock:  # another process building the same: wait for it, never load a half-linked one
        fcntl.flock(lock, fcntl.LOCK_EX)
        _build_once(name, sources, built, build_dir, cflags, ldflags, include)
    return tvm_ffi.load_module(str(built))


def _build_once(name, sources, built: Path, build_dir: Path, cflags, ldflags, include) -> None:
    if not built.exists():
        found = ninja()
        if found and not shutil.which("ninja"):  # tvm_ffi runs `ninja` from PATH
            os.environ["PATH"] = f"{Path(found).parent}{os.pathsep}{os.environ['PATH']}"
        from tvm_ffi import cpp  # pulls in the build tooling only when something is built

        cpp.build(name, sources=[str(p) for p in sources], extra_cflags=list(cflags),
                  extra_ldflags=list(ldflags), extra_include_paths=list(include),
                  build_directory=str(build_dir))
