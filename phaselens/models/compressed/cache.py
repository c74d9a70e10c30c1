"""``CompressedKVCache``: a real compressed KV cache for :class:`CompressedTransformer`.

Per layer it stores, in buffers preallocated once:

* compressed layers: the completed entries ``[B, max_len // S, Hkv, d]`` (keys and values, or one tensor
  when K = V), the last ``local_window - 1`` raw keys/values in a ring buffer, and the projections of
  tokens whose entries are still open (the current partial stride block, plus the previous block's
  groups that later entries read: for DeepSeek-V4 CSA, the previous block's Ca half);
* sliding-only layers: the ring buffer alone;
* full-attention layers: every raw key and value.

Decoding through the cache gives the same logits as a parallel forward over the whole sequence.
"""

from __future__ import annotations

import numbers
import weakref
from typing import TYPE_CHECKING, SupportsInt

import torch
from torch import Tensor, nn

from phaselens.errors import CacheError
from phaselens.models.compressed.compressor import PoolerState
from phaselens.models.compressed.sizing import check_cache, layer_shapes

if TYPE_CHECKING:
    from phaselens.models.compressed.attention import Attention


class LayerCache:
    """Storage of one layer; implements the attention's ``Past`` protocol against that storage."""

    def __init__(self, attn: Attention, batch: int, max_len: int, dtype: torch.dtype, device: torch.device) -> None:
        self.kind = attn.kind
        self.start = 0
        shapes = layer_shapes(attn, batch, max_len)
        self.ring = shapes["raw_k"][1]  # rows of raw storage
        self.raw_k = torch.zeros(shapes["raw_k"], dtype=dtype, device=device)
        self.raw_v = None if attn.tied else torch.zeros_like(self.raw_k)
        self.entry_store: dict[str, Tensor] = {}
        self.n_entries: dict[str, int] = {}
        self.states: dict[str, PoolerState] = {}
        if attn.compressor is not None:
            for path, pooler in attn.compressor.poolers.items():
                self.entry_store[path] = torch.zeros(shapes[f"entries_{path}"], dtype=dtype, device=device)
                self.n_entries[path] = 0
                self.states[path] = pooler.empty_state(batch, device=device, dtype=dtype)

    # ---- Past protocol -------------------------------------------------------------------------------
    def raw_context(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        n, start = k.shape[1], self.start
        if self.kind == "full":
            self.raw_k[:, start : start + n] = k
            if self.raw_v is not None:
                self.raw_v[:, start : start + n] = v
            keys = self.raw_k[:, : start + n]
            return keys, (self.raw_v[:, : start + n] if self.raw_v is not None else keys)
        R = self.ring
        if R == 0:
            return k, v
        tail_slots = torch.arange(max(0, start - R), start, device=k.device)
        keys = torch.cat([self.raw_k.index_select(1, tail_slots % R), k], dim=1)
        values = keys if self.raw_v is None else torch.cat([self.raw_v.index_select(1, tail_slots % R), v], dim=1)
        keep = min(n, R)  # only the last R new rows can still be read
        new_slots = torch.arange(start + n - keep, start + n, device=k.device) % R
        self.raw_k.index_copy_(1, new_slots, k[:, n - keep :])
        if self.raw_v is not None:
            self.raw_v.index_copy_(1, new_slots, v[:, n - keep :])
        return keys, values

    def entries(self, path: str, new: Tensor) -> Tensor:
        store, have = self.entry_store[path], self.n_entries[path]
        end = have + new.shape[1]
        store[:, :, have:end] = new.transpose(1, 2)
        self.n_entries[path] = end
        return store[:, :, :end].transpose(1, 2)  # [B, E, Hkv, d] view of the head-major storage

    def pooler_state(self, path: str) -> PoolerState | None:
        return self.states[path] if self.start > 0 else None

    def set_pooler_state(self, path: str, state: PoolerState) -> None:
        for name, mine in vars(self.states[path]).items():
            if mine is not None:  # the gate logits' storage exists only with a gate
                mine.copy_(getattr(state, name))

    # ---- accounting ----------------------------------------------------------------------------------
    def live_tensors(self, length: int) -> dict[str, Tensor]:
        """The parts of storage that hold data after ``length`` tokens, by name."""
        rows = length if self.kind == "full" else min(length, self.ring)
        out = {"raw_k": self.raw_k[:, :rows]}
        if self.raw_v is not None:
            out["raw_v"] = self.raw_v[:, :rows]
        for path, store in self.entry_store.items():
            out[f"entries_{path}"] = store[:, :, : self.n_entries[path]].transpose(1, 2)
            st = self.states[path]
            out[f"open_{path}_payload"] = st.cur_payload
            out[f"prev_{path}_payload"] = st.prev_payload
            if st.cur_logit is not None and st.prev_logit is not None:
                out[f"open_{path}_gate"] = st.cur_logit
                out[f"prev_{path}_gate"] = st.prev_logit
        return out

    def all_tensors(self) -> list[Tensor]:
        out = [self.raw_k] + ([self.raw_v] if self.raw_v is not None else [])
        for path, store in self.entry_store.items():
            out += [store, *(t for t in vars(self.states[path]).values() if t is not None)]
        return out


class CompressedKVCache:
    """The KV cache of a :class:`CompressedTransformer`, for ``batch_size`` sequences of ``max_len`` slots.

    Use it through the model: ``logits = model(tokens, cache=cache)`` appends ``tokens`` at slot
    ``cache.length``. ``nbytes()`` sums the bytes of the tensors that hold data; ``reserved_nbytes()`` the
    preallocated storage.
    """

    def __init__(self, model: nn.Module, batch_size: SupportsInt, max_len: SupportsInt) -> None:
        for name, value in (("batch_size", batch_size), ("max_len", max_len)):
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
                raise CacheError(f"a cache needs a positive int {name}, got {value!r}; e.g. model.new_cache(batch_size=2, "
                                 "max_len=256) (max_len=None means the model's n_ctx).")
        batch_size, max_len = int(batch_size), int(max_len)
        if max_len > model.config.n_ctx:
            raise CacheError(f"max_len {max_len} exceeds the model's context n_ctx={model.config.n_ctx}.")
        check_cache(model, batch_size, max_len)  # priced before any storage: ResourceError naming what fits
        param = model.unembed.weight
        self.dtype, self.device = param.dtype, param.device
        self._owner = weakref.ref(model)
        self.batch_size, self.max_len = batch_size, max_len
        self.layers = [LayerCache(b.attn, batch_size, max_len, param.dtype, param.device) for b in model.blocks]
        self.length = 0
        self._busy = False

    def check_model(self, model: nn.Module) -> None:
        """Refuse a model other than the one this cache was made for, or one whose dtype or device changed."""
        if self._owner() is not model:
            raise CacheError("this cache was made by another model; make one with model.new_cache(...) for this model.")
        param = model.unembed.weight
        if param.dtype != self.dtype or param.device != self.device:
            raise CacheError(
                f"this cache holds {self.dtype} on {self.device}, but the model is now {param.dtype} on "
                f"{param.device} (converted after the cache was made); make a new cache with model.new_cache(...)."
            )

    def begin(self, tokens: Tensor) -> list[LayerCache]:
        """Called by the model before appending ``tokens`` ``[B, n]``; returns the per-layer pasts."""
        if self._busy:
            raise CacheError(
                "this cache was left half-updated by an error during an earlier forward; "
                "call cache.reset() and prefill again."
            )
        B, n = tokens.shape
        if B != self.batch_size:
            raise CacheError(
                f"the cache holds {self.batch_size} sequence(s) but the tokens have batch {B}; make a cache for this "
                f"batch with model.new_cache(batch_size={B}, max_len={self.max_len}), or, to start this cache over "
                f"with {self.batch_size} sequence(s), call cache.reset() and prefill it again."
            )
        if self.length + n > self.max_len:
            raise CacheError(
                f"appending {n} tokens to {self.length} cached would exceed max_len={self.max_len}; "
                "create the cache with a larger max_len."
            )
        for layer in self.layers:
            layer.start = self.length
        self._busy = True
        return self.layers

    def end(self, n: int) -> None:
        self.length += n
        self._busy = False

    def reset(self) -> None:
        """Forget every token (storage stays allocated)."""
        self.length = 0
        self._busy = False
        for layer in self.layers:
            for path in layer.n_entries:
                layer.n_entries[path] = 0

    def nbytes(self) -> int:
        """Bytes of the cache's tensors that hold data now (entries so far, raw window, open-block buffers)."""
        return sum(t.nbytes for layer in self.layers for t in layer.live_tensors(self.length).values())

    def reserved_nbytes(self) -> int:
        """Bytes of all preallocated storage."""
        return sum(t.untyped_storage().nbytes() for layer in self.layers for t in layer.all_tensors())

    def layout(self) -> list[dict[str, tuple[int, ...]]]:
        """Per layer, the shape of every live tensor (what :meth:`nbytes` sums)."""
        return [{k: tuple(v.shape) for k, v in layer.live_tensors(self.length).items()} for layer in self.layers]

    def __repr__(self) -> str:
        return (
            f"CompressedKVCache(batch={self.batch_size}, length={self.length}/{self.max_len}, "
            f"nbytes={self.nbytes():,}, reserved={self.reserved_nbytes():,})"
        )
