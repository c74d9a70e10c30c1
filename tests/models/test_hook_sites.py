"""One hook-site table format, one dispatch, one check of what a hook returns, on every model kind (issue 45).

A hook that returns a tensor of the wrong dtype or the wrong shape gets the same :class:`InputError`, with the same
message, on the zoo transformer, the DeepSeek-V4 adapter (torch hooks and nnsight), DeepSeek-V4.1 and a causal-LM
adapter; an edit at a read-only site is refused the same way; nothing is left hooked after the error. Each kind's
hook points are the rows of its table, and the table's shapes are the ranks of the tensors the hooks see.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch

import phaselens
from phaselens.errors import InputError
from tests.support.causal_lm import tiny_causal_lm
from tests.support.deepseek import tiny_v4_model
from tests.support.deepseek_v41 import write_tiny_checkpoint
from tests.support.models import LAYOUTS, make_model

KINDS = ["zoo", "v4", "v4-nnsight", "v41", "causal-lm"]
Z = "blocks.1.attn.hook_z"
WRONG = {  # what a hook returns for z [B, n, H, d] in fp32
    "dtype": (lambda z: z.double(), r"dtype torch\.float64"),
    "shape": (lambda z: z[..., :3], r"shape \(2, 12, 4, 3\)"),
    "not a tensor": (lambda z: z.tolist(), r"a list of 2 items"),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    warnings.simplefilter("ignore")
    hf = tiny_v4_model(seed=1)
    v41_dir = write_tiny_checkpoint(tmp_path_factory.mktemp("v41") / "tiny", engram=True)
    out = {
        "zoo": phaselens.load("zoo:w4s4"),
        "v4": phaselens.from_hf(hf, index_topk="all"),
        "v4-nnsight": phaselens.from_hf(hf, backend="nnsight", index_topk="all"),
        "v41": phaselens.load(f"hf:{v41_dir}", dtype=torch.float32, index_topk="all"),
        "causal-lm": phaselens.load(tiny_causal_lm("llama"), stride=4),
    }
    tokens = torch.randint(2, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    return {kind: (model, tokens) for kind, model in out.items()}


@pytest.mark.parametrize("wrong", list(WRONG))
@pytest.mark.parametrize("kind", KINDS)
def test_a_wrong_return_is_the_same_error_on_every_kind(models, kind, wrong):
    model, tokens = models[kind]
    make, got = WRONG[wrong]
    with torch.no_grad():
        clean = model(tokens)
        with pytest.raises(InputError) as err:
            model.run_with_hooks(tokens, fwd_hooks=[(Z, lambda z, hook: make(z))])
        expected = (rf"the hook on {re.escape(Z)} returned [^;]*{got}[^;]*; a hook returns None \(to read the value\) "
                    r"or a tensor of shape \(2, 12, 4, \d+\), dtype torch\.float32 on cpu \(to replace it\)")
        assert re.match(expected, str(err.value)), str(err.value)
        assert torch.equal(model(tokens), clean)  # the failed call left no hook behind


@pytest.mark.parametrize("kind", KINDS)
def test_an_edit_at_a_read_only_site_is_refused_the_same_way(models, kind):
    model, tokens = models[kind]
    name, point = next((n, p) for n, p in model.hook_sites.items() if not p.editable and p.layer == 1)
    with torch.no_grad(), pytest.raises(InputError, match=rf"^{re.escape(name)} is read-only: {re.escape(point.read_only)}"):
        model.run_with_hooks(tokens, fwd_hooks=[(name, lambda x, hook: x + 1)])
    with torch.no_grad():  # reading, or returning the value itself, stays allowed
        assert torch.equal(model.run_with_hooks(tokens, fwd_hooks=[(name, lambda x, hook: x)]), model(tokens))


@pytest.mark.parametrize("kind", KINDS)
def test_every_hook_point_is_a_row_of_the_kinds_table_with_its_rank(models, kind):
    """``hook_sites`` (the table) names exactly ``hook_dict`` (what the model hooks), and every cached tensor has
    the rank of its row's shape (``"[B, E_new, W, Hkv(, d)]"``: 4 or 5)."""
    model, tokens = models[kind]
    assert set(model.hook_sites) == set(model.hook_dict)
    if kind == "v4-nnsight":
        return
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    assert cache.cache_dict
    for name, value in cache.cache_dict.items():
        shape = model.hook_sites[name].shape
        rank = len(shape.replace("(,", ",").split(","))
        assert value.dim() in ((rank - 1, rank) if "(" in shape else (rank,)), (name, shape, tuple(value.shape))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
def test_the_zoo_tables_rows_are_its_modules_hook_points(layout, mlp):
    """Every layout the zoo builds (full, local, compressed layers; K = V or not; gated MLPs): the table's names are
    the hook points TransformerLens finds in the module tree."""
    model = make_model(LAYOUTS[layout], mlp=mlp)
    assert set(model.hook_sites) == set(model.hook_dict)
