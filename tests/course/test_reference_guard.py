"""The reference guard: kvlab's reference refuses to run inside a learner's function under test, however it is reached.

`own_implementation` reads names, so it stops a reference kept in a global. A reference kept in a
partial, a namespace, a list, a dict, an instance attribute or a closure is stopped by the second
half: while `run_case` runs the learner's function, the exercise's references raise when called.
Each test loads checks.py afresh, as a notebook's test cell does.
"""

import functools
import importlib.util
import types

import pytest
import torch

from kvlab.engine.rejection_sampler import rejection_sample, residual_distribution
from kvlab.kernels.interpreter import RUNS_IN_INTERPRETER


def fresh_checks():
    spec = importlib.util.find_spec("kvlab.course.checks")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


P = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
Q = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)


class Holder:
    def __init__(self, fn):
        self.fn = fn


def _routes():
    """Learner functions that reach residual_distribution without naming it in a global."""
    in_partial = functools.partial(residual_distribution)
    in_namespace = types.SimpleNamespace(fn=residual_distribution)
    in_list, in_dict = [residual_distribution], {"fn": residual_distribution}
    in_instance = Holder(residual_distribution)

    def via_partial(p, q):
        return in_partial(p, q)

    def via_namespace(p, q):
        return in_namespace.fn(p, q)

    def via_list(p, q):
        return in_list[0](p, q)

    def via_dict(p, q):
        return in_dict["fn"](p, q)

    def via_instance(p, q):
        return in_instance.fn(p, q)

    def swallows_the_refusal(p, q):
        try:
            return in_dict["fn"](p, q)
        except Exception:  # a fallback must not turn the refusal into a pass
            return p

    return [via_partial, via_namespace, via_list, via_dict, via_instance, swallows_the_refusal]


@pytest.mark.parametrize("learner", _routes(), ids=lambda fn: fn.__name__)
def test_a_reference_reached_through_an_object_refuses_to_run(learner):
    checks = fresh_checks()
    checks.own_implementation(learner, residual_distribution, rejection_sample)  # names alone do not see it
    with pytest.raises(checks.CheckFailed, match="refuses to run while your function is being checked"):
        checks.run_case("residual(p, q)", learner, P, Q)
    # Outside the check the reference works again, unchanged.
    assert torch.allclose(residual_distribution(P, Q), torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))


def test_an_own_implementation_runs_and_only_the_exercises_references_are_refused():
    checks = fresh_checks()

    def residual(p, q):
        r = (p - q).clamp_min(0)
        return r / r.sum()

    checks.own_implementation(residual, residual_distribution, rejection_sample)
    assert torch.allclose(checks.run_case("yours", residual, P, Q), residual_distribution(P, Q))
    # kvlab code that is not this exercise's reference still runs inside the learner's function.
    from kvlab.core.paging import num_blocks_needed
    assert checks.run_case("a helper", lambda: num_blocks_needed(33, 16)) == 3


def test_references_with_closures_and_classes_are_refused_and_restored():
    checks = fresh_checks()

    def make_reference():
        offset = 3

        def reference(x):
            return x + offset
        return reference

    reference = make_reference()

    class Reference:
        def method(self):
            return "reference"

    box = {"fn": reference, "cls": Reference}
    checks.own_implementation(lambda: None, reference, Reference)
    with pytest.raises(checks.CheckFailed, match="refuses to run"):
        checks.run_case("closure", lambda: box["fn"](1))
    with pytest.raises(checks.CheckFailed, match="refuses to run"):
        checks.run_case("method", lambda: box["cls"]().method())
    assert reference(1) == 4 and Reference().method() == "reference"


def test_refusing_restores_the_reference_when_the_learner_code_fails():
    checks = fresh_checks()
    box = [residual_distribution]
    with pytest.raises(KeyError):
        with checks.refusing(residual_distribution):
            raise KeyError("the learner's own bug")
    assert torch.allclose(box[0](P, Q), residual_distribution(P, Q))


@pytest.mark.skipif(not RUNS_IN_INTERPRETER, reason="launches a kernel on CPU tensors, in the Triton interpreter")
def test_a_triton_kernel_reached_through_a_dict_refuses_to_launch():
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.arange(0, BLOCK)
        mask = offsets < n
        tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + 1, mask=mask)

    checks = fresh_checks()
    kernels = {"k": add_one}
    x = torch.zeros(8)

    def learner(x):
        kernels["k"][(1,)](x, 8, BLOCK=8)
        return x

    checks.own_implementation(lambda: None, add_one)
    with pytest.raises(checks.CheckFailed, match="refuses to run"):
        checks.run_case("launch", learner, x)
    assert x.sum() == 0
    add_one[(1,)](x, 8, BLOCK=8)
    assert x.sum() == 8
