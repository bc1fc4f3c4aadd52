"""The spin settings of TVM's pools and of libgomp are in the environment before libgomp is
loaded (it reads them once, then): importing hgrt first sets them before TVM, whose FFI loads
torch and with it libgomp where torch is installed; imported after, hgrt says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SETTINGS = ("TVM_THREAD_POOL_SPIN_COUNT", "GOMP_SPINCOUNT", "OMP_WAIT_POLICY")
PROBE = """
import json, os, sys
{first}
import hgrt
from hgrt.runtime import threads
maps = open("/proc/self/maps").read()
print(json.dumps({{"gomp": "libgomp" in maps, "before": hgrt.spin.LOADED_BEFORE,
                   "env": {{k: os.environ.get(k) for k in {settings!r}}}}}))
"""


def _probe(first: str = "", **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in SETTINGS}
    out = subprocess.run([sys.executable, "-c", PROBE.format(first=first, settings=SETTINGS)],
                         env={**clean, **env}, capture_output=True, text=True, timeout=120,
                         check=True)
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "stderr": out.stderr}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_importing_hgrt_sets_the_spin_counts_before_libgomp_loads():
    got = _probe(TVM_THREAD_POOL_SPIN_COUNT="123")  # a value the user set wins
    assert got["env"] == {"TVM_THREAD_POOL_SPIN_COUNT": "123", "GOMP_SPINCOUNT": "10000",
                          "OMP_WAIT_POLICY": "active"}
    assert got["before"] is False and "libgomp was loaded before hgrt" not in got["stderr"]


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_libgomp_loaded_before_hgrt_is_said():
    pytest.importorskip("torch")
    got = _probe("import torch")
    if not got["gomp"]:
        pytest.skip("this torch brings no libgomp")
    assert got["before"] is True and "libgomp was loaded before hgrt" in got["stderr"]
    assert not _probe("import torch", GOMP_SPINCOUNT="10000")["before"]  # the user's settings
