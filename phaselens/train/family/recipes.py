"""The paper's from-scratch family as recipes: a named size of the Qwen3 backbone times a named layout.

``paper-w4s4`` at size ``tiny`` trains on a laptop in minutes; the same recipe at size ``0.6b`` is the paper's
Qwen3-0.6B run (science.md §3: strides 4, 6, 8 and 12, with and without overlap, and full-attention controls).
Every member is a :class:`~phaselens.models.CompressedTransformer` whose config switches on the Qwen3 options
(``qk_norm``, SwiGLU, no biases, tied embeddings, a ``"half"`` RoPE, no sink), so every hook, the compressed
cache, the query-suffix engine and every analysis work on it unchanged; with ``compression=None`` it *is*
Qwen3 (``tests/models/compressed/test_qwen3.py``).

Layouts (compressed layers: every layer; local window 16 raw tokens, as the paper's controlled models):

- ``wSsS``: windows of S slots every S slots (no overlap); ``w{2S}sS``: windows of 2S slots (each entry also
  pools the previous stride block), for S in 4, 6, 8, 12;
- ``full``: full causal attention everywhere (the control), i.e. Qwen3 itself;
- ``w4s4-mean`` (uniform averaging) and ``w4s4-norope`` (no positional encoding): the paper's ablations.

Compressors follow the paper's baseline (science.md §2; its ablations, in ``tests/data/from_scratch_runs.json``,
name what the baseline has: QK-norm, a gate bias, scalar gates, separate K and V, RoPE on the whole head):
one scalar gate logit per slot and KV head from a shared projection plus a learned per-offset bias, and the
payload is the layer's own keys (QK-normed, before RoPE) and values (``payload="attention"``), so an entry is a
gated mix of the keys and values the local window sees and the compressor adds only its gate parameters;
entries take RoPE at their first slot. One departure: the pooled rows get an RMSNorm (the paper lists
"post-norm" as a variant, so its baseline probably has none). Without it the tiny size stayed on the plateau
(loss ln 48 after 300 steps of the zoo's task, validation 2%; with it 3.55 and 22%; docs/training.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from phaselens.errors import ConfigError
from phaselens.models.compressed.config import CompressedConfig, CompressorSpec, RopeSpec
from phaselens.models.compressed.qwen3 import QWEN3_0_6B
from phaselens.tasks import KVRecall
from phaselens.tasks.induction import RepeatedSegments
from phaselens.train.settings import TrainSettings

PREFIX = "paper-"
LOCAL_WINDOW = 16
MODULUS = 24  # residues mod 24 cover S = 4, 6, 8, 12
PAPER_TOKENS = 100_000_000_000  # the paper's training budget per run


def paper_task(padding: str = "prefix") -> KVRecall:
    """The paper's task (science.md §3): 64 single-token key -> value records ("animal -> name"), 8
    demonstrations, then a target key; the target value lies at least 16 slots (the local window) before the
    query, so it is reachable only through compressed entries. ``padding`` is ``"prefix"`` (the records shift
    together) or ``"in_sequence"`` (the gaps between records vary); both hold the query position and the first
    two moments of the target's position fixed across residues (:class:`~phaselens.tasks.KVRecall`).
    351 tokens, vocabulary 160 (ids 0-2 PAD/BOS/QUERY, 64 keys, 64 values, 29 filler)."""
    return KVRecall(n_records=64, n_demos=8, block_filler=0, min_distance=LOCAL_WINDOW, modulus=MODULUS,
                    padding=padding, n_keys=64, n_values=64, n_filler=29)


TRAINING_RECORDS = (16, 32, 64)


def training_tasks() -> tuple[KVRecall, ...]:
    """What the family trains on: the paper's task with 16, 32 and 64 records, each in both padding schemes.

    All six have the paper task's 351 tokens: R records come with ``2 (64 - R)`` filler tokens inside the
    records block, so fewer records means sparser ones. Before them, :func:`warmup_tasks` (shorter items) give
    a small model its first learning signal (see docs/training.md for what failed without); the evaluation is
    always the paper's task itself.
    """
    out = []
    for n in TRAINING_RECORDS:
        for padding in ("prefix", "in_sequence"):
            out.append(KVRecall(n_records=n, n_demos=8, block_filler=2 * (64 - n), min_distance=LOCAL_WINDOW,
                                modulus=MODULUS, padding=padding, n_keys=64, n_values=64, n_filler=29))
    return tuple(out)


WARMUP_LEN = 147
CONTROL_WARMUP_LEN = 96


def warmup_tasks(kind: str = "records") -> tuple[Any, ...]:
    """The warm-up's 147-token rows.

    ``"records"`` (compressed layouts), a quarter each: 12 records with 8 filler tokens among them and 4
    demonstrations in both padding schemes (the zoo's training layout), and generic induction data (a random
    segment of 24 or of 12 tokens recurs later, every token of the repeat trained:
    :class:`~phaselens.tasks.induction.RepeatedSegments`). ``"induction"`` (the full-attention control): 96-token
    rows in which a 24-token segment recurs, the zoo control's warm-up data. A full-attention model must build a
    two-layer induction circuit to solve the task (a compressed entry already pools a key with its value); like
    the zoo's control (docs/zoo.md), the family's control first trains on induction data only, for
    ``Size.control_warmup_steps`` steps. Measured at tiny (batch 32): on the records warm-up the control stayed
    at loss 4.85 for 1,000 steps, on the 147-token induction rows alone at 4.98 for 1,400; on the 96-token rows
    its loss fell from 4.71 to 0.75 between steps 400 and 550 (the induction circuit formed)."""
    vocab = paper_task().vocab_size
    if kind == "induction":
        return (RepeatedSegments(vocab, seq_len=CONTROL_WARMUP_LEN, segment=24),)
    induction = (RepeatedSegments(vocab, seq_len=WARMUP_LEN, segment=24),
                 RepeatedSegments(vocab, seq_len=WARMUP_LEN, segment=12))
    records = tuple(KVRecall(n_records=12, n_demos=4, block_filler=8, min_distance=LOCAL_WINDOW, modulus=MODULUS,
                             padding=padding, n_keys=64, n_values=64, n_filler=29)
                    for padding in ("prefix", "in_sequence"))
    return (*records, *induction)


@dataclass(frozen=True)
class Size:
    """Backbone dimensions of one family size and its default training run.

    ``d_vocab=None``: the task's vocabulary (or ``--vocab``); the 0.6b size keeps Qwen3's 151,936 ids so that a
    user's Qwen3-tokenised pretraining tokens fit. ``batch_size`` is the global batch in sequences.
    """

    name: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_mlp: int
    d_vocab: int | None
    rope_theta: float
    settings: TrainSettings
    warmup_steps: int
    control_warmup_steps: int  # the full-attention control's induction warm-up (replaces warmup_steps)
    tokens: int | None = None  # a token budget that sets the steps (the 0.6b size: the paper's 100B)


SIZES: dict[str, Size] = {
    s.name: s
    for s in [
        Size("tiny", 2, 64, 4, 2, 16, 192, None, 10_000.0,
             TrainSettings(steps=2400, batch_size=32, lr=3e-3, warmup=100, checkpoint_every=100, eval_every=200,
                           threads=1), warmup_steps=1200, control_warmup_steps=1000),
        Size("small", 4, 256, 4, 2, 64, 768, None, 1_000_000.0,
             TrainSettings(steps=4000, batch_size=64, lr=1e-3, warmup=200, checkpoint_every=250, eval_every=500),
             warmup_steps=300, control_warmup_steps=1000),
        Size("base", 12, 512, 8, 4, 64, 1536, None, 1_000_000.0,
             TrainSettings(steps=20_000, batch_size=128, lr=6e-4, warmup=1000, checkpoint_every=500,
                           eval_every=1000), warmup_steps=500, control_warmup_steps=1000),
        Size("0.6b", QWEN3_0_6B["n_layers"], QWEN3_0_6B["d_model"], QWEN3_0_6B["n_heads"], QWEN3_0_6B["n_kv_heads"],
             QWEN3_0_6B["d_head"], QWEN3_0_6B["d_mlp"], QWEN3_0_6B["d_vocab"], QWEN3_0_6B["rope_theta"],
             TrainSettings(steps=1, batch_size=512, lr=3e-4, warmup=2000, checkpoint_every=1000, eval_every=5000),
             warmup_steps=2000, control_warmup_steps=2000, tokens=PAPER_TOKENS),
    ]
}


def _compressor(stride: int, window: int, **kw) -> CompressorSpec:
    return CompressorSpec(stride, window, gate=kw.pop("gate", "scalar"), position_bias=kw.pop("position_bias", True),
                          payload="attention", norm=True, **kw)


LAYOUTS: dict[str, tuple[CompressorSpec | None, str]] = {"full": (None, "full causal attention (the control): Qwen3")}
for _s in (4, 6, 8, 12):
    LAYOUTS[f"w{_s}s{_s}"] = (_compressor(_s, _s), f"stride {_s}, windows of {_s} slots (no overlap)")
    LAYOUTS[f"w{2 * _s}s{_s}"] = (_compressor(_s, 2 * _s), f"stride {_s}, windows of {2 * _s} slots (overlap)")
LAYOUTS["w4s4-mean"] = (_compressor(4, 4, gate="uniform", position_bias=False), "stride 4, uniform averaging")
LAYOUTS["w4s4-norope"] = (_compressor(4, 4, rope="none"), "stride 4, no positional encoding at all")


@dataclass(frozen=True)
class FamilyRecipe:
    """One member: ``name`` (``paper-LAYOUT``), its size, model config, training settings and task."""

    name: str
    size: str
    description: str
    config: CompressedConfig
    settings: TrainSettings
    warmup_steps: int = 0
    warmup_kind: str = "records"  # "induction" for the full-attention control (see warmup_tasks)
    variant: str = ""  # "-kv1", "-seed2", ...: what differs from the size's defaults (part of the member's name)

    @property
    def member(self) -> str:
        """The trained model's name: ``paper-LAYOUT-SIZE`` plus the variant (``paper-w8s8-tiny-kv1-seed2``)."""
        return f"{self.name}-{self.size}{self.variant}"

    @property
    def layout(self) -> str:
        return self.name[len(PREFIX):]

    @property
    def seq_len(self) -> int:
        """The length of every row after the warm-up (the paper's task)."""
        return paper_task().seq_len()

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one step after the warm-up."""
        return self.settings.batch_size * self.seq_len

    def tokens(self, steps: int | None = None) -> int:
        """Tokens processed by the first ``steps`` steps (default: the whole run), warm-up included."""
        steps = self.settings.steps if steps is None else steps
        warm = min(steps, self.warmup_steps)
        return self.settings.batch_size * (warm * self.warmup_len + (steps - warm) * self.seq_len)

    @property
    def warmup_len(self) -> int:
        """Tokens per row during the warm-up."""
        return CONTROL_WARMUP_LEN if self.warmup_kind == "induction" else WARMUP_LEN


def family_config(layout: str, size: str, *, vocab: int | None = None, seed: int = 0,
                  kv_heads: int | None = None) -> CompressedConfig:
    """The :class:`CompressedConfig` of ``layout`` (a key of :data:`LAYOUTS`) at ``size`` (a key of :data:`SIZES`).

    ``kv_heads`` replaces the size's KV heads (a divisor of its query heads): the paper's baseline runs use 1
    (multi-query attention), its ablations 2, 4 and 8; Qwen3-0.6B has 8."""
    if layout not in LAYOUTS:
        raise ConfigError(f"no family layout {layout!r}; layouts: {', '.join(LAYOUTS)}.")
    if size not in SIZES:
        raise ConfigError(f"no family size {size!r}; sizes: {', '.join(SIZES)}.")
    s = SIZES[size]
    task_vocab = paper_task().vocab_size
    d_vocab = vocab or s.d_vocab or task_vocab
    if d_vocab < task_vocab:
        raise ConfigError(f"vocab {d_vocab} is smaller than the paper task's {task_vocab} ids; use vocab >= {task_vocab}.")
    compression, _ = LAYOUTS[layout]
    norope = layout.endswith("-norope")
    return CompressedConfig(
        n_layers=s.n_layers, d_model=s.d_model, n_heads=s.n_heads, n_kv_heads=kv_heads or s.n_kv_heads,
        d_head=s.d_head,
        d_mlp=s.d_mlp, d_vocab=d_vocab, n_ctx=max(512, paper_task().seq_len()), local_window=LOCAL_WINDOW,
        sink=False, compression=compression, rope=None if norope else RopeSpec(theta=s.rope_theta, style="half"),
        norm_eps=1e-6, seed=seed, qk_norm=True, mlp="swiglu", mlp_bias=False, tie_embeddings=True,
    )


def family_recipe(name: str, size: str = "tiny", *, vocab: int | None = None, seed: int = 0,
                  steps: int | None = None, tokens: int | None = None, batch_size: int | None = None,
                  kv_heads: int | None = None) -> FamilyRecipe:
    """The recipe ``name`` (``paper-LAYOUT``) at ``size``.

    ``steps`` or ``tokens`` (a budget: steps = tokens / (batch_size x sequence length), rounded up) replace the
    size's default; ``seed`` sets both the initial weights and the data.
    """
    if not name.startswith(PREFIX) or name[len(PREFIX):] not in LAYOUTS:
        raise ConfigError(f"no family recipe {name!r}; recipes: {', '.join(PREFIX + k for k in LAYOUTS)}.")
    if steps is not None and tokens is not None:
        raise ConfigError("give steps or tokens, not both.")
    layout = name[len(PREFIX):]
    cfg = family_config(layout, size, vocab=vocab, seed=seed, kv_heads=kv_heads)
    s = SIZES[size]
    settings = dataclasses.replace(s.settings, seed=seed, batch_size=batch_size or s.settings.batch_size)
    seq = paper_task().seq_len()
    control = cfg.compression is None
    warmup = s.control_warmup_steps if control else s.warmup_steps
    budget = tokens if tokens is not None else (s.tokens if steps is None else None)
    if budget is not None:  # the warm-up's shorter rows count too
        warm = warmup * settings.batch_size * (CONTROL_WARMUP_LEN if control else WARMUP_LEN)
        steps = warmup + max(0, -(-(int(budget) - warm) // (settings.batch_size * seq)))
    elif steps is None:  # the size's run: every layout trains the same number of steps on the paper's task
        steps = warmup + s.settings.steps - s.warmup_steps
    settings = dataclasses.replace(settings, steps=steps)
    _, what = LAYOUTS[layout]
    desc = f"{what}; Qwen3 backbone at size {size} ({s.n_layers} layers, d_model {s.d_model})"
    variant = (f"-kv{kv_heads}" if kv_heads and kv_heads != s.n_kv_heads else "") + (f"-seed{seed}" if seed else "")
    return FamilyRecipe(name, size, desc, cfg, settings, min(warmup, settings.steps),
                        "induction" if control else "records", variant)


def recipe_names() -> list[str]:
    return [PREFIX + k for k in LAYOUTS]
