"""Analyses touch a model only through the contract: every analysis runs on a model that exposes nothing but
the members ``PhaseModel`` declares (and its capabilities), and gives the numbers of the model itself."""

from __future__ import annotations

import numpy as np
import pytest

import phaselens
from phaselens.contract.protocol import CAPABILITIES, MEMBERS


class Strict:
    """A model that refuses every attribute the contract does not declare."""

    def __init__(self, model) -> None:
        object.__setattr__(self, "_inner", model)

    def __getattr__(self, name):
        if name in MEMBERS or name in CAPABILITIES:
            return getattr(object.__getattribute__(self, "_inner"), name)
        raise AssertionError(f"an analysis read {name!r}, which the model contract does not declare")

    def __call__(self, *args, **kwargs):
        return object.__getattribute__(self, "_inner")(*args, **kwargs)

    def __setattr__(self, name, value):
        raise AssertionError(f"an analysis wrote {name!r} onto the model")


@pytest.fixture(scope="module")
def pair():
    model = phaselens.load("zoo:w4s4")
    return model, Strict(model)


SMALL = dict(n_per_residue=2, seed=0, progress=False)
CALLS = {
    "evaluate": lambda m: phaselens.evaluate(m, **SMALL, n_permutations=20, n_bootstrap=20).per_residue(),
    "record": lambda m: phaselens.record(m, **SMALL).per_residue(),
    "ablate": lambda m: phaselens.ablate(m, "L0H1", **SMALL, n_bootstrap=20).per_residue(),
    "ablate-full": lambda m: phaselens.ablate(m, "L0H1", **SMALL, n_bootstrap=20, engine="full").per_residue(),
    "patch": lambda m: phaselens.patch(m, "L1", **SMALL, n_bootstrap=20).per_residue(),
    "map": lambda m: phaselens.specialization_map(m, **SMALL, n_bootstrap=20).per_residue(),
    "map-plan": lambda m: _plan(phaselens.plan(m, "specialization_map", **SMALL)),
    "attribution": lambda m: phaselens.attribution_map(m, **SMALL).per_residue(),
    "cycling": lambda m: phaselens.gate_cycling_test(m, **SMALL, deltas=(1,), n_bootstrap=20).per_phase(),
    "repair": lambda m: phaselens.repair_table(m, **SMALL, shift_sets=("opposite",), n_permutations=20,
                                               n_bootstrap=20).per_phase(),
    "knockout": lambda m: _knockout(m),
}


def _plan(plan):
    import pandas as pd

    return pd.DataFrame({"forwards": [plan.forwards], "passes": [plan.token_passes]})


def _knockout(m):
    import pandas as pd

    batch = m.default_task.build(m.dims.analysis_spec, n_per_residue=1)
    with phaselens.analyses.knocked_out(m, "L1H0", method="zero", positions="last"):
        logits = m(batch.tokens)
    return pd.DataFrame({"logit": logits[:, -1].sum(-1).detach().numpy()})


@pytest.mark.parametrize("name", list(CALLS))
def test_every_analysis_runs_on_the_contract_alone(pair, name):
    model, strict = pair
    want, got = CALLS[name](model), CALLS[name](strict)
    assert list(want.columns) == list(got.columns)
    for col in want.columns:
        a, b = want[col].to_numpy(), got[col].to_numpy()
        if a.dtype.kind in "biuf":
            assert np.allclose(a.astype(float), b.astype(float), equal_nan=True), col
        else:
            assert list(a) == list(b), col
