"""TransformerLens's per-head pre-norm Q/K/V inputs (``set_use_split_qkv_input``), what
``transformer_lens.patching.get_act_patch_direct_path`` needs (issue 46, item 3).

With the flag on, ``blocks.{l}.attn.hook_q_input`` / ``hook_k_input`` / ``hook_v_input`` are hook names of
shape ``[batch, pos, n_heads, d_model]``: the residual entering block ``l`` (``hook_resid_pre``), one copy per
head. A hook that edits head ``h``'s copy changes only that head's query (key, value): the model computes it
as ``post(ln1(copy_h) @ W_Q[h] + b_Q[h])`` (``post``: the QK-norm where the kind has one) and writes it into
``hook_q`` (``hook_k``, ``hook_v``) for that head; heads whose copy is unchanged keep the model's own value
bit for bit. The names are carried by hooks on ``hook_resid_pre`` and ``hook_q`` (``k``, ``v``), so they
work on every kind that has those sites and TransformerLens weight views, without a second forward.

Refused with a :class:`~.tl_weights.SurfaceError`: ``k`` / ``v`` where keys and values are one tensor
(``hook_kv``: a tied compressor layer) or where key heads are shared (GQA; TransformerLens refuses it too).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from phaselens.contract.protocol import hook_pairs
from phaselens.models.parts.tl_weights import SurfaceError

_INPUT = re.compile(r"^blocks\.(\d+)\.attn\.hook_([qkv])_input$")


class SplitQKV:
    """Mixin (before the kind's hook machinery) giving ``set_use_split_qkv_input`` and the three fork names.

    The kind provides :meth:`_split_parts` ``(layer, c) -> (ln1, W [heads, D, d], b [heads, d] | None, post)``."""

    def set_use_split_qkv_input(self, use_split_qkv_input: bool) -> None:
        """Expose ``blocks.{l}.attn.hook_{q,k,v}_input`` (``True``) or not (``False``)."""
        self.__dict__["_tl_split_qkv"] = bool(use_split_qkv_input)

    def set_use_attn_in(self, use_attn_in: bool) -> None:
        if use_attn_in:
            raise SurfaceError("use_attn_in (hook_attn_in) is not provided; use set_use_split_qkv_input(True), whose "
                               "hook_q_input / hook_k_input / hook_v_input fork the same residual per head.")

    def set_use_attn_result(self, use_attn_result: bool) -> None:
        """TransformerLens's flag for ``hook_result``: phaselens computes it from ``hook_z`` and ``W_O``
        (``cache.compute_head_results()``), so the flag changes nothing."""

    @contextlib.contextmanager
    def hooks(self, fwd_hooks: Any = (), *args: Any, **kwargs: Any) -> Iterator[Any]:
        """The kind's ``hooks`` context, with ``hook_{q,k,v}_input`` pairs carried as described above."""
        with super().hooks(self._translate_split(fwd_hooks), *args, **kwargs) as model:  # type: ignore[misc]
            yield model

    def _split_parts(self, layer: int, c: str) -> tuple[Any, Tensor, Tensor | None, Callable[[Tensor], Tensor]]:
        raise NotImplementedError

    def _translate_split(self, fwd_hooks: Any) -> list[tuple[Any, Any]]:
        """``fwd_hooks`` with every ``hook_{c}_input`` pair replaced by the pair of hooks that carry it."""
        pairs = list(hook_pairs(fwd_hooks))
        if not any(isinstance(n, str) and _INPUT.match(n) for n, _ in pairs):
            return pairs
        if not self.__dict__.get("_tl_split_qkv", False):
            name = next(n for n, _ in pairs if isinstance(n, str) and _INPUT.match(n))
            raise SurfaceError(f"{name} exists only after model.set_use_split_qkv_input(True) (TransformerLens's "
                               "flag for the per-head pre-norm Q/K/V inputs).")
        out: list[tuple[Any, Any]] = []
        for name, fn in pairs:
            m = _INPUT.match(name) if isinstance(name, str) else None
            if m is None:
                out.append((name, fn))
                continue
            layer, c = int(m.group(1)), m.group(2)
            out.extend(self._fork_hooks(layer, c, fn))
        return out

    def _fork_hooks(self, layer: int, c: str, fn: Any) -> list[tuple[str, Any]]:
        site = f"blocks.{layer}.attn.hook_{c}"  # head-wise c in layer
        if site not in self.hook_dict:  # type: ignore[attr-defined]
            raise SurfaceError(f"blocks.{layer}.attn.hook_{c}_input: layer {layer} has no separate hook_{c} (keys "
                               "and values are one tensor there, hook_kv), so a fork of one of them alone does not "
                               "exist; use component='q'.")
        cfg = self.cfg  # type: ignore[attr-defined]
        if c != "q" and cfg.n_key_value_heads != cfg.n_heads:
            raise SurfaceError(f"hook_{c}_input on a model with {cfg.n_key_value_heads} key-value heads for "
                               f"{cfg.n_heads} query heads (GQA): one key/value head serves several query heads, "
                               "so a per-query-head input does not exist (TransformerLens refuses it too); use 'q'.")
        ln1, weight, bias, post = self._split_parts(layer, c)
        state: dict[str, Tensor] = {}

        def capture(x: Tensor, hook: Any) -> None:
            state["x"] = x

        def replace(value: Tensor, hook: Any) -> Tensor | None:
            x = state.pop("x")
            heads = value.shape[-2]
            plain = x[:, :, None, :].expand(*x.shape[:2], heads, x.shape[-1])
            fork = plain.clone()
            got = fn(fork, hook=hook)
            fork = fork if got is None else got
            changed = (fork != plain).flatten(start_dim=-1).any(-1).flatten(end_dim=1).any(0)  # [heads]
            if not bool(changed.any()):
                return None
            idx = changed.nonzero()[:, 0]
            proj = torch.einsum("bnhm,hmd->bnhd", ln1(fork[:, :, idx]), weight[idx].to(value.dtype))
            own = post(proj if bias is None else proj + bias[idx].to(proj.dtype))
            new = value.clone()
            new[:, :, idx] = own.to(value.dtype)
            return new

        return [(f"blocks.{layer}.hook_resid_pre", capture), (site, replace)]


class FlatSplitQKV(SplitQKV):
    """:class:`SplitQKV` of a kind whose blocks are ``ln1`` + an attention with :class:`~.tl_weights.TLFlatAttention`
    views and a ``_norm(x, gain)`` QK-norm (the zoo)."""

    def _split_parts(self, layer: int, c: str) -> tuple[Any, Tensor, Tensor | None, Callable[[Tensor], Tensor]]:
        block = self.blocks[layer]  # type: ignore[attr-defined]
        attn = block.attn
        weight = {"q": attn.W_Q, "k": attn.W_K_kv, "v": attn.W_V_kv}[c]
        gain = {"q": attn.q_norm, "k": attn.k_norm, "v": None}[c]
        return block.ln1, weight, None, ((lambda t: t) if gain is None else lambda t: attn._norm(t, gain))
