"""What one training step of a family member computes and holds, counted per layer kind.

**FLOPs per token** (forward + backward = 3 x forward; one multiply-add = 2 FLOPs), as the field counts them
(torchtitan's ``6 (N - embedding) + 12 L H d T``, Chinchilla's appendix F), per layer kind:

- ``dense``: ``6 (N - embedding)``: every weight once per token (the projections, the MLP, the compressor's
  gates; the norms' few weights too, which adds < 1% at the tiny size and nothing visible above it);
- ``attention``: ``12 H d K`` per layer (scores ``Q K^T`` and ``P V``), with ``K`` the keys one query scores:
  ``T`` in a full layer (the dense ``T x T`` products the code computes, masked, as torchtitan counts them),
  ``local_window + T // S`` in a compressed layer (the window and every pooled entry, masked), ``local_window``
  in a local one;
- ``unembedding``: ``6 d_model d_vocab`` at each *trained* position only (``model(..., targets=)`` unembeds
  the positions whose target is not -100: 9 of the paper task's 351), averaged over the row's tokens.

``torch.utils.flop_counter.FlopCounterMode`` measures matrix products only; the local window's scores are an
elementwise product and sum in :mod:`phaselens.models.compressed.attention`, so it does not see them
(:func:`flops_per_token` reports them apart as ``local_window``; ``tests/train/family/test_costs.py``).
Activation recompute runs each block's forward again in the backward: ``recompute`` = (dense of the
blocks + attention) / 3 per token, executed but not model FLOPs (it counts in GPU-hours, not in MFU).

**Activations** held for the backward, counted from the tensors autograd saves
(``torch.autograd.graph.saved_tensors_hooks``, distinct storages) in :mod:`phaselens.models.compressed`:
per row token and layer, in bytes of the compute dtype ``c`` (softmax probabilities and norms' ``1/rms`` in
fp32), see :func:`activation_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StepFlops:
    """FLOPs per processed token of a training step, by part (see the module docstring)."""

    dense: float
    attention: float
    local_window: float
    unembedding: float
    recompute: float  # activation recompute's second forward of the blocks (0 without it)

    @property
    def model(self) -> float:
        """Model FLOPs per token: what MFU divides by (no recompute)."""
        return self.dense + self.attention + self.local_window + self.unembedding

    @property
    def executed(self) -> float:
        """What the GPU executes per token: model FLOPs plus the recompute."""
        return self.model + self.recompute

    def to_dict(self) -> dict[str, float]:
        return {"dense": self.dense, "attention": self.attention, "local_window": self.local_window,
                "unembedding": self.unembedding, "recompute": self.recompute, "model": self.model,
                "executed": self.executed}


def layer_kinds(cfg: Any) -> list[str]:
    """``"compressed"``, ``"local"`` or ``"full"`` for every layer, as :class:`Attention` decides."""
    out = []
    for layer in range(cfg.n_layers):
        if cfg.layer_is_compressed(layer):
            out.append("compressed")
        else:
            out.append("local" if cfg.compression is not None and cfg.uncompressed_attention == "local" else "full")
    return out


def _keys(cfg: Any, kind: str, seq: int) -> tuple[int, int]:
    """``(window keys, other keys)`` one query scores in a layer of ``kind`` on rows of ``seq`` tokens."""
    if kind == "full":
        return 0, seq
    if kind == "local":
        return cfg.local_window, 0
    return cfg.local_window, seq // cfg.compression.stride


def flops_per_token(cfg: Any, parameters: int, embedding: int, *, seq: int, trained: float,
                    recompute_activations: bool = False) -> StepFlops:
    """FLOPs per processed token of a training step on rows of ``seq`` tokens with ``trained`` trained
    positions per row on average. ``parameters`` and ``embedding`` as counted on the (meta) model."""
    H, d = cfg.n_heads, cfg.d_head
    window = other = 0.0
    for kind in layer_kinds(cfg):
        w, k = _keys(cfg, kind, seq)
        window += 12 * H * d * w
        other += 12 * H * d * k
    dense = 6.0 * (parameters - embedding)
    unembed = 6.0 * cfg.d_model * cfg.d_vocab * trained / seq
    root_dense = 0.0  # the final norm's weight: outside the recomputed blocks
    recompute = (dense - root_dense + other + window) / 3 if recompute_activations else 0.0
    return StepFlops(dense, other, window, unembed, recompute)


def activation_bytes(cfg: Any, kind: str, *, rows: int, seq: int, cbytes: int, block_weights: int = 0) -> int:
    """Bytes autograd holds for one block of ``kind`` over ``rows`` rows of ``seq`` tokens.

    ``cbytes`` 4: fp32; 2: bf16 autocast (one process), where every matrix product keeps bf16 copies of its
    input and weight while norms, QK-norms, gates and softmax stay in fp32. ``block_weights``: the block's
    matrix weights (their bf16 copies are held under autocast). Counted from the saved tensors, per row token
    (``c`` = compute-dtype bytes, ``f`` = 4):

    - each norm: its input and output in fp32 and ``1/rms``; the input of each product that reads it (one
      shared fp32 tensor, or one bf16 copy per product under autocast: Q, K, V and gate, up);
    - queries and keys before and after the QK-norm (fp32) and its ``1/rms``; the query copy for the scores,
      the attention output (``H d c`` each);
    - full layers: ``K^T`` and ``V`` (``Hkv d c`` each), the fp32 probabilities and their copy for ``P V``
      (``H T (f + c)``; one tensor in fp32) and a ``T x T`` boolean mask per layer;
    - compressed layers: the window's keys and values (``2 Hkv d c``), the probabilities over window and
      entries (``H (W + E)``, ``E = T // S``), the query copy for the entries, the padded input per compressor
      path (``D c``) and per entry its windows (``S Hkv d c``), gates (``S Hkv f``), normalised rows
      (``2 Hkv d f`` + ``Hkv f``) and the entries for both products (``2 Hkv d c``);
    - the SwiGLU MLP: gate, up, ``silu(gate)`` and their product (``4 d_mlp c``; GELU: ``2 d_mlp c``);
    - per position (not per row): RoPE's fp32 tables for queries, keys and entries, the boolean masks.

    Measured (``tests/train/family/test_costs.py``): within 1% in fp32 and 3% under CPU bf16 autocast of the
    saved tensors, at the tiny and small sizes. FSDP's bf16 parameters (several GPUs) hold about the autocast
    count less the weight copies (its gathered weights are priced apart).
    """
    D, H, Hkv, d = cfg.d_model, cfg.n_heads, cfg.n_key_value_heads, cfg.d_head
    c, f = cbytes, 4
    autocast = c != f
    tied = kind == "compressed" and cfg.compression.tied_kv
    gated = cfg.mlp == "swiglu"

    def norm(readers: int) -> int:
        return 2 * D * f + f + (readers * D * c if autocast else D * f)

    per_token = norm(2 if tied else 3) + norm(2 if gated else 1) + (4 if gated else 2) * cfg.d_mlp * c
    per_token += (2 * H * d * f + H * f) if cfg.qk_norm else H * d * c  # q (+ its norm)
    per_token += (2 * Hkv * d * f + Hkv * f) if cfg.qk_norm else Hkv * d * c  # k (+ its norm)
    per_token += 2 * H * d * c  # the query for the scores, the attention output (W_O's input)
    per_position = 2 * d * f  # RoPE's tables for q and k
    w, k = _keys(cfg, kind, seq)
    probs = (f + c) if autocast else f
    if kind == "full":
        per_token += 2 * Hkv * d * c + H * seq * (f + c)  # K^T, V; probabilities and their copy for P V
        per_position += seq  # the causal mask
    else:
        per_token += 2 * Hkv * d * c + H * (w + k) * probs  # the window's keys and values (unfolded storage)
        per_position += w
    if kind == "compressed":
        S, paths = cfg.compression.stride, 1 if tied else 2
        per_token += H * d * c  # the query for the entry product
        per_entry = paths * (S * Hkv * d * c + S * Hkv * f + 2 * Hkv * d * f + Hkv * f) + 2 * Hkv * d * c
        per_token += paths * D * c + per_entry / S
        per_position += k + paths * d * f / S  # the entries' visibility mask, RoPE's tables at the entries
    weights = block_weights * c if autocast else 0
    return int(rows * seq * per_token + seq * per_position + weights)
