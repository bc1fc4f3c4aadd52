"""One placement decision per model: the per-op plan, each device alone and their refinements,
priced with their copies; the cheapest wins, and the build log says what was compared."""

from __future__ import annotations

import logging
import re
import warnings

import pytest

import hgrt
from hgrt.devices import parse_devices
from hgrt.frontend import import_model
from hgrt.relay_passes.inner.auto_plan import PlanModel, decide, refine, total
from hgrt.relay_passes.place_devices import place_devices
from hgrt.relay_passes.util.context import BuildContext, Weights
from hgrt.testing import zoo_model

NAMES = ["a", "b"]


def one_per_copy(nbytes: float, src: int, dst: int) -> float:
    return 1.0


def chain(saving: list[float]) -> PlanModel:
    """x -> op0 -> op1 -> ...: each op 5 s on a, ``5 - saving`` s on b; every copy 1 s."""
    m = PlanModel()
    m.nbytes["x"] = 4.0
    for i, s in enumerate(saving):
        m.add_op(f"op{i}", [(f"t{i}", 4.0)], ["x" if i == 0 else f"t{i - 1}"], [5.0, 5.0 - s],
                 [True, True], False, {})
    return m


def test_a_split_that_copies_more_than_it_saves_gives_way_to_one_device():
    m = chain([0.1] * 5)
    per_op = [1, 0, 1, 0, 1]  # every other op on the faster device: 4 copies for 0.3 s
    assert total(m, per_op, one_per_copy) == (pytest.approx(24.7 + 4), 4)
    best, line = decide(m, per_op, NAMES, one_per_copy, {})
    assert best.label == "b only" and best.copies == 0 and best.seconds == pytest.approx(24.5)
    assert line.startswith("auto: split 28700.000 ms (4 copies) vs b only 24500.000")
    assert line.endswith("-> b only")
    assert "a only 25000.000 ms (0 copies)" in line


def test_refinement_moves_a_run_back_only_when_copies_cost_more_than_it_saves():
    m = chain([0, 0, 0.5, 0, 0])
    assert refine(m, [0, 0, 1, 0, 0], one_per_copy, {}) == [0] * 5  # 0.5 s saved, 2 s copied
    m = chain([-2.0, -2.0, 3.0, 3.0, -2.0])  # b: 6 s faster at ops 2-3, slower at the rest
    assert refine(m, [0, 0, 1, 1, 0], one_per_copy, {}) == [0, 0, 1, 1, 0]


def test_ops_a_device_cannot_run_stay_off_it_in_its_plan():
    m = chain([0.1] * 3)
    m.allowed[1] = [True, False]
    best, line = decide(m, [0, 0, 0], NAMES, one_per_copy, {})
    assert best.assign[1] == 0 and "b only (+1 ops it cannot run)" in line


def test_a_plan_over_a_budget_is_not_chosen():
    m = chain([0.5] * 3)
    m.weights[1] = {"w": 100}
    best, line = decide(m, [0, 0, 0], NAMES, one_per_copy, {1: 10})
    assert best.assign[1] == 0 and "b only over a budget" in line


def _totals(line: str) -> tuple[dict[str, float], str]:
    body, _, chosen = line.removeprefix("auto: ").rpartition(" -> ")
    found = re.findall(r"(\S.*?) ([\d.]+) ms \(\d+ cop(?:y|ies)\)(?: vs |$)", body)
    return {label: float(ms) for label, ms in found}, chosen


def test_the_chosen_plan_is_the_cheapest_compared(caplog):
    """cpu:1 computes convolutions 100x faster but moves bytes 10x slower, and a copy to it
    costs 0.2 ms (a profile's ``links``): whatever is chosen costs no more than any other plan."""
    import json
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"rates": {"cpu:0": {"flops_per_s": 1e9, "bytes_per_s": 1e10},
                             "cpu:1": {"flops_per_s": 1e11, "bytes_per_s": 1e9}},
                   "links": {"cpu:1": {"latency_s": 2e-4, "bytes_per_s": 1e9}}}, f)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mod, weights = import_model(zoo_model("squeezenet"), None, None)
    ctx = BuildContext(devices=parse_devices(["cpu:0", "cpu:1"]),
                       placement=hgrt.Placement(auto=True, profile=f.name))
    ctx.weights = Weights(dict(weights))
    with caplog.at_level(logging.DEBUG, logger="hgrt.build"):
        place_devices(mod, ctx)
    assert "auto: a copy costs cpu:1 <-> host 200.0 us + 1.0 GB/s (profile)" in caplog.text
    line = next(r.getMessage() for r in caplog.records if " -> " in r.getMessage())
    totals, chosen = _totals(line)
    assert len(totals) >= 3 and chosen in totals
    assert totals[chosen] == min(totals.values())
    rows = ctx.placed.report
    assert all(r.reason.startswith("auto: ") and " vs " in r.reason for r in rows)
