"""``phaselens.plan(model, analysis, ...)``: each analysis's plan against a counted run of the same call.

The run is counted at the points where the engines call the model: every forward through ``model_logits`` (in
every analyses module that calls it: scoring, calibration, capture, knockouts, patching, repair, attribution,
recording), every slot engine's prefill and clean step, every cell pass.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest

import phaselens
import phaselens.analyses
from phaselens.models.compressed.engine import SuffixEngine
from phaselens.models.deepseek_v4.engine import V4SuffixEngine
from phaselens.planning import Plan
from phaselens.planning.plans import analysis_modules, public_analyses
from phaselens.tasks import KVRecall
from tests.support.deepseek import one_thread, tiny_v4_model  # noqa: F401  (one_thread: fixture)

V4_TASK = KVRecall(n_records=6, block_filler=4, n_demos=2, min_distance=8, modulus=8)


class Counted:
    """Forwards and token passes of a real run (the units of :class:`Plan`)."""

    def __init__(self, monkeypatch, model) -> None:
        self.forwards, self.tokens = 0, 0.0
        L, copies = int(model.cfg.n_layers), int(getattr(model, "cost", 1))

        def forwards(fn):
            def counted(m, tokens, query_pos, fwd_hooks=()):
                self.forwards += 1
                self.tokens += tokens.shape[0] * tokens.shape[1] * copies
                return fn(m, tokens, query_pos, fwd_hooks)
            return counted

        for module in analysis_modules():
            if hasattr(module, "model_logits"):
                monkeypatch.setattr(module, "model_logits", forwards(module.model_logits))
        for cls in (SuffixEngine, V4SuffixEngine):  # the shared SlotEngine's _pass, counted per kind
            init, step = cls.__init__, cls._pass

            def counted_init(eng, m, tokens, q, *a, _init=init, **kw):
                _init(eng, m, tokens, q, *a, **kw)
                self.forwards += (1 if q > 0 else 0) + 1  # prefill, clean step
                self.tokens += tokens.shape[0] * (q + 1)

            def counted_pass(eng, layer, cells, _step=step):
                self.forwards += 1
                self.tokens += len(cells) * eng.n * (L - layer) / L
                return _step(eng, layer, cells)

            monkeypatch.setattr(cls, "__init__", counted_init)
            monkeypatch.setattr(cls, "_pass", counted_pass)


def _v4(chunk=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        adapter = phaselens.from_hf(tiny_v4_model(seed=3), chunk=chunk)
    adapter.default_task = V4_TASK
    return adapter


def _zoo():
    return phaselens.load("zoo:w4s4")


MAP_CASES = {
    "zoo-suffix": (_zoo, dict(method="mean", rows_per_pass=40, batch_size=5)),
    "zoo-full": (_zoo, dict(method="zero", engine="full", batch_size=7)),
    "ensemble-full": (lambda: phaselens.phase_ensemble(_zoo()), dict(method="zero", kinds=("layer",))),
    "v4-chunked-suffix": (lambda: _v4(chunk=8), dict(method="mean", kinds=("head", "layer"), batch_size=3)),
}
# every other analysis, each engine it has (the zoo model: every capability)
CASES = {
    "evaluate": (_zoo, "evaluate", dict(batch_size=5)),
    "record": (_zoo, "record", dict(batch_size=7)),
    "ablate-suffix": (_zoo, "ablate", dict(heads="L1H0", method="mean", batch_size=5)),
    "ablate-full": (_zoo, "ablate", dict(heads=["L0H1", "L1H0"], method="resample", batch_size=5)),
    "patch-suffix": (_zoo, "patch", dict(heads=["L0H0", "L1H1", "L1H0"], batch_size=5)),
    "patch-full": (_zoo, "patch", dict(heads=["L0H0", "L1H1"], engine="full", batch_size=9)),
    "attribution": (_zoo, "attribution_map", dict(method="mean", batch_size=6)),
    "gate-cycling": (_zoo, "gate_cycling_test", dict(deltas=(1, 2), batch_size=5)),
    "repair": (_zoo, "repair_table", dict(shift_sets=("all",), batch_size=5)),
    "ablate-v4-suffix": (lambda: _v4(chunk=8), "ablate", dict(heads="L1H0", method="zero", batch_size=3)),
    "knockout-mean": (_zoo, "knockout", dict(heads="L1H0", method="mean", batch_size=5, n_permutations=1)),
    "knockout-resample": (_zoo, "knockout", dict(heads=["L0H1", "L1H0"], method="resample", batch_size=7,
                                                 n_permutations=1)),
}


def test_every_analysis_is_planned_here():
    """The cases cover every analysis phaselens has (the one discovery: phaselens.planning.plans)."""
    assert {name for _, name, _ in CASES.values()} | {"specialization_map"} == set(public_analyses())


def _check(monkeypatch, model, name, opts):
    import inspect

    common = dict(n_per_residue=2, progress=False, **opts)
    if "n_bootstrap" in inspect.signature(getattr(phaselens, name)).parameters:
        common["n_bootstrap"] = 0
    plan = phaselens.plan(model, name, **common)
    assert isinstance(plan, Plan) and plan.analysis == name
    counted = Counted(monkeypatch, model)
    result = getattr(phaselens, name)(model, **common)
    assert plan.forwards == counted.forwards > 1
    assert plan.token_passes == pytest.approx(counted.tokens)
    assert plan.full_forwards == pytest.approx(counted.tokens / (plan.items * plan.tokens))
    return plan, result


@pytest.mark.parametrize("case", list(MAP_CASES))
def test_plan_counts_what_the_map_runs(monkeypatch, case):
    make, opts = MAP_CASES[case]
    plan, pm = _check(monkeypatch, make(), "specialization_map", opts)
    assert plan.engine == pm.metadata["engine"]
    assert plan.n_cells == len(pm.cells) and plan.items == len(pm.residue)


@pytest.mark.parametrize("case", list(CASES))
def test_plan_counts_what_every_analysis_runs(monkeypatch, case):
    make, name, opts = CASES[case]
    plan, result = _check(monkeypatch, make(), name, opts)
    if "engine" in result.metadata:
        assert plan.engine == result.metadata["engine"]


def test_the_analysis_is_named_or_passed_and_its_options_checked():
    """By name or by function, the same plan; the analysis's own checks refuse bad options before anything
    runs, as the call would; an unknown analysis or option is named."""
    model = _zoo()
    by_name = phaselens.plan(model, "ablate", heads="L0H1", n_per_residue=2)
    by_fn = phaselens.plan(model, phaselens.ablate, heads="L0H1", n_per_residue=2)
    now = dict(available_bytes=None, max_per_residue=None)  # the memory available moves between the calls
    assert dataclasses.replace(by_name, **now) == dataclasses.replace(by_fn, **now)
    assert by_name.cells == {"knockout": 1}
    with pytest.raises(phaselens.errors.InputError, match="method"):
        phaselens.plan(model, "specialization_map", method="median", n_per_residue=1)
    with pytest.raises(phaselens.errors.InputError, match="not an analysis.*evaluate"):
        phaselens.plan(model, "evaluation", n_per_residue=1)
    with pytest.raises(phaselens.errors.InputError, match="n_per_residu"):
        phaselens.plan(model, "evaluate", n_per_residu=1)
    with pytest.raises(phaselens.errors.InputError, match="heads"):
        phaselens.plan(model, "ablate", n_per_residue=1)  # ablate's required heads


def test_no_analysis_takes_a_plan_flag():
    """A plan is its own call: no analysis returns a result or a plan depending on a flag."""
    import inspect

    for name in public_analyses():
        assert "plan" not in inspect.signature(getattr(phaselens, name)).parameters, name
    with pytest.raises(TypeError, match="plan"):
        phaselens.specialization_map(_zoo(), plan=True, n_per_residue=1)


def test_plan_reads_and_is_frozen():
    plan = phaselens.plan(_zoo(), "specialization_map", n_per_residue=2)
    text = repr(plan)
    for word in ("specialization_map on w4s4", "cells", "forwards", "token passes", "full forwards", "GiB",
                 "engine 'suffix'"):
        assert word in text
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.forwards = 0
    assert plan.memory_bytes == sum(plan.memory.values()) > 0


def test_a_gate_cycled_copy_holds_the_weights_twice_and_gradients_are_noted():
    model = _zoo()
    ev = phaselens.plan(model, "evaluate", n_per_residue=2)
    cyc = phaselens.plan(model, "gate_cycling_test", n_per_residue=2)
    assert cyc.memory["weights"] == 2 * ev.memory["weights"] > 0
    assert cyc.forwards == 7 * ev.forwards  # the model, then each of the 6 default shifts
    att = phaselens.plan(model, "attribution_map", n_per_residue=2)
    assert any("gradients" in n for n in att.notes) and not ev.notes


def test_plan_of_a_released_size_model_at_128k_needs_no_weights():
    """Flash on the meta device at 128K tokens: the engine's plan is a few full forwards where the full
    engine's is one per cell; memory comes from the adapter's estimate (weights alone are ~530 GiB)."""
    from tests.support.deepseek import FLASH_CONFIG, meta_v4

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        adapter = phaselens.from_hf(meta_v4(FLASH_CONFIG), index_topk="all", chunk=1024)
    task = KVRecall(n_records=48, block_filler=65000, n_demos=2, min_distance=8, modulus=8)
    opts = dict(n_per_residue=1, kinds=("layer",), method="zero", batch_size=1)
    fast = phaselens.plan(adapter, "specialization_map", task, **opts)
    slow = phaselens.plan(adapter, "specialization_map", task, engine="full", **opts)
    assert fast.tokens > 128_000 and fast.n_cells == 43
    assert fast.engine == "suffix" and slow.engine == "full"
    assert slow.full_forwards == 44  # the clean pass and one per cell
    assert fast.full_forwards < 1.01  # one prefill, then 43 query-row passes
    assert fast.memory["weights"] == slow.memory["weights"] > 500 * 2**30
    # batch_size 1: one cached prefix per item (8 items), each a prefill, a clean step and 43 one-cell passes
    assert fast.memory["cache"] > 0 and fast.forwards == 8 * (1 + 1 + 43)


def test_a_plan_of_trillions_of_items_is_counted_not_listed():
    """n_per_residue=10^12 with an engine per block of items (ablate): the blocks repeat, so they are counted
    by period; the count equals the same plan's over a built batch of the same layout."""
    model = _zoo()
    big = phaselens.plan(model, "ablate", heads="L1H0", method="zero", n_per_residue=10**12, batch_size=5)
    assert big.items == 24 * 10**12 and not big.fits
    built = model.default_task.build(model.analysis_spec, n_per_residue=5, seed=0)
    small = phaselens.plan(model, "ablate", built, heads="L1H0", method="zero", batch_size=5)
    planned = phaselens.plan(model, "ablate", heads="L1H0", method="zero", n_per_residue=5, batch_size=5)
    assert (small.forwards, small.token_passes) == (planned.forwards, planned.token_passes)
    assert big.forwards == planned.forwards * 10**12 // 5
