"""What a copy between devices costs: measured once per machine for a local CUDA GPU and cached,
taken from a profile's ``links``, else the default; the build log says which."""

from __future__ import annotations

import json
import logging
import warnings

import pytest
import tvm

import hgrt
from hgrt.devices import DEFAULT_LINK, link_of
from hgrt.devices.links import cached_link, measure_link
from hgrt.runtime.native import cache_root
from hgrt.testing import zoo_model

HAS_GPU = tvm.cuda(0).exist


def test_without_a_gpu_the_default_stays():
    assert link_of("cpu:0") == DEFAULT_LINK
    if not HAS_GPU:
        assert link_of("cuda:0").source == "default"


def test_a_profile_names_the_link():
    link = link_of("cuda:0", {"cuda:0": {"latency_s": 1e-5, "bytes_per_s": 2e10}})
    assert (link.latency_s, link.bytes_per_s, link.source) == (1e-5, 2e10, "profile")


def test_measured_once_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HGRT_CACHE_DIR", str(tmp_path))
    assert cache_root() == tmp_path  # one cache directory for all of hgrt
    calls = []

    def measure():
        calls.append(1)
        return {"latency_s": 7e-6, "bytes_per_s": 2.5e10}

    first = cached_link("NVIDIA H100 80GB HBM3-cuda0", measure)
    second = cached_link("NVIDIA H100 80GB HBM3-cuda0", measure)
    assert (first.source, second.source, len(calls)) == ("measured", "cached", 1)
    assert first.seconds(1e6) == second.seconds(1e6) == pytest.approx(7e-6 + 4e-5)
    saved = json.loads(next((tmp_path / "links").glob("*.json")).read_text())
    assert saved["key"] == "NVIDIA H100 80GB HBM3-cuda0"


def test_the_measurement_fits_latency_and_bandwidth():
    """Host-to-host copies stand in for a GPU's here: the fit gives positive numbers."""
    got = measure_link(tvm.cpu(0), sizes=(4 << 10, 1 << 20), repeat=3)
    assert got["latency_s"] > 0 and got["bytes_per_s"] > 1e6
    assert len(got["h2d"]["seconds"]) == len(got["d2h"]["seconds"]) == 2


def test_the_build_log_says_which_link_was_used(caplog):
    with warnings.catch_warnings(), caplog.at_level(logging.DEBUG, logger="hgrt.build"):
        warnings.simplefilter("ignore")
        hgrt.build(zoo_model("squeezenet"), ["cpu:0", "cuda:0"], hgrt.Placement(auto=True))
    source = "default" if not HAS_GPU else ("measured", "cached")
    line = next(r.getMessage() for r in caplog.records
                if r.getMessage().startswith("auto: a copy costs cuda:0 <-> host"))
    assert any(f"({s})" in line for s in ([source] if isinstance(source, str) else source))
