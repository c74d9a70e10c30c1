"""TransformerLens's own patching functions run on CompressedTransformer."""

from __future__ import annotations

import torch
from transformer_lens import patching

from tests.support.models import LAYOUTS, make_model


def test_get_act_patch_attn_head_out_all_pos_matches_a_manual_hook():
    model = make_model(LAYOUTS["w8s4-deepseek"]).eval()
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(0, 61, (3, 21), generator=g)
    corrupted = clean.clone()
    corrupted[:, 4] = (corrupted[:, 4] + 9) % 61
    answer, wrong = 7, 13

    def metric(logits):
        return (logits[:, -1, answer] - logits[:, -1, wrong]).mean()

    _, clean_cache = model.run_with_cache(clean)
    result = patching.get_act_patch_attn_head_out_all_pos(model, corrupted, clean_cache, metric)
    assert result.shape == (2, 4)

    layer, head = 1, 2
    name = f"blocks.{layer}.attn.hook_z"

    def patch(z, hook):
        z[:, :, head] = clean_cache[name][:, :, head]
        return z

    manual = metric(model.run_with_hooks(corrupted, fwd_hooks=[(name, patch)])).detach()
    assert torch.allclose(result[layer, head], manual, atol=1e-6)
    # the patch does something, so the comparison is not vacuous
    with torch.no_grad():
        unpatched = float(metric(model(corrupted)))
    assert abs(float(manual) - unpatched) > 1e-5


def test_cfg_carries_the_fields_transformer_lens_reads():
    model = make_model(LAYOUTS["w4s4-scalar"])
    cfg = model.cfg
    assert (cfg.n_layers, cfg.n_heads, cfg.n_key_value_heads, cfg.d_head, cfg.device) == (2, 4, 2, 8, "cpu")
    assert "blocks.0.attn.hook_z" in model.hook_dict
