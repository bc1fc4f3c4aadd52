"""Automatic placement: the cheapest device per op within weight budgets, explained."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import hgrt
from hgrt.devices import parse_devices
from hgrt.frontend import import_model
from hgrt.relay_passes.place_devices import place_devices
from hgrt.relay_passes.util.context import BuildContext, Weights
from hgrt.testing import assert_close_to, reference, run_hgrt, zoo_input, zoo_model


@pytest.fixture(scope="module")
def squeezenet():
    return zoo_model("squeezenet")


def placed(model, devices, placement):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mod, weights = import_model(model, None, None)
    ctx = BuildContext(devices=parse_devices(devices), placement=placement)
    ctx.weights = Weights(dict(weights))
    place_devices(mod, ctx)
    return ctx.placed.report


def test_equal_devices_get_no_copies(squeezenet):
    report = placed(squeezenet, ["cpu:0", "cpu:1"], hgrt.Placement(auto=True))
    assert {r.device for r in report} == {"cpu:0"}
    assert all(r.reason.startswith("auto: ") and " vs " in r.reason for r in report)


def test_the_gpu_takes_the_heavy_kernels_and_says_why(squeezenet):
    report = placed(squeezenet, ["cpu:0", "cuda:0"], hgrt.Placement(auto=True))
    convs = [r for r in report if r.op == "relax.nn.conv2d"]
    assert convs and all(r.device == "cuda:0" for r in convs)
    assert "on cuda:0 vs" in convs[0].reason and "on cpu:0" in convs[0].reason


def test_a_budget_splits_the_model_in_few_places_and_rules_still_win(squeezenet):
    total = sum(np.asarray(v).nbytes for v in import_model(squeezenet, None, None)[1].values())
    report = placed(squeezenet, ["cpu:0", "cpu:1"],
                    hgrt.Placement(auto=True, budgets={"cpu:0": total // 2},
                                   rules={"nn.softmax": "cpu:0"}))
    devices = [r.device for r in report]
    assert set(devices) == {"cpu:0", "cpu:1"}
    switches = sum(1 for a, b in zip(devices, devices[1:], strict=False) if a != b)
    assert switches <= 10  # regions per device (the budget runs out late), not every other op
    soft = [r for r in report if r.op == "relax.nn.softmax"]
    assert soft and all(r.device == "cpu:0" and r.reason.startswith("rule") for r in soft)


def test_auto_build_runs_right(squeezenet):
    res = hgrt.build(squeezenet, ["cpu:0", "cpu:1"],
                     hgrt.Placement(auto=True, budgets={"cpu:0": 1 << 20}))
    x = zoo_input(squeezenet)
    assert_close_to(run_hgrt(res, x), reference(squeezenet, x))
    copies = sum(1 for n in res.graph.nodes if n.func_name == "__copy")
    conv_rule = hgrt.build(squeezenet, ["cpu:0", "cpu:1"],
                           hgrt.Placement(rules={"nn.conv2d": "cpu:1"}))
    assert copies < sum(1 for n in conv_rule.graph.nodes if n.func_name == "__copy")


def test_weights_that_fit_nowhere_are_a_build_error(squeezenet):
    with pytest.raises(hgrt.BuildError, match="no device can hold the weights"):
        placed(squeezenet, ["cpu:0"], hgrt.Placement(auto=True, budgets={"cpu:0": 1000}))


def test_a_measured_profile_drives_the_choice(squeezenet, tmp_path):
    """`hgrt profile --json` measures each device's rates; auto placement then believes them:
    told that cpu:1 runs convolutions 100x faster, it moves most of them there."""
    import json

    from hgrt.cli import main

    art = hgrt.save(str(tmp_path / "sq"), hgrt.build(squeezenet, ["cpu:0"], kernels="tvm"))
    rates_path = str(tmp_path / "rates.json")
    assert main(["profile", art, "--random-inputs", "--repeat", "2", "--json", rates_path]) == 0
    rates = json.load(open(rates_path))["rates"]
    assert rates["cpu:0"]["flops_per_s"] > 1e8 and rates["cpu:0"]["bytes_per_s"] > 1e6
    # a slow cpu:0 and a cpu:1 100x faster at convolutions: copies (µs) then cost little
    rates["cpu:0"]["flops_per_s"] = 1e8
    rates["cpu:1"] = {"flops_per_s": 1e10, "bytes_per_s": rates["cpu:0"]["bytes_per_s"]}
    json.dump({"rates": rates}, open(rates_path, "w"))
    report = placed(squeezenet, ["cpu:0", "cpu:1"],
                    hgrt.Placement(auto=True, profile=rates_path))
    convs = [r for r in report if r.op == "relax.nn.conv2d"]
    assert sum(r.device == "cpu:1" for r in convs) > len(convs) // 2
    with pytest.raises(hgrt.BuildError, match="cannot read the profile"):
        placed(squeezenet, ["cpu:0"], hgrt.Placement(auto=True, profile=str(tmp_path / "no")))


def test_squeezenet_on_cpu_and_cuda_stays_on_the_gpu_whole(squeezenet, caplog):
    """A split of light squeezenet costs more in copies than the CPU saves: the estimate keeps
    (nearly) every op on cuda:0, with at most a couple of copies."""
    import logging

    with warnings.catch_warnings(), caplog.at_level(logging.DEBUG, logger="hgrt.build"):
        warnings.simplefilter("ignore")
        res = hgrt.build(squeezenet, ["cpu:0", "cuda:0"], hgrt.Placement(auto=True))
    on_gpu = sum(r.device == "cuda:0" for r in res.placement_report)
    assert on_gpu >= 0.95 * len(res.placement_report)
    assert sum(1 for n in res.graph.nodes if n.func_name == "__copy") <= 2
    assert "-> cuda:0 only" in caplog.text
