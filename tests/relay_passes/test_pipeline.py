"""run_passes names the broken pass and what ran before it; verify mode checks the IR."""

from __future__ import annotations

import pytest
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from hgrt.errors import BuildError, PlanError
from hgrt.relay_passes import run_passes


@I.ir_module
class Mod:
    @R.function
    def main(x: R.Tensor((4,), "float32")):
        with R.dataflow():
            y = R.add(x, x)
            R.output(y)
        return y


def ok(mod, ctx):
    return mod


def boom(mod, ctx):
    raise RuntimeError("kaput")


def plan_boom(mod, ctx):
    raise PlanError("overlap")


def test_failure_names_pass_and_history():
    with pytest.raises(BuildError, match=r"^'second' failed after \['first'\]: kaput"):
        run_passes(Mod, None, [("first", ok), ("second", boom), ("third", ok)])


def test_hgrt_errors_keep_their_class():
    with pytest.raises(PlanError, match=r"'plan' failed after \[\]: overlap"):
        run_passes(Mod, None, [("plan", plan_boom)])


def test_verify_catches_ill_formed_ir():
    def break_ir(mod, ctx):
        f = mod["main"]
        stray = relax.Var("stray", relax.TensorType((4,), "float32"))
        bad = relax.Function(f.params, relax.SeqExpr(f.body.blocks, stray), f.ret_ty,
                             f.is_pure, f.attrs)
        new = mod.clone()
        new.update_func(new.get_global_var("main"), bad)
        return new

    assert run_passes(Mod, None, [("break", break_ir)], verify=False) is not None
    with pytest.raises(BuildError, match="not well formed after 'break'"):
        run_passes(Mod, None, [("ok", ok), ("break", break_ir)], verify=True)
