"""What a model's ``estimate_memory`` capability returns: the bytes one forward needs, by kind of tensor."""

from __future__ import annotations

from dataclasses import dataclass

GiB = 2**30
SIZES = ("weights", "cache", "attention", "activations", "logits")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a run of ``batch`` sequences of ``tokens`` tokens needs (``chunk``: the prefill piece, None for one
    call; ``query_len``: the rows of the last call). Each model kind's ``memory`` module says what it counts:

    * ``weights``: parameters and buffers as held; ``cache``: the cache after the run;
    * ``attention``: the largest attention score or probability tensor of one call (a softmax holds about four
      such tensors at once, hence :meth:`total`'s ``attention_copies``);
    * ``logits``: the returned logits;
    * ``activations``: the other transients of one call, where the model kind counts them (DeepSeek-V4.1 does;
      the DeepSeek-V4 adapter leaves them at 0).
    """

    tokens: int
    batch: int
    chunk: int | None
    query_len: int
    weights: int
    cache: int
    attention: int
    logits: int
    activations: int = 0

    def total(self, attention_copies: int = 4) -> int:
        """Weights, cache, ``attention_copies`` score tensors, the other transients and the logits."""
        return self.weights + self.cache + attention_copies * self.attention + self.activations + self.logits

    def gib(self) -> dict[str, float]:
        """Each size in GiB."""
        return {k: getattr(self, k) / GiB for k in SIZES}

    def __str__(self) -> str:
        sizes = ", ".join(f"{k} {v:.3g} GiB" for k, v in self.gib().items())
        how = f"chunks of {self.chunk}" if self.chunk else "one call"
        return f"MemoryEstimate({self.batch} x {self.tokens} tokens, {how}, query {self.query_len}: {sizes})"
