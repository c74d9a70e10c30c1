"""DeepSeek-V4's layers as data: the :class:`~phaselens.contract.layer_table.LayerTable` of transformers'
``DeepseekV4ForCausalLM`` (a meta-device one will do: only shapes and dtypes are read).

Per layer, as the adapter runs it (:mod:`.prefill`):

* the cache (a ``DynamicCache``): the sliding window's last ``window - 1`` keys (sliding layers keep keys and
  values as two tensors, compressed layers one, K = V); a compressed layer's entries (``T // S`` rows of
  ``head_dim``) and its compressor's open block (``T % S`` rows of the kv and gate projections, ``2 x head_dim``
  wide with the CSA overlap) and, with the overlap, the last block's half (``S`` rows, its kv and its gate with
  the fp32 bias added); a CSA layer's indexer the same at ``index_head_dim``;
* attention: a call's ``[B, H, n, keys]`` probabilities in the model dtype, ``keys`` the cached window, the
  call's own tokens and every entry so far (eager attention holds about four such tensors at once; under
  ``numerics="reference"`` in half precision scores and exponentials are fp32: about five);
* logits in the head's dtype (fp32 for an :class:`~phaselens.models.deepseek_v4.numerics.Fp32Projection`);
* the other transients: about six fp32 copies of the hyper-connection streams ``[B, n, hc, D]`` per call, which
  the adapter's own run-time estimate leaves out (:mod:`.memory`) and ``phaselens plan`` counts.

Sizes are the tensors' own (``numel * itemsize``); a window slice may keep the storage of its last call's
concatenation (up to one chunk more rows) alive.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from phaselens.contract.layer_table import LayerRow, LayerTable, Store
from phaselens.models.deepseek_v4.config import unwrap
from phaselens.models.deepseek_v4.geometry import LayerGeometry, layer_geometry
from phaselens.models.deepseek_v4.numerics import Fp32Projection
from phaselens.models.deepseek_v4.packed_modules import is_packed
from phaselens.models.numerics.sizing import held_bytes

STREAM_COPIES = 6  # fp32 copies of the hyper-connection streams [B, n, hc, D] alive in one call


def hf_model(model: Any) -> nn.Module:
    """transformers' ``DeepseekV4ForCausalLM`` of an adapter, or the model itself."""
    return model.model if hasattr(model, "layer_geometry") else unwrap(model)[0]


def layer_table(model: Any) -> LayerTable:
    """The :class:`LayerTable` of a :class:`DeepSeekV4Adapter` or a transformers ``DeepseekV4ForCausalLM``."""
    hf = hf_model(model)
    c = hf.config
    item = hf.get_input_embeddings().weight.dtype.itemsize
    head = 4 if isinstance(hf.lm_head, Fp32Projection) else hf.lm_head.weight.dtype.itemsize
    rows = tuple(_row(hf, g, item) for g in layer_geometry(c))
    return LayerTable(rows, held_bytes(hf), int(c.sliding_window), int(c.vocab_size), head, item, keys="cached",
                      per_token=STREAM_COPIES * int(c.hc_mult) * int(c.hidden_size) * 4)


def _row(hf: nn.Module, g: LayerGeometry, item: int) -> LayerRow:
    c = hf.config
    d, H = int(c.head_dim), int(c.num_attention_heads)
    if g.spec is None:
        return LayerRow(g.layer, "sliding", H, d, cache=(Store("window", d, item, copies=2),))
    S = g.spec.stride
    comp = hf.model.layers[g.layer].self_attn.compressor
    stores = [Store("window", d, item), *_compressor(comp, S, d, item, overlap=g.kind == "csa")]
    if g.kind == "csa":
        stores += _compressor(comp.indexer, S, int(c.index_head_dim), item, overlap=True)
    return LayerRow(g.layer, f"ratio {S}", H, d, ratio=S, entry_ratio=S, makes_entries=True, picks=g.kind == "csa",
                    cache=tuple(stores))


def _compressor(module: nn.Module, S: int, d: int, item: int, *, overlap: bool) -> list[Store]:
    """Entries ``[T // S, d]``, the open block's projections ``[T % S, C]`` (kv and gate, C = 2d with overlap)
    and, with overlap, the last block's half ``[S, d]`` (kv, and gate with the fp32 bias added)."""
    proj = 4 if isinstance(module.kv_proj, Fp32Projection) else item if is_packed(module.kv_proj) else (
        module.kv_proj.weight.dtype.itemsize)
    out = [Store("entries", d, item, ratio=S), Store("open", (2 if overlap else 1) * d, proj, copies=2, ratio=S)]
    if overlap:
        out += [Store("block", d, proj, ratio=S), Store("block", d, 4, ratio=S)]
    return out


__all__ = ["STREAM_COPIES", "hf_model", "layer_table"]
