"""The arithmetic of DeepSeek's reference V4 inference, as mixins for transformers' DeepSeek-V4 modules.

:mod:`.numerics` swaps a module's class for ``(Mixin, transformers class)``, so the module keeps its weights,
its submodules and ``isinstance``; only ``forward`` changes. Each mixin computes what DeepSeek's
``inference/model.py`` and ``kernel.py`` compute where transformers does something else in half precision:

* :class:`ReferenceAttention`: the attention core as the ``sparse_attn`` kernel computes it: fp32 scores,
  fp32 softmax with the running max over the keys (the sink joins the denominator), the probabilities
  rounded to bf16 before they multiply the values, fp32 accumulation, one division at the end. transformers
  computes scores and softmax in bf16.
* :class:`ReferenceQueryNorm`: the queries' unweighted RMSNorm in the model dtype, as the reference writes it
  (``q * rsqrt(mean(q^2) + eps)``, every step in bf16); transformers takes the mean in fp32.
* :class:`ReferenceDecoderLayer`: the hyper-connections' ``post`` / ``comb`` mixing in fp32, rounded once;
  transformers rounds ``post`` and ``comb`` to bf16 and mixes in bf16.
* :class:`ReferenceRouter`: router logits, scores and weights in fp32 (bf16 in transformers).
* :class:`ReferenceExperts`, :class:`ReferenceSharedExpert`, :class:`ReferenceMoe`: SwiGLU in fp32, the
  routing weight applied before the down projection, routed outputs summed in fp32 with the shared expert,
  rounded once. The shared expert is **not** clamped at ``swiglu_limit`` (the reference builds it without
  the limit; transformers clamps it like the routed experts).

:func:`attention_for` tells the adapter's own attention wrappers (the pattern tap, the query engine) which
function a layer's attention runs, so they compute the same numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor

from phaselens.models.deepseek_v4.packed_modules import expert_weight
from phaselens.models.parts.numerics_deepseek import mix_streams, swiglu

# Set on the adapter's own replacements of transformers' ``eager_attention_forward`` (the pattern tap, the
# query engine): they call :func:`attention_for` themselves, so ReferenceAttention leaves them in place.
CORE_AWARE = "_phaselens_core_aware"


_FUSED: dict[str, bool] = {}  # device type -> whether torch.bmm(..., out_dtype=float32) runs there


def products(a: Float[Tensor, "B m k"], b: Float[Tensor, "B k n"]) -> Float[Tensor, "B m n"]:
    """``a @ b`` in fp32 as a kernel multiplies half-precision operands: exact products, fp32 accumulation.

    On CUDA, half-precision operands go through ``torch.bmm(..., out_dtype=torch.float32)`` (tensor cores, the
    same arithmetic up to the order of the sums) when torch offers it and no gradient is needed; elsewhere both
    are upcast first (exact: fp32 holds every product of two bf16 values).
    """
    half = a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16)
    if half and a.is_cuda and not (a.requires_grad or b.requires_grad) and _FUSED.get("cuda", True):
        try:
            return torch.bmm(a, b, out_dtype=torch.float32)
        except (RuntimeError, TypeError, NotImplementedError):
            _FUSED["cuda"] = False
    return torch.matmul(a.float(), b.float())


def reference_attention(
    module: Any,
    query: Float[Tensor, "B H n d"],
    key: Float[Tensor, "B 1 K d"],
    value: Float[Tensor, "B 1 K d"],
    attention_mask: Float[Tensor, "B 1 n K"] | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Float[Tensor, "B n H d"], Float[Tensor, "B H n K"]]:
    """V4's attention core as DeepSeek's ``sparse_attn`` kernel computes it, over the one shared K = V head.

    Returns the output ``[B, n, H, d]`` in the values' dtype and the probabilities ``[B, H, n, K]`` without the
    sink column (as transformers' eager function returns them). The probabilities that multiply the values are
    ``exp(s - max)`` rounded to the values' dtype; the denominator sums them unrounded, in fp32, with
    ``exp(sink - max)``. The kernel works through the keys in blocks of 64 with a running max; one block is
    used here, which differs from it by less than its own choice of block size does (``docs/deepseek_v4.md``).
    """
    B, H, n, d = query.shape
    # in-place steps on fresh tensors only where autograd allows it: this runs at every layer of a long prefill
    scores = products(query.reshape(B, H * n, d), key[:, 0].transpose(1, 2)).view(B, H, n, -1).mul_(scaling)
    if attention_mask is not None:
        scores = scores.add_(attention_mask.float())
    top = scores.amax(dim=-1, keepdim=True).detach()  # the kernel's max runs over the keys only; it cancels out
    p = scores.sub_(top).exp_()
    denominator = p.sum(dim=-1, keepdim=True) + torch.exp(module.sinks.float().view(1, H, 1, 1) - top)
    rounded = p.to(value.dtype)
    numerator = products(rounded.reshape(B, H * n, -1), value[:, 0]).view(B, H, n, d)
    del rounded
    out = (numerator / denominator).to(value.dtype)
    return out.transpose(1, 2).contiguous(), (p / denominator).to(value.dtype)


def attention_for(module: Any, fallback: Callable[..., Any]) -> Callable[..., Any]:
    """The attention function ``module`` (a transformers ``DeepseekV4Attention``) runs: the reference core
    once ``numerics="reference"`` swapped it, else ``fallback``."""
    return reference_attention if isinstance(module, ReferenceAttention) else fallback


def hf_module() -> Any:
    """transformers' DeepSeek-V4 modeling module."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4

    return modeling_deepseek_v4


@contextmanager
def eager_attention(replacement: Callable[..., Any]) -> Iterator[None]:
    """While active, transformers' DeepSeek-V4 attention calls ``replacement(previous, module, *args, **kwargs)``
    as its ``eager_attention_forward`` (``previous``: the function replaced, put back in ``finally``)."""
    hf = hf_module()
    previous = hf.eager_attention_forward
    installed = partial(replacement, previous)
    setattr(installed, CORE_AWARE, True)  # it decides itself what each module runs
    hf.eager_attention_forward = installed
    try:
        yield
    finally:
        hf.eager_attention_forward = previous


class ReferenceAttention:
    """For transformers' ``DeepseekV4Attention``: its attention core is :func:`reference_attention`.

    transformers' attention calls the module-level ``eager_attention_forward``; for the duration of this
    forward it is replaced by a dispatcher (restored in ``finally``), unless one of the adapter's own wrappers
    is installed, which dispatches itself.
    """

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if getattr(hf_module().eager_attention_forward, CORE_AWARE, False):
            return super().forward(*args, **kwargs)
        with eager_attention(_dispatch):
            return super().forward(*args, **kwargs)


def _dispatch(previous: Callable[..., Any], module: Any, *args: Any, **kwargs: Any) -> Any:
    return attention_for(module, previous)(module, *args, **kwargs)


class ReferenceQueryNorm:
    """For the queries' ``DeepseekV4UnweightedRMSNorm``: ``x * rsqrt(mean(x^2) + eps)`` in ``x``'s dtype."""

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.variance_epsilon)


