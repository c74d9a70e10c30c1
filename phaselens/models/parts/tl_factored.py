"""TransformerLens's weight names on the DeepSeek-V4 kinds (the V4 adapter and V4.1), which cannot give them
(issue 46, item 1): each is a :class:`~phaselens.models.parts.tl_weights.SurfaceError` naming the factors the
model has instead and what to use.

* ``W_Q``: ``q_a`` (``D -> q_lora_rank``), an RMSNorm, then ``q_b`` (``-> H * d``): the norm between the factors
  makes the query a nonlinear function of the residual, so there is no ``[H, D, d]`` matrix.
* ``W_K`` / ``W_V``: one key-value head ``kv`` (``D -> d``) followed by an RMSNorm (``kv_norm``): no matrix either.
* ``W_O``: grouped low-rank ``o_a`` (``o_groups`` blocks, ``H * d / o_groups -> o_lora_rank`` each) then ``o_b``,
  stored FP8 with block scales; its product is not formed (it would be ``H * d * D`` dequantised values per layer).
* MLPs are mixtures of experts: no single ``W_in`` / ``W_out`` (TransformerLens refuses neuron functions there too).
"""

from __future__ import annotations

from typing import Any

from phaselens.models.parts.tl_weights import ExplainedAttributes, SurfaceError

WHY = {
    "W_Q": "the query is q_b(rms_norm(q_a(x))) with an RMSNorm between its two low-rank factors (q_a: d_model -> "
           "q_lora_rank, q_b: -> n_heads * d_head), so it is no matrix; read blocks.{l}.attn.hook_q instead.",
    "W_K": "keys and values share one head, kv_norm(kv(x)) (kv: d_model -> d_head, then an RMSNorm), so there is no "
           "matrix; read blocks.{l}.attn.hook_kv instead.",
    "W_O": "the output is the grouped low-rank product o_b(o_a(z)) (o_a: o_groups blocks of n_heads * d_head / "
           "o_groups -> o_lora_rank, o_b: -> d_model), stored FP8 with block scales; phaselens does not form it. "
           "Read blocks.{l}.attn.hook_z per head and blocks.{l}.hook_attn_out, or patch hook_z.",
    "b": "the DeepSeek-V4 projections have no biases, and the residual is hc_mult hyper-connection streams.",
    "mlp": "its MLP is a mixture of experts (routed experts plus a shared expert): there is no single W_in/W_out "
           "and no neuron hook, as in TransformerLens; read blocks.{l}.hook_mlp_out.",
}
WHY["W_V"] = WHY["W_K"]


def _refusing(name: str) -> property:
    key = name if name in WHY else "b" if name in ("b_Q", "b_K", "b_V", "b_O") else "mlp"

    def get(self: Any) -> Any:
        raise SurfaceError(f"blocks[{self.layer}].{'attn' if key != 'mlp' else 'mlp'}.{name} does not exist on "
                           "DeepSeek-V4: " + WHY[key].replace("{l}", str(self.layer)))

    return property(get, doc=f"TransformerLens's {name}: a SurfaceError on DeepSeek-V4 (see the module).")


class FactoredAttentionNames(ExplainedAttributes):
    """Mixin of a DeepSeek-V4 attention (``self.layer`` its index): TransformerLens's weight names raise a
    :class:`SurfaceError` naming the factors."""

    W_Q, W_K, W_V, W_O = (_refusing(n) for n in ("W_Q", "W_K", "W_V", "W_O"))
    b_Q, b_K, b_V, b_O = (_refusing(n) for n in ("b_Q", "b_K", "b_V", "b_O"))


class MoENames(ExplainedAttributes):
    """A DeepSeek-V4 layer's MLP under TransformerLens's names: every weight name is a :class:`SurfaceError`."""

    W_in, W_gate, W_out, b_in, b_out = (_refusing(n) for n in ("W_in", "W_gate", "W_out", "b_in", "b_out"))

    def __init__(self, layer: int) -> None:
        self.layer = layer


class FactoredAttention(FactoredAttentionNames):
    def __init__(self, layer: int) -> None:
        self.layer = layer


class FactoredBlock:
    """``blocks[l]`` of the DeepSeek-V4 adapter: ``attn`` and ``mlp`` whose TransformerLens weight names refuse."""

    hook_out_is_single_residual_stream = False  # hc_mult streams (TransformerLens's logit_lens reads this)

    def __init__(self, layer: int) -> None:
        self.layer = layer
        self.attn = FactoredAttention(layer)
        self.mlp = MoENames(layer)


class FactoredBlockNames(ExplainedAttributes):
    """Mixin of a DeepSeek-V4.1 block (``self.attn.layer``): ``mlp`` is the MoE's TransformerLens view."""

    @property
    def mlp(self) -> MoENames:
        return MoENames(self.attn.layer)  # type: ignore[attr-defined]


class HyperConnectionModel(ExplainedAttributes):
    """Mixin of the DeepSeek-V4 kinds' models: the model-level names TransformerLens reads, refused with why."""

    def accumulated_bias(self, layer: int, mlp_input: bool = False, include_mlp_biases: bool = True) -> Any:
        raise SurfaceError("accumulated_bias does not apply to DeepSeek-V4: its residual is hc_mult hyper-connection "
                           "streams mixed by input-dependent weights, so biases do not accumulate additively (and "
                           "its projections have none); decompose the residual with accumulated_resid() instead.")

    @property
    def W_pos(self) -> Any:
        raise SurfaceError("W_pos: DeepSeek-V4 has no learned position embedding (RoPE inside attention).")
