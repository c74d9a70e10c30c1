"""A NaN or inf weight raises one clear NonFiniteError naming the first layer whose output is non-finite,
from every analysis, instead of NaN effects (or a battery that blames the data)."""

from __future__ import annotations

import pytest
import torch

import phaselens
from phaselens.errors import NonFiniteError
from tests.support.models import task_model

KW = dict(n_per_residue=2, progress=False)


def poisoned(value=float("nan"), where="mlp"):
    model = task_model()
    with torch.no_grad():
        if where == "mlp":
            model.blocks[1].mlp.W_in[0, 3] = value  # layer 1's MLP
        else:
            model.embed.weight[:] = value  # every token's embedding
    return model


ANALYSES = {
    "evaluate": lambda m: phaselens.evaluate(m, **KW),
    "ablate": lambda m: phaselens.ablate(m, "L0H0", **KW),
    "specialization_map": lambda m: phaselens.specialization_map(m, kinds=("layer",), n_bootstrap=0, **KW),
    "specialization_map (zero)": lambda m: phaselens.specialization_map(m, kinds=("layer",), method="zero",
                                                                        n_bootstrap=0, **KW),
    "record": lambda m: phaselens.record(m, n_per_residue=2),
    "patch": lambda m: phaselens.patch(m, heads="L0H0", n_per_residue=2),
    "repair_table": lambda m: phaselens.repair_table(m, n_per_residue=2, progress=False, n_permutations=10,
                                                     n_bootstrap=10),
    "evaluate(phase_ensemble)": lambda m: phaselens.evaluate(phaselens.phase_ensemble(m), **KW),
}


CASES = [(name, float("nan")) for name in ANALYSES] + [("evaluate", float("inf")), ("ablate", float("-inf"))]


@pytest.mark.parametrize(("name", "value"), CASES, ids=[f"{n}-{v}" for n, v in CASES])
def test_every_analysis_names_the_first_bad_layer(name, value):
    with pytest.raises(NonFiniteError, match=r"clean forward pass: the first non-finite output is layer 1's "
                                             r"\(blocks\.1\.mlp\.hook_pre\)"):
        ANALYSES[name](poisoned(value))


def test_a_bad_embedding_is_named_and_no_hook_is_left():
    model = poisoned(where="embed")
    with pytest.raises(NonFiniteError, match=r"'embed' \(before the first layer\)"):
        phaselens.ablate(model, "L1", **KW)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert all(not hp.fwd_hooks for hp in model.hook_dict.values())


def test_nan_from_an_intervention_blames_the_hooks_not_the_model():
    model = task_model()
    tokens = model.default_task.build(model.analysis_spec, n_per_residue=1, seed=0)
    from phaselens.analyses.scoring import model_logits

    def nan_z(z, hook):
        return torch.full_like(z, float("nan"))

    with pytest.raises(NonFiniteError, match=r"under this analysis's hooks: the first non-finite output is layer 1"):
        model_logits(model, tokens.tokens, tokens.query_pos, [("blocks.1.attn.hook_z", nan_z)])
    with phaselens.analyses.knocked_out(model, "L1H0", method="zero", positions=tokens.query_pos):  # hooks of a context
        out = model_logits(model, tokens.tokens, tokens.query_pos)  # finite: no error
    assert bool(torch.isfinite(out).all())


def test_the_deepseek_adapter_names_its_layer():
    from tests.support.deepseek import random_tokens, tiny_v4_model

    hf = tiny_v4_model()
    with torch.no_grad():
        hf.model.layers[2].self_attn.q_a_proj.weight.fill_(float("nan"))
    adapter = phaselens.from_hf(hf)
    tokens = random_tokens(1, 12, 0)
    from phaselens.analyses.scoring import model_logits

    with pytest.raises(NonFiniteError, match=r"layer 2's \(model\.layers\.2\.self_attn\.q_a_proj\)"):
        model_logits(adapter, tokens, torch.tensor([11]))


def test_the_message_names_the_bad_weight_or_an_fp16_overflow():
    """A NaN weight is named; with every weight finite, a float16 model whose activations overflow 65504 is
    told so (it was reported as 'a weight is NaN')."""
    with pytest.raises(NonFiniteError, match=r"These weights hold NaN/inf: \['blocks\.1\.mlp\.W_in'\]"):
        phaselens.evaluate(poisoned(), **KW)
    big = task_model().half()
    with torch.no_grad():
        for p in big.parameters():
            p.mul_(300)  # every weight finite in fp16, the activations are not
    assert all(bool(torch.isfinite(p).all()) for p in big.parameters())
    with pytest.raises(NonFiniteError, match=r"Every weight is finite, so an activation overflowed: float16 holds "
                                             r"values up to 65504 only.*model\.float\(\)") as info:
        phaselens.evaluate(big, **KW)
    assert "weight (or the embedding" not in str(info.value)
