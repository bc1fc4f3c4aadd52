"""The CPU pools that copies to and from a CUDA GPU read and write are allocated in pinned host
memory (``pinned_pools``), their views shown as the CPU they belong to. Which pools: build
level, no GPU needed; the allocation itself where a GPU is."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import tvm

import hgrt
from hgrt.runtime.pools import pinned_pools
from hgrt.runtime.views import pointer_view

sys.path.insert(0, str(Path(__file__).parents[1] / "relay_passes"))
from test_overlap_order import build, model  # noqa: E402

HAS_GPU = tvm.cuda(0).exist
DEVICES = ["cpu:0", "cuda:0"]


def test_the_cpu_pool_that_copies_reach_a_gpu_from_is_pinned(monkeypatch):
    graph = build(["cpu:0", "cuda:0"]).graph
    assert pinned_pools(graph, [tvm.cpu(0), tvm.cuda(0)]) == {0}
    monkeypatch.setenv("HGRT_PIN_HOST", "0")
    assert pinned_pools(graph, [tvm.cpu(0), tvm.cuda(0)]) == frozenset()


def test_copies_between_cpus_pin_nothing():
    graph = build(["cpu:0", "cpu:1"]).graph
    assert pinned_pools(graph, [tvm.cpu(0), tvm.cpu(1)]) == frozenset()


def test_a_view_shown_as_another_device_keeps_the_bytes():
    base = tvm.runtime.tensor(np.arange(16, dtype="float32"))
    view = pointer_view(base, (4,), "float32", 16, own_base=False, device=tvm.cpu(1))
    assert view.device == tvm.cpu(1)
    assert view.data_ptr() == base.data_ptr() + 16
    owned = pointer_view(base, (2, 2), "float32", 32, device=tvm.cpu(0))
    np.testing.assert_array_equal(np.from_dlpack(owned), [[8, 9], [10, 11]])


@pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU here")
def test_on_a_gpu_the_pool_is_pinned_and_the_outputs_right():
    result = build(["cpu:0", "cuda:0"])
    module = hgrt.create(result.graph_json, result.lib, [tvm.cpu(0), tvm.cuda(0)])
    module.load_params(result.params)
    arenas = [b for b in module._storage.buffers if hasattr(b, "device")]
    assert any(hgrt.devices.is_pinned_host(b) for b in arenas)
    x = np.random.default_rng(1).standard_normal((4, 64)).astype("float32")
    module.set_input("x", x)
    module.set_input("s", x)
    module.run()
    np.testing.assert_allclose(module.get_output(1).numpy(), np.tanh(x), rtol=1e-5)


def test_a_copy_to_the_gpu_that_would_wait_for_unrelated_gpu_work_keeps_its_pool_pageable():
    def pinned(tanh_of: str) -> frozenset[int]:
        graph = build(DEVICES, model(tanh_of=tanh_of, rejoin=True)).graph
        return pinned_pools(graph, [tvm.cpu(0), tvm.cuda(0)])

    # the tanh reads the GPU's result: the copy back to the GPU waits for nothing more
    assert pinned("y") == {0}
    # the tanh of s runs while the GPU computes the exps: pinned, its copy would wait for them
    assert pinned("s") == frozenset()
