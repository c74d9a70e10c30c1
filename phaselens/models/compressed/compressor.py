"""The chunked KV compressor: gated pooling of W slots into one cache entry every S slots.

For entry j with window slots ``i = 0..W-1`` (science.md §2)::

    logits  s_{j,i} = Z_i h_{j,i} + b_i          (per KV head, or per channel)
    alpha_j         = softmax_i(s_{j,i})         (slots before the origin get weight 0)
    entry_j         = sum_i alpha_{j,i} * C_i h_{j,i}   -> optional RMSNorm -> RoPE at slot jS

Slots are indexed as ``(group g, phase p)`` with ``i = g*S + p`` and ``k = W/S`` groups; group g of entry
j lies in stride block ``j - (k-1) + g``. A projection is *grouped* when each group has its own map (the
DeepSeek-V4 CSA ``overlap_split`` layout, where group 0 is the Ca half and group 1 the Cb half) and
*per-phase* when each phase has its own map (``per_offset``).

The compressor streams: it takes any run of new tokens plus a :class:`PoolerState` holding the
projections of tokens whose entries are not complete yet, so a parallel forward and a token-by-token
decode go through the same arithmetic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn

from phaselens.errors import CacheError
from phaselens.models.compressed.config import CompressorSpec, RopeSpec, YarnSpec
from phaselens.models.parts.dtypes import compute_dtype
from phaselens.models.parts.norms import rms_norm
from phaselens.models.parts.rope import apply_rope


@dataclass
class PoolerState:
    """Projections carried across calls for one pooling path (tensors may be views into cache storage).

    Shapes (C = projection channels): ``cur_*`` ``[B, G, S, C]`` holds the current, incomplete stride block
    (its first ``start % S`` phases are filled); ``prev_*`` ``[B, k-1, G', S, C]`` holds the last ``k-1``
    complete blocks, keeping only the groups later entries still read (``G' = 1`` when projections are
    not grouped, else ``k-1``: for DeepSeek-V4 CSA that is the previous block's Ca half).
    """

    cur_payload: Tensor
    prev_payload: Tensor
    cur_logit: Tensor | None
    prev_logit: Tensor | None


class GroupedProjection(nn.Module):
    """``d_model -> out`` maps indexed by (group, phase); either index may be shared (size 1).

    ``weight``: ``[groups, phases, d_model, out]``.
    """

    def __init__(self, groups: int, phases: int, d_model: int, out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(groups, phases, d_model, out))

    def forward(self, x_blocks: Float[Tensor, "batch block phase d_model"]) -> Float[Tensor, "batch block group phase out"]:
        if self.weight.shape[1] == 1:
            return torch.einsum("bnsm,gmo->bngso", x_blocks, self.weight[:, 0])
        return torch.einsum("bnsm,gsmo->bngso", x_blocks, self.weight)


class Pooler(nn.Module):
    """One gated pooling path (keys, values, or the tied K=V latent)."""

    def __init__(self, spec: CompressorSpec, d_model: int, n_kv_heads: int, d_head: int) -> None:
        super().__init__()
        self.spec = spec
        self.stride, self.k = spec.stride, spec.blocks_per_window
        self.n_kv_heads, self.d_head = n_kv_heads, d_head
        grouped = spec.overlap_split
        p_groups = self.k if grouped or spec.payload == "per_offset" else 1
        p_phases = self.stride if spec.payload == "per_offset" else 1
        # payload="attention": the layer's own keys/values are the payload (passed to `gates`), no projection
        self.payload: GroupedProjection | None = None
        if spec.payload != "attention":
            self.payload = GroupedProjection(p_groups, p_phases, d_model, n_kv_heads * d_head)
        self.gate_channels = 0
        self.gate: GroupedProjection | None = None
        self.position_bias: nn.Parameter | None = None
        if spec.gate != "uniform":
            self.gate_channels = n_kv_heads * (d_head if spec.gate == "vector" else 1)
            g_groups = self.k if grouped or spec.gate_params == "per_offset" else 1
            g_phases = self.stride if spec.gate_params == "per_offset" else 1
            self.gate = GroupedProjection(g_groups, g_phases, d_model, self.gate_channels)
            if spec.position_bias:
                # [group, phase, channel]: the bias of slot i = group * S + phase.
                self.position_bias = nn.Parameter(torch.zeros(self.k, self.stride, self.gate_channels))

    # ---- state ---------------------------------------------------------------------------------------
    def _prev_groups(self, groups: int) -> int:
        return 1 if groups == 1 else self.k - 1

    def state_shapes(self, batch: int) -> list[tuple[int, ...] | None]:
        """Shapes of :meth:`empty_state`'s tensors (cur/prev payload, cur/prev gate logits; ``None`` without
        gates): ``[batch, groups, S, channels]`` and ``[batch, k - 1, groups', S, channels]``."""
        S, k = self.stride, self.k
        p_groups, p_channels = (1, self.n_kv_heads * self.d_head) if self.payload is None else (
            self.payload.weight.shape[0], self.payload.weight.shape[-1])
        out: list[tuple[int, ...] | None] = [(batch, p_groups, S, p_channels),
                                             (batch, k - 1, self._prev_groups(p_groups), S, p_channels)]
        if self.gate is None:
            return out + [None, None]
        g_groups = self.gate.weight.shape[0]
        return out + [(batch, g_groups, S, self.gate_channels),
                      (batch, k - 1, self._prev_groups(g_groups), S, self.gate_channels)]

    def empty_state(self, batch: int, *, device: torch.device | str, dtype: torch.dtype) -> PoolerState:
        """Preallocated, zeroed state for ``batch`` sequences (shapes: :meth:`state_shapes`)."""
        return PoolerState(*(None if shape is None else torch.zeros(shape, device=device, dtype=dtype)
                             for shape in self.state_shapes(batch)))

    # ---- streaming -----------------------------------------------------------------------------------
    def gates(
        self, x: Float[Tensor, "batch pos d_model"], start: int, state: PoolerState | None,
        tokens: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, PoolerState, int]:
        """Project new tokens and assemble the windows of every entry that completes among them.

        Args:
            x: hidden states of slots ``start .. start + pos - 1`` (slots relative to the origin).
            start: the slot of ``x[:, 0]``.
            state: projections of earlier tokens, or ``None`` when ``start`` is 0.
            tokens: ``[B, pos, Hkv * d]`` the layer's own keys or values of the same slots: the payload when
                ``spec.payload == "attention"`` (ignored otherwise).

        Returns:
            ``(alpha, payload, new_state, first_entry)``: gate weights ``[B, E, W, Hkv]`` (scalar/uniform) or
            ``[B, E, W, Hkv, d]`` (vector); windowed payload ``[B, E, W, Hkv, d]``; the state after these
            tokens (fresh tensors; ``state`` is not written); the index of the first new entry.
        """
        S, k = self.stride, self.k
        B, n, _ = x.shape
        filled = start % S
        if filled and state is None:
            raise CacheError(
                f"slot {start} is inside a stride block, so the projections of the block's earlier tokens are "
                "needed: continue from the cache that holds them, or start at slot 0."
            )
        total = filled + n
        n_blocks, n_done = -(-total // S), total // S
        x_blocks = F.pad(x, (0, 0, filled, n_blocks * S - total)).view(B, n_blocks, S, -1)

        if self.payload is None:
            if tokens is None:
                raise ValueError("payload='attention' pools the layer's keys/values: pass them as tokens=")
            payload = F.pad(tokens, (0, 0, filled, n_blocks * S - total)).view(B, n_blocks, 1, S, -1)
        else:
            payload = self.payload(x_blocks)  # [B, nb, Gp, S, C]
        if filled:
            payload = _overwrite_head(payload, state.cur_payload, filled)
        windows_p, state_p = self._advance(payload, state.prev_payload if state else None, n_done, total)

        if self.gate is not None:
            logit = self.gate(x_blocks)
            if filled:
                logit = _overwrite_head(logit, state.cur_logit, filled)
            windows_g, state_g = self._advance(logit, state.prev_logit if state else None, n_done, total)
        else:  # uniform pooling: equal logits, so softmax gives the mean over valid slots
            windows_g, state_g = x.new_zeros(1, 1, 1, 1, self.n_kv_heads), (None, None)
        if self.position_bias is not None:
            windows_g = windows_g + self.position_bias

        first_entry = start // S
        E = n_done
        # Slots in blocks before the origin get weight 0 (logit -inf), like DeepSeek-V4's entry 0.
        block_of_slot = first_entry + torch.arange(E, device=x.device)[:, None] - (k - 1)
        block_of_slot = block_of_slot + torch.arange(k, device=x.device)
        valid = (block_of_slot >= 0)[None, :, :, None, None]  # [1, E, k, 1, 1]
        C = windows_g.shape[-1]
        windows_g = windows_g.expand(B, E, k, S, C).masked_fill(~valid, float("-inf"))
        alpha = windows_g.reshape(B, E, k * S, C).to(compute_dtype(x.dtype)).softmax(dim=2).to(x.dtype)
        alpha = alpha.unflatten(-1, (self.n_kv_heads, -1))
        if self.spec.gate != "vector":
            alpha = alpha.squeeze(-1)
        windows_p = windows_p.expand(B, E, k, S, windows_p.shape[-1])
        windows_p = windows_p.reshape(B, E, k * S, self.n_kv_heads, self.d_head)
        new_state = PoolerState(state_p[0], state_p[1], state_g[0], state_g[1])
        return alpha, windows_p, new_state, first_entry

    def _advance(
        self, proj: Tensor, stored_prev: Tensor | None, n_done: int, total: int
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """Windows of the completed blocks, and the (cur, prev) state left after them."""
        k = self.k
        blocks = torch.cat([self._prev_blocks(stored_prev, proj), proj[:, :n_done]], dim=1)
        windows = _windows(blocks, k)  # [B, n_done, k, S, C]
        cur = proj[:, n_done] if total % self.stride else torch.zeros_like(proj[:, 0])
        prev = blocks[:, blocks.shape[1] - (k - 1) :, : self._prev_groups(proj.shape[2])]
        return windows, (cur, prev)

    def _prev_blocks(self, stored: Tensor | None, like: Tensor) -> Tensor:
        """The k-1 blocks before the first new one, padded to ``like``'s group count: ``[B, k-1, G, S, C]``."""
        B, _, G, S, C = like.shape
        out = like.new_zeros(B, self.k - 1, G, S, C)
        if stored is not None and self.k > 1:
            out[:, :, : stored.shape[2]] = stored
        return out

    @staticmethod
    def pool(alpha: Tensor, windows_p: Float[Tensor, "batch entry slot kv d"]) -> Float[Tensor, "batch entry kv d"]:
        """Weighted sum over slots: ``sum_i alpha_i * payload_i``."""
        if alpha.dim() == 4:
            alpha = alpha.unsqueeze(-1)
        return (windows_p * alpha).sum(dim=2)


def _overwrite_head(new: Tensor, cur: Tensor, filled: int) -> Tensor:
    """``new`` ``[B, nb, G, S, C]`` with block 0's first ``filled`` phases taken from ``cur`` ``[B, G, S, C]``."""
    head = torch.cat([cur[:, :, :filled], new[:, 0, :, filled:]], dim=2)
    return torch.cat([head[:, None], new[:, 1:]], dim=1)


def _windows(blocks: Tensor, k: int) -> Tensor:
    """Windows of k consecutive blocks: ``[B, n+k-1, G, S, C] -> [B, n, k, S, C]``.

    Slot group g of window j reads block ``j + g``, and group ``g`` of it when projections are grouped
    (``G == k``) or the one shared group (``G == 1``).
    """
    B, nk, G, S, C = blocks.shape
    if nk < k:  # no window completes
        return blocks.new_zeros(B, 0, k, S, C)
    win = blocks.unfold(1, k, 1)  # [B, n, G, S, C, k]
    if G == 1:
        return win.squeeze(2).permute(0, 1, 4, 2, 3)
    return win.diagonal(dim1=2, dim2=5).permute(0, 1, 4, 2, 3)  # [B, n, S, C, k] -> [B, n, k, S, C]


class Compressor(nn.Module):
    """Keys and values (or the tied K=V latent) of a compressed layer, pooled into cache entries.

    Paths are ``("k", "v")``, or ``("kv",)`` when ``spec.tied_kv``. RoPE applies to the key path (and to the
    tied latent), at slot ``jS`` for entry j, the first slot of its own stride block.

    Load a transformers DeepSeek-V4 compressor with :meth:`from_hf`.
    """

    def __init__(
        self, spec: CompressorSpec, d_model: int, n_kv_heads: int, d_head: int, model_rope: RopeSpec | None
    ) -> None:
        super().__init__()
        self.spec = spec
        self.d_head = d_head
        self.paths: tuple[str, ...] = ("kv",) if spec.tied_kv else ("k", "v")
        self.poolers = nn.ModuleDict({p: Pooler(spec, d_model, n_kv_heads, d_head) for p in self.paths})
        self.norm_weight = (
            nn.ParameterDict({p: nn.Parameter(torch.ones(d_head)) for p in self.paths}) if spec.norm else None
        )
        rope = model_rope if spec.rope == "inherit" else (spec.rope if isinstance(spec.rope, RopeSpec) else None)
        self.rope_spec = rope
        self.register_buffer("inv_freq", torch.zeros(0) if rope is None else rope.inv_freq(d_head))
        yarn = None if rope is None else rope.yarn
        self.attention_scaling = 1.0 if yarn is None else yarn.attention_factor

    @property
    def stride(self) -> int:
        return self.spec.stride

    def rotated(self, path: str) -> bool:
        return self.inv_freq.numel() > 0 and path in ("k", "kv")

    def finish(self, path: str, pooled: Float[Tensor, "batch entry kv d"], first_entry: int) -> Tensor:
        """RMSNorm (if configured) and RoPE at each entry's block start. ``[B, E, Hkv, d]`` in and out."""
        if self.norm_weight is not None:
            pooled = rms_norm(pooled, self.norm_weight[path], self.spec.norm_eps)
        if self.rotated(path):
            positions = (first_entry + torch.arange(pooled.shape[1], device=pooled.device)) * self.stride
            pooled = apply_rope(pooled, positions, self.inv_freq, attention_scaling=self.attention_scaling,
                                style=self.rope_spec.style if self.rope_spec is not None else "interleaved")
        return pooled

    def compress_sequence(self, hidden: Float[Tensor, "batch pos d_model"],
                          tokens: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
        """Entries ``[B, T // S, Hkv, d]`` of every complete block of a sequence starting at slot 0 (``tokens``:
        the layer's keys/values ``[B, T, Hkv * d]`` per path, for ``payload="attention"``)."""
        out = {}
        for path in self.paths:
            alpha, windows, _, first = self.poolers[path].gates(hidden, 0, None, (tokens or {}).get(path))
            out[path] = self.finish(path, Pooler.pool(alpha, windows), first)
        return out

    # ---- transformers interop ------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, module: nn.Module) -> Compressor:
        """Build from a transformers ``DeepseekV4CSACompressor`` or ``DeepseekV4HCACompressor``.

        The weights are copied (``kv_proj`` / ``gate_proj`` split into their Ca | Cb groups for CSA,
        ``position_bias`` to ``[group, phase, channel]``, ``kv_norm``), and so are the compressed-path
        RoPE frequencies and scaling: they are not recomputed, so YaRN settings carry over exactly. The
        indexer of a CSA compressor is not part of the pooled rows and is not copied.
        """
        overlap = hasattr(module, "indexer")
        S, d = int(module.compress_rate), int(module.head_dim)
        d_model = int(module.kv_proj.in_features)
        groups = 2 if overlap else 1
        rot = module.rotary_emb
        inv_freq = getattr(rot, f"{module.rope_layer_type}_inv_freq")
        params = rot.config.rope_parameters[module.rope_layer_type]
        yarn = None
        if params.get("rope_type") == "yarn":
            yarn = YarnSpec(
                factor=float(params["factor"]),
                original_max_position=int(params["original_max_position_embeddings"]),
                beta_fast=float(params.get("beta_fast") or 32.0),
                beta_slow=float(params.get("beta_slow") or 1.0),
                attention_factor=float(getattr(rot, f"{module.rope_layer_type}_attention_scaling")),
            )
        spec = CompressorSpec(
            stride=S,
            window=groups * S,
            gate="vector",
            gate_params="shared",
            position_bias=True,
            payload="shared",
            tied_kv=True,
            norm=True,
            rope=RopeSpec(dims=2 * inv_freq.numel(), theta=float(params["rope_theta"]), yarn=yarn),
            overlap_split=overlap,
            norm_eps=float(module.kv_norm.variance_epsilon),
        )
        comp = cls(spec, d_model, 1, d, None)
        pooler = comp.poolers["kv"]
        with torch.no_grad():
            for ours, theirs in ((pooler.payload, module.kv_proj), (pooler.gate, module.gate_proj)):
                w = theirs.weight.detach().float().view(groups, d, d_model).transpose(1, 2)
                ours.weight.copy_(w.unsqueeze(1))
            bias = module.position_bias.detach().float().view(S, groups, d).permute(1, 0, 2)
            pooler.position_bias.copy_(bias)
            comp.norm_weight["kv"].copy_(module.kv_norm.weight.detach().float())
            comp.inv_freq = inv_freq.detach().float().clone()
        comp.attention_scaling = float(getattr(rot, f"{module.rope_layer_type}_attention_scaling"))
        return comp


def default_init_(module: nn.Module, std: float, generator: torch.Generator) -> None:
    """Deterministic init for a generator: normal weights (std, capped at 1/sqrt(fan_in)), zero biases and
    position biases, unit gains for every RMSNorm (including the compressor's entry norms and the QK-norms).
    A tied embedding is drawn once (``named_parameters`` lists a shared parameter once)."""
    unit = set()
    for mod in module.modules():
        if type(mod).__name__ == "RMSNorm":
            unit.add(id(mod.weight))
        if isinstance(mod, Compressor) and mod.norm_weight is not None:
            unit.update(id(p) for p in mod.norm_weight.values())
    for name, p in module.named_parameters():
        with torch.no_grad():
            if id(p) in unit or name.rsplit(".", 1)[-1] in ("q_norm", "k_norm"):
                p.fill_(1.0)
            elif name.endswith("position_bias") or name.split(".")[-1].startswith("b_") or p.dim() < 2:
                p.zero_()
            else:
                scale = min(std, 1.0 / math.sqrt(p.shape[-2]))
                p.copy_(torch.randn(p.shape, generator=generator) * scale)
