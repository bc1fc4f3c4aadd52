"""An emulated aarch64 board on an x86-64 Debian machine, made from packages only.

    python python/board_aarch64.py prepare            # idempotent; prints how to run the board
    python python/board_aarch64.py prepare --json     # the same as JSON (what the tests read)
    python python/board_aarch64.py python -m hgrt.cli rpc-server --tracker 127.0.0.1:9190 --key pi

``prepare`` (as root; each step is skipped when already done, the downloads are cached in
``~/.cache/hgrt/aarch64`` or ``$HGRT_BOARD_CACHE``):

1. ``apt-get install qemu-user-static gcc-aarch64-linux-gnu g++-aarch64-linux-gnu``: qemu user
   mode, and the cross compiler that ``hgrt.save`` links aarch64 libraries with;
2. registers the qemu-aarch64 binfmt handler (from ``/usr/lib/binfmt.d/qemu-aarch64.conf``), so
   that an aarch64 program, and every child it starts, runs under qemu;
3. ``dpkg --add-architecture arm64``, then ``apt-get download`` CPython 3.11 and its libraries
   for arm64 and unpacks them with ``dpkg -x`` into ``root/`` (nothing arm64 gets installed);
4. ``pip install --target site/`` the aarch64 wheels of TVM, tvm-ffi, numpy, cloudpickle, psutil;
5. installs this checkout's hgrt (pure Python) into ``hgrt-<hash>/``, again when the source changes.

``python ARGS`` runs the board's CPython (under qemu) with ``QEMU_LD_PREFIX=root/``,
``PYTHONPATH=hgrt-<hash>/:site/`` and the cache directory as working directory (from the
checkout, Python would import the x86 checkout's ``hgrt/`` instead). It replaces this process
(exec), so its PID is the board program's. Exit status 3 with one line: the board cannot be
made here (not x86-64 Linux, no apt, not root, no binfmt_misc).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass

CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOST_PACKAGES = {"qemu-aarch64-static": "qemu-user-static",
                 "aarch64-linux-gnu-gcc": "gcc-aarch64-linux-gnu",
                 "aarch64-linux-gnu-g++": "g++-aarch64-linux-gnu"}
PYTHON_PACKAGES = ["python3.11-minimal:arm64", "libpython3.11-stdlib:arm64", "libstdc++6:arm64"]
NOT_UNPACKED = ("dpkg:", "tar:", "install-info:")  # tools among the dependencies, not needed
WHEELS = ["apache-tvm==0.27.0.post1", "apache-tvm-ffi==0.1.14.post1", "numpy", "cloudpickle",
          "psutil", "ml_dtypes", "typing_extensions"]
HGRT_SOURCES = ["pyproject.toml", "README.md", "hgrt", "relay_passes", "runtime", "rpc"]
BINFMT = "/proc/sys/fs/binfmt_misc"
BINFMT_CONF = "/usr/lib/binfmt.d/qemu-aarch64.conf"
UNAVAILABLE = 3  # exit status: the board cannot be made on this machine


class Unavailable(Exception):
    """The board cannot be made here; the message says why, in one line."""


@dataclass
class Board:
    """Where the prepared board lives and how to start its Python."""

    cache: str
    root: str  # the unpacked arm64 root: QEMU_LD_PREFIX
    python: str  # the arm64 CPython binary (runs through binfmt + qemu)
    pythonpath: str
    compiler: str  # the cross compiler hgrt.save picks for aarch64-linux-gnu

    def env(self) -> dict[str, str]:
        return {"QEMU_LD_PREFIX": self.root, "PYTHONPATH": self.pythonpath,
                "PYTHONNOUSERSITE": "1", "PYTHONUNBUFFERED": "1"}


def default_cache() -> str:
    return os.environ.get("HGRT_BOARD_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "hgrt", "aarch64")


def _run(cmd: list[str], what: str, **kw) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise Unavailable(f"{what} failed ({' '.join(cmd[:4])} ...): {' | '.join(tail)}")
    return proc.stdout


def _log(msg: str) -> None:
    print(f"board: {msg}", file=sys.stderr, flush=True)


def check_host() -> None:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise Unavailable(f"an emulated aarch64 board needs an x86-64 Linux host, this is "
                          f"{platform.system()} {platform.machine()}")
    if shutil.which("apt-get") is None or shutil.which("dpkg") is None:
        raise Unavailable("no apt-get/dpkg here (the board is made from Debian packages)")


def _need_root(what: str) -> None:
    if os.geteuid() != 0:
        raise Unavailable(f"{what} needs root (run `sudo python python/board_aarch64.py "
                          f"prepare` once)")


def install_host_packages() -> None:
    missing = [pkg for tool, pkg in HOST_PACKAGES.items() if shutil.which(tool) is None]
    if not os.path.exists(BINFMT_CONF) and "qemu-user-static" not in missing:
        missing.append("qemu-user-static")
    if not missing:
        return
    _need_root(f"apt-get install {' '.join(missing)}")
    _log(f"apt-get install {' '.join(missing)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    _run(["apt-get", "update"], "apt-get update", env=env)
    _run(["apt-get", "install", "-y", "--no-install-recommends", *missing],
         "apt-get install", env=env)


def register_binfmt() -> None:
    """Register qemu-aarch64 with the kernel's binfmt_misc (mounting it if needed)."""
    entry = os.path.join(BINFMT, "qemu-aarch64")
    if os.path.exists(entry):
        with open(entry) as f:
            if f.readline().strip() == "enabled":
                return
        raise Unavailable(f"{entry} is registered but disabled (echo 1 > {entry})")
    _need_root("registering the qemu-aarch64 binfmt handler")
    if not os.path.exists(os.path.join(BINFMT, "register")):
        _run(["mount", "-t", "binfmt_misc", "binfmt_misc", BINFMT], "mounting binfmt_misc")
    with open(BINFMT_CONF) as f:
        line = next(ln.strip() for ln in f if ln.strip() and not ln.startswith("#"))
    _log(f"registering {line.split(':')[1]} with binfmt_misc")
    try:
        with open(os.path.join(BINFMT, "register"), "w") as f:
            f.write(line)
    except OSError as e:
        raise Unavailable(f"cannot register the qemu-aarch64 binfmt handler: {e}") from e


