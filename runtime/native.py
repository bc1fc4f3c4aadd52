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
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import tvm_ffi

from hgrt.devices import cache_root  # (its one home: the links measured there too)
from hgrt.errors import GraphError


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


def x86_64_linux_reason(what: str) -> str | None:
    """Why ``what`` (a shim of x86-64 Linux libraries) cannot run on this host, or None."""
    if sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64"):
        return None
    return f"{what} need x86-64 Linux, this is {sys.platform} {platform.machine()}"


def tools_reason(what: str, hint: str) -> str | None:
    """Why ``what`` cannot be compiled here (no g++ or ninja), with ``hint``; or None."""
    missing = missing_tools()
    return None if missing is None else f"{missing} to build {what} once: {hint}"


class Shim:
    """A provider's library, built on first use on this machine and loaded once per process.
    ``reason()`` says why it cannot be (None when it can), ``build()`` builds and loads it;
    ``prepare()``, if given, runs once before the build."""

    def __init__(self, title: str, reason: Callable[[], str | None],
                 build: Callable[[], tvm_ffi.Module],
                 prepare: Callable[[], object] | None = None) -> None:
        self.title, self._reason, self._build, self._prepare = title, reason, build, prepare
        self._lock = threading.Lock()
        self._module: tvm_ffi.Module | None = None

    @property
    def loaded(self) -> bool:
        return self._module is not None

    def load(self) -> tvm_ffi.Module:
        """The library; a ``GraphError`` says why it cannot be built or loaded here."""
        if self._module is not None:
            return self._module
        with self._lock:
            if self._module is None:
                reason = self._reason()
                if reason is not None:
                    raise GraphError(f"{reason}; or rebuild the model with kernels='tvm'")
                if self._prepare is not None:
                    self._prepare()
                try:
                    self._module = self._build()
                except Exception as e:
                    raise GraphError(f"could not build the {self.title}: {e}") from e
        return self._module


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
