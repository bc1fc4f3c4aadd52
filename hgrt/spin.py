"""How long idle workers spin before they sleep: TVM's pools and the OpenMP (libgomp) teams of
the kernel providers. Set here, with nothing imported before, because libgomp reads its
settings once, when it is loaded, and importing TVM loads it (TVM's FFI imports torch where it
is installed, and torch brings libgomp): ``hgrt/__init__`` imports this module first.

Each library reads its count once (TVM when its first pool starts); a value the user set wins.
Their defaults (300000 spins) let one library's idle workers hold the cores the other
library's next kernel needs; none at all makes every short kernel pay its workers' wake-up.
libgomp spins only its throttled count once more threads than cores are OpenMP masters (a
dispatcher, beside the process's first thread): under OMP_WAIT_POLICY=active that count is
1000, enough to bridge the few microseconds between two kernels of one call. The figures
behind these choices are in BENCHMARKS.md ("Spin counts").

Where libgomp was loaded before hgrt (torch imported first), its settings are its defaults:
``LOADED_BEFORE`` says so, and ``hgrt.runtime.threads`` logs it once; set ``GOMP_SPINCOUNT``
and ``OMP_WAIT_POLICY`` in the environment before Python starts to have them there too.
"""

from __future__ import annotations

import os

SPIN_COUNT = 10000
SETTINGS = {"TVM_THREAD_POOL_SPIN_COUNT": str(SPIN_COUNT), "GOMP_SPINCOUNT": str(SPIN_COUNT),
            "OMP_WAIT_POLICY": "active"}


def _libgomp_loaded() -> bool:
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            return any("libgomp" in line for line in maps)
    except OSError:  # no /proc (not Linux): unknown, taken as not loaded
        return False


# libgomp already loaded without the user's own settings: it runs with its defaults
LOADED_BEFORE = _libgomp_loaded() and not {"GOMP_SPINCOUNT", "OMP_WAIT_POLICY"} & set(os.environ)
for _name, _value in SETTINGS.items():
    os.environ.setdefault(_name, _value)