def _stamp(directory: str, key: str) -> str:
    return os.path.join(directory, f".done-{hashlib.sha256(key.encode()).hexdigest()[:16]}")


def unpack_python(cache: str) -> str:
    """The arm64 CPython 3.11 and its libraries, unpacked into ``cache/root``."""
    root = os.path.join(cache, "root")
    recipe = " ".join([*PYTHON_PACKAGES, *NOT_UNPACKED])
    if os.path.exists(_stamp(root, recipe)):
        return root
    if "arm64" not in _run(["dpkg", "--print-foreign-architectures"], "dpkg").split():
        _need_root("adding the arm64 architecture to dpkg")
        _log("dpkg --add-architecture arm64 && apt-get update")
        _run(["dpkg", "--add-architecture", "arm64"], "dpkg --add-architecture arm64")
        _run(["apt-get", "update"], "apt-get update")
    deps = _run(["apt-cache", "depends", "--recurse", "--no-recommends", "--no-suggests",
                 "--no-conflicts", "--no-breaks", "--no-replaces", "--no-enhances",
                 *PYTHON_PACKAGES], "apt-cache depends")
    names = sorted({ln for ln in deps.splitlines() if ln.endswith(":arm64")
                    and not ln.startswith((" ", "<", *NOT_UNPACKED))})
    debs = os.path.join(cache, "debs")
    os.makedirs(debs, exist_ok=True)
    _log(f"apt-get download {len(names)} arm64 packages -> {debs}")
    _run(["apt-get", "download", *names], "apt-get download", cwd=debs)
    tmp = tempfile.mkdtemp(prefix="root-", dir=cache)
    for deb in sorted(os.listdir(debs)):
        if deb.endswith(".deb"):
            _run(["dpkg", "-x", os.path.join(debs, deb), tmp], f"dpkg -x {deb}")
    _replace(tmp, root)
    open(_stamp(root, recipe), "w").close()
    return root


def _replace(tmp: str, final: str) -> None:
    """Move a finished directory into place (an unfinished one is never seen there)."""
    if os.path.exists(final):
        shutil.rmtree(final)
    os.rename(tmp, final)


