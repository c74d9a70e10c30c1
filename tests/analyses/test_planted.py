"""A planted specialization: gates fixed by hand so head h keeps only one offset; the tools must find it.

Head 0's key entries carry only offset 0 and its value entries offset 1; head 1's carry offsets 2 and 3.
A key and its value then share an entry exactly when the key sits at phase 0 (head 0) or phase 2 (head 1).
The rest of a one-layer model is trained briefly on KVRecall, so retrieval flows through those heads.
"""

from __future__ import annotations

import pytest
import torch

import phaselens
from phaselens.models import CompressedConfig, CompressorSpec
from phaselens.tasks import KVRecall
from phaselens.train.loop import TrainSettings, train

KEY_OFFSET = {0: 0, 1: 2}  # head -> planted key offset; the value offset is one later
TASK = KVRecall(n_records=6, block_filler=4, n_demos=2, min_distance=8, modulus=8, padding="in_sequence")


def plant(model) -> None:
    """Fix the gates by hand (a +/-20 per-offset bias, zero gate weights) and freeze them; start the retrieval
    circuit near a solution so that brief training suffices.

    Each head h gets an orthonormal read-out A_h shared by its queries and its entry keys (a query then matches
    the entries that hold the same token) and a read-out B_h for values, written back through W_O; the
    unembedding starts as the embedding. Only the gates are frozen: everything else is trained.
    """
    attn = model.blocks[0].attn
    g = torch.Generator().manual_seed(0)
    D, dh = model.config.d_model, model.config.d_head
    with torch.no_grad():
        basis = torch.linalg.qr(torch.randn(D, D, generator=g))[0]
        for h in range(2):
            a, b = basis[:, h * dh : (h + 1) * dh], basis[:, 32 + h * dh : 32 + (h + 1) * dh]
            attn.W_Q[h] = 3.0 * a  # TransformerLens's [H, D, d] view of the parameter
            attn.compressor.poolers["k"].payload.weight[0, 0, :, h * dh : (h + 1) * dh] = a
            attn.compressor.poolers["v"].payload.weight[0, 0, :, h * dh : (h + 1) * dh] = b
            attn.W_O[h] = b.T
        model.embed.weight.normal_(0, 1.0, generator=g)
        model.unembed.weight.copy_(model.embed.weight)
        for path, shift in (("k", 0), ("v", 1)):
            pooler = attn.compressor.poolers[path]
            pooler.gate.weight.zero_()
            bias = torch.full_like(pooler.position_bias, -20.0)
            for head, off in KEY_OFFSET.items():
                bias[0, off + shift, head] = 20.0
            pooler.position_bias.copy_(bias)
            pooler.gate.weight.requires_grad_(False)
            pooler.position_bias.requires_grad_(False)


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    cfg = CompressedConfig(n_layers=1, d_model=64, n_heads=2, n_kv_heads=2, d_head=16, d_mlp=64,
                           d_vocab=TASK.vocab_size, n_ctx=128, local_window=2, rope=None,
                           compression=CompressorSpec(4, rope="none"), seed=0)
    settings = TrainSettings(steps=200, batch_size=32, lr=3e-3, warmup=10, checkpoint_every=200, threads=None)
    res = train(cfg, lambda b, s: TASK.sample_training_batch(b, s), settings, tmp_path_factory.mktemp("planted"),
                progress=False, init_fn=plant)
    model = res.model
    model.default_task = TASK
    return model


def test_training_kept_the_planted_gates_and_learned_the_covered_phases(planted):
    ev = phaselens.evaluate(planted, n_per_residue=64, progress=False, n_permutations=199, n_bootstrap=0)
    acc = ev.per_phase()["acc"].to_numpy()
    assert acc[0] > 0.5 and acc[2] > 0.5  # phases served by head 0 and head 1
    assert acc[1] < acc[0] - 0.2 and acc[3] < acc[2] - 0.2  # uncovered phases are weak


def test_record_shows_each_heads_gate_mass_on_its_own_offset(planted):
    rec = phaselens.record(planted, n_per_residue=8, progress=False)
    prof = rec.gate_profile  # [layer, path, kv_head, offset]
    for head, off in KEY_OFFSET.items():
        assert int(prof.sel(layer=0, path="k", kv_head=head).values.argmax()) == off
        assert int(prof.sel(layer=0, path="v", kv_head=head).values.argmax()) == off + 1
    conc = rec.concentration.sel(layer=0, path="k").values  # [kv_head, measure]
    assert (conc < 1.01).all()  # one offset: both concentration measures are 1


def test_specialization_map_ranks_the_planted_head_first(planted):
    pm = phaselens.specialization_map(planted, n_per_residue=32, progress=False, kinds=("head",), n_bootstrap=100)
    assert pm.top_heads(0, k=1)["label"].iloc[0] == "L0H0"
    assert pm.top_heads(2, k=1)["label"].iloc[0] == "L0H1"
    by = pm.per_phase("head")
    h0 = by[by["label"] == "L0H0"].set_index("phase")["rel_change"]
    h1 = by[by["label"] == "L0H1"].set_index("phase")["rel_change"]
    assert h0[0] < -50 and h1[2] < -50  # knocking out the serving head destroys its phase
    assert h0[2] > h1[2] and h1[0] > h0[0]  # and barely touches the other head's phase
    si = pm.specialization_index().set_index("label")["specialization"]
    assert si["L0H0"] > 0.3 and si["L0H1"] > 0.3