class ReferenceDecoderLayer:
    """For ``DeepseekV4DecoderLayer``: the same submodules in the same order, mixed by
    :func:`~phaselens.models.parts.numerics_deepseek.mix_streams` (fp32)."""

    def forward(self, hidden_states: Tensor, input_ids: Tensor | None = None, **kwargs: Any) -> Tensor:
        post, comb, collapsed = self.attn_hc(hidden_states)
        attn_output, _ = self.self_attn(self.input_layernorm(collapsed), **kwargs)
        hidden_states = mix_streams(attn_output, hidden_states, post, comb)
        post, comb, collapsed = self.ffn_hc(hidden_states)
        mlp_output = self.mlp(self.post_attention_layernorm(collapsed), input_ids=input_ids)
        return mix_streams(mlp_output, hidden_states, post, comb)


class ReferenceRouter:
    """For ``DeepseekV4TopKRouter`` / ``DeepseekV4HashRouter``: logits ``x W^T`` in fp32 from the bf16
    weights, scores, normalised weights and scaling in fp32; hash routers read ``tid2eid`` as before."""

    def forward(self, hidden_states: Tensor, input_ids: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        flat = hidden_states.reshape(-1, self.hidden_dim)
        logits = F.linear(flat.float(), self.weight.float())
        scores = self.score_fn(logits)
        if hasattr(self, "tid2eid"):
            indices = self.tid2eid[input_ids.reshape(-1)].long()
        else:
            indices = torch.topk(scores + self.e_score_correction_bias.float(), self.top_k, dim=-1).indices
        weights = scores.gather(1, indices)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights * self.routed_scaling_factor, indices


class ReferenceExperts:
    """For ``DeepseekV4Experts``: per expert (in index order) ``w2((weight * swiglu(w1 x, w3 x)).to(bf16))``,
    summed into an fp32 ``[N, D]`` (what :class:`ReferenceMoe` expects; not rounded here)."""

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
        inter = self.gate_up_proj.shape[1] // 2
        for e in top_k_index.unique().tolist():  # the experts hit: a dispatch, as in transformers
            if not 0 <= e < self.num_experts:
                continue
            token, slot = torch.where(top_k_index == e)
            x = hidden_states[token]
            w = expert_weight(self, "gate_up_proj", e, x.dtype)  # decoded when FP8Experts keeps it packed
            h = swiglu(F.linear(x, w[:inter]).float(), F.linear(x, w[inter:]).float(), float(self.limit), self.act_fn)
            h = top_k_weights[token, slot, None].float() * h
            out.index_add_(0, token, F.linear(h.to(x.dtype), expert_weight(self, "down_proj", e, x.dtype)).float())
        return out


class ReferenceSharedExpert:
    """For the shared expert (``DeepseekV4MLP``): fp32 SwiGLU, **no clamp** (the reference builds its shared
    expert without ``swiglu_limit``), down projection in the model dtype."""

    def forward(self, x: Tensor) -> Tensor:
        h = swiglu(self.gate_proj(x).float(), self.up_proj(x).float(), 0.0, self.act_fn)
        return self.down_proj(h.to(x.dtype))


class ReferenceMoe:
    """For ``DeepseekV4SparseMoeBlock``: routed experts (fp32 sum) plus the shared expert, in fp32, rounded
    once to the input's dtype."""

    def forward(self, hidden_states: Tensor, input_ids: Tensor | None = None) -> Tensor:
        B, S, D = hidden_states.shape
        flat = hidden_states.reshape(-1, D)
        _, weights, indices = self.gate(hidden_states, input_ids)  # a ReferenceRouter: hash or not
        routed = self.experts(flat, indices, weights).float()
        return (routed + self.shared_experts(flat).float()).view(B, S, D).to(hidden_states.dtype)