def install_wheels(cache: str) -> str:
    site = os.path.join(cache, "site")
    if os.path.exists(_stamp(site, " ".join(WHEELS))):
        return site
    tmp = tempfile.mkdtemp(prefix="site-", dir=cache)
    _log(f"pip install --target {site} (aarch64 wheels): {' '.join(WHEELS)}")
    _run([sys.executable, "-m", "pip", "install", "--quiet", "--target", tmp, "--no-compile",
          "--platform", "manylinux_2_28_aarch64", "--platform", "manylinux2014_aarch64",
          "--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp",
          *WHEELS], "pip install (aarch64 wheels)")
    _replace(tmp, site)
    open(_stamp(site, " ".join(WHEELS)), "w").close()
    return site


def _source_hash() -> str:
    h = hashlib.sha256()
    for top in HGRT_SOURCES:
        path = os.path.join(CHECKOUT, top)
        files = [path] if os.path.isfile(path) else sorted(
            os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f.endswith(".py"))
        for f in files:
            h.update(os.path.relpath(f, CHECKOUT).encode())
            with open(f, "rb") as fh:
                h.update(fh.read())
    return h.hexdigest()[:12]


def install_hgrt(cache: str) -> str:
    """This checkout's hgrt, installed for the board (pure Python: no aarch64 build needed)."""
    final = os.path.join(cache, f"hgrt-{_source_hash()}")
    if os.path.isdir(final):
        return final
    for old in os.listdir(cache):  # earlier versions of the source
        if old.startswith("hgrt-"):
            shutil.rmtree(os.path.join(cache, old), ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="hgrt-src-") as src:
        for top in HGRT_SOURCES:  # a copy: pip would build inside the checkout
            path = os.path.join(CHECKOUT, top)
            if os.path.isdir(path):
                shutil.copytree(path, os.path.join(src, top),
                                ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy(path, src)
        tmp = tempfile.mkdtemp(prefix="tmp-hgrt-", dir=cache)
        _log(f"pip install --no-deps --target {final} (hgrt from {CHECKOUT})")
        _run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile",
              "--target", tmp, src], "pip install hgrt")
    os.rename(tmp, final)
    return final


def prepare(cache: str | None = None) -> Board:
    """Make (or find) the board; raises ``Unavailable`` with the reason it cannot be made."""
    cache = os.path.abspath(cache or default_cache())
    check_host()
    install_host_packages()
    register_binfmt()
    os.makedirs(cache, exist_ok=True)
    root = unpack_python(cache)
    site = install_wheels(cache)
    hgrt_dir = install_hgrt(cache)
    board = Board(cache, root, os.path.join(root, "usr", "bin", "python3.11"),
                  os.pathsep.join([hgrt_dir, site]), shutil.which("aarch64-linux-gnu-g++") or "")
    out = _run([board.python, "-c", "import platform; print(platform.machine())"],
               "starting the arm64 python", env={**os.environ, **board.env()}, cwd=cache)
    if out.strip() != "aarch64":
        raise Unavailable(f"the board's python says it runs on {out.strip()!r}, not aarch64")
    return board


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", default=None, help=f"default {default_cache()}")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="make the board (idempotent)")
    p.add_argument("--json", action="store_true", help="print the board as JSON")
    sub.add_parser("python", help="run the board's python with the arguments that follow (exec)")
    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("python") + 1 if "python" in argv else len(argv)
    args, rest = ap.parse_args(argv[:cut]), argv[cut:]
    try:
        board = prepare(args.cache)
    except Unavailable as e:
        print(f"board unavailable: {e}", file=sys.stderr)
        return UNAVAILABLE
    if args.command == "python":
        os.chdir(board.cache)
        os.execve(board.python, [board.python, *rest], {**os.environ, **board.env()})
    if args.json:
        print(json.dumps({**asdict(board), "env": board.env()}))
    else:
        env = " ".join(f"{k}={v}" for k, v in board.env().items() if k != "PYTHONUNBUFFERED")
        print(f"aarch64 board ready in {board.cache}\nrun its python with:\n  cd {board.cache} "
              f"&& {env} {board.python} -m hgrt.cli rpc-server ...\ncross compiler: "
              f"{board.compiler}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
