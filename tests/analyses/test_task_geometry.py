"""A prepared TaskBatch must have been built for the geometry an analysis reads (class 3 of "Reliability round 4").

A batch's ``residue`` and ``phase`` columns count from its spec's origin, mod its stride. Every analysis that
accepts a prepared batch refuses one built for another origin or stride than the model's ``analysis_spec`` (or
``stride=``), before any forward, with both geometries and the fix; a batch built for that geometry runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest

import phaselens
from phaselens import PhaseSpec
from phaselens.errors import TaskError
from tests.support.models import task_model, tiny_task

Q = dict(progress=False)
ENTRY_POINTS: dict[str, Callable[..., Any]] = {  # name -> call(model, batch, **options)
    "evaluate": lambda m, b, **kw: phaselens.evaluate(m, b, **Q, n_bootstrap=0, n_permutations=1, **kw),
    "record": lambda m, b, **kw: phaselens.record(m, b, **Q, **kw),
    "ablate": lambda m, b, **kw: phaselens.ablate(m, "L1H0", method="zero", task=b, **Q, n_bootstrap=0, **kw),
    "patch": lambda m, b, **kw: phaselens.patch(m, "L1H0", task=b, **Q, n_bootstrap=0, **kw),
    "specialization_map": lambda m, b, **kw: phaselens.specialization_map(m, b, method="zero", kinds=("layer",),
                                                                           **Q, n_bootstrap=0, **kw),
    "plan(specialization_map)": lambda m, b, **kw: phaselens.plan(m, "specialization_map", b, **Q, **kw),
    "attribution_map": lambda m, b, **kw: phaselens.attribution_map(m, b, method="zero", **Q, **kw),
    "gate_cycling_test": lambda m, b, **kw: phaselens.gate_cycling_test(m, b, deltas=(1,), **Q, n_bootstrap=0, **kw),
    "repair_table": lambda m, b, **kw: phaselens.repair_table(m, b, shift_sets=("opposite",), **Q, n_bootstrap=0,
                                                              n_permutations=1, **kw),
}
# (batch geometry, stride= of the call, phrases the error must hold): the model reads stride 4, origin 0
MISMATCHES = {
    "another origin": (PhaseSpec(4, origin=1), None,
                       ("stride 4, origin 1", "stride 4, origin 0", "task.build(model.analysis_spec")),
    "another stride": (PhaseSpec(8), None, ("stride 8, origin 0", "stride 4, origin 0", "task.build(model.analysis_spec",
                                            "stride=8")),
    "another stride than stride=": (PhaseSpec(4), 8, ("stride 4, origin 0", "stride 8, origin 0",
                                                     "task.build(phaselens.PhaseSpec(8, origin=0)")),
}


@functools.cache
def model() -> Any:
    return task_model()


@functools.cache
def batch(spec: PhaseSpec) -> Any:
    return tiny_task().build(spec, n_per_residue=1, seed=0)


def refused(m: Any, call: Callable[[], Any]) -> tuple[int, str]:
    """``call`` raises TaskError: how many module calls of ``m`` it ran first (a forward calls every module,
    however the analysis enters the model), and the message."""
    count = [0]
    handles = [mod.register_forward_hook(lambda *_: count.__setitem__(0, count[0] + 1)) for mod in m.modules()]
    try:
        with pytest.raises(TaskError) as info:
            call()
    finally:
        for handle in handles:
            handle.remove()
    return count[0], str(info.value)


@pytest.mark.parametrize("case", list(MISMATCHES))
@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_a_batch_of_another_geometry_is_refused_before_any_forward(entry, case):
    m = model()
    spec, stride, phrases = MISMATCHES[case]
    assert m.analysis_spec == PhaseSpec(4)
    kw = {} if stride is None else {"stride": stride}
    n_forwards, message = refused(m, lambda: ENTRY_POINTS[entry](m, batch(spec), **kw))
    assert n_forwards == 0
    for phrase in phrases:
        assert phrase in message, message


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_a_batch_of_the_model_geometry_runs(entry):
    m = model()
    ENTRY_POINTS[entry](m, batch(m.analysis_spec))


@pytest.mark.parametrize("entry", ["evaluate", "record", "plan(specialization_map)"])
def test_a_batch_built_for_stride_runs_with_that_stride(entry):
    """stride= reads phases at another stride: a batch built for that stride (same origin) is the right one."""
    m = model()
    out = ENTRY_POINTS[entry](m, batch(PhaseSpec(8)), stride=8)
    assert getattr(out, "stride", 8) == 8


def test_the_control_takes_a_batch_built_for_the_stride_it_is_compared_at():
    ctrl = task_model(None)  # full attention: analysis stride 1
    with pytest.raises(TaskError, match="stride=4"):
        ENTRY_POINTS["evaluate"](ctrl, batch(PhaseSpec(4)))
    assert ENTRY_POINTS["evaluate"](ctrl, batch(PhaseSpec(4)), stride=4).stride == 4
