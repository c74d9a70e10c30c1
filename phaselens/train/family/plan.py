"""What a family run costs before it starts: parameters, tokens, FLOPs, memory per GPU under FSDP, GPU-hours.

The model is built on the meta device (no memory, no initialisation), so the plan of the 0.6b size prints in
seconds (most of it importing torch). How each number is counted:

- **parameters** N: every parameter once (the tied embedding once); ``non_embedding`` leaves the embedding out.
- **tokens** D: ``batch_size x sequence length`` summed over the steps (every processed token, trained or not;
  the warm-up's rows are shorter).
- **FLOPs**: ``6 N D`` (forward and backward of the weights; attention's own products are not counted).
- **GPU-hours**: FLOPs / (GPUs x peak x utilisation) / 3600, per GPU summed, at a stated peak (default 989
  TFLOP/s: dense bf16 of an H100/H200 SXM) and model-FLOPs utilisation (default 40%).
- **memory per GPU** with FSDP over ``gpus`` ranks (an estimate; ``benchmarks/bench_family_gpu.py`` prints it
  beside the measured peak):
  - sharded state: fp32 weights, fp32 gradients and AdamW's two fp32 moments, ``16 N / gpus`` bytes;
  - gathered weights: the root's (embedding, final norm) plus two blocks (the current one and the prefetched
    next) in the compute dtype, and one block's unsharded gradient;
  - activations of one micro-batch of ``b`` rows of ``T`` tokens: per layer and token the saved tensors
    (``6 D + 2 H d + 2 Hkv d + 4 d_mlp`` values in the compute dtype plus the fp32 attention probabilities
    ``H x K``, K = keys per query: T for full attention, ``local_window + T / S`` for compressed layers); with
    activation checkpointing only each block's input is kept, plus one block's activations in the backward;
  - logits: fp32 ``[rows_trained, vocab]`` three times (logits, their fp32 copy, the gradient), where
    ``rows_trained`` is the task's trained positions plus every position of pretraining rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from phaselens.core.errors import ConfigError
from phaselens.train.family.recipes import FamilyRecipe, paper_task

GiB = 2**30
PEAK_TFLOPS = 989.0  # H100 / H200 SXM, dense bf16
MFU = 0.40


@dataclass(frozen=True)
class TrainPlan:
    """The cost of one family run (see the module docstring for how each number is counted)."""

    recipe: str
    size: str
    parameters: int
    non_embedding: int
    steps: int
    batch_size: int
    seq_len: int
    tokens: int
    flops: float
    gpus: int
    micro_batch: int
    precision: str
    activation_checkpointing: bool
    peak_tflops: float
    mfu: float
    memory: dict[str, int] = field(default_factory=dict)

    @property
    def memory_per_gpu(self) -> int:
        return sum(self.memory.values())

    @property
    def gpu_hours(self) -> float:
        return self.flops / (self.peak_tflops * 1e12 * self.mfu) / 3600

    @property
    def wall_hours(self) -> float:
        return self.gpu_hours / self.gpus

    def to_dict(self) -> dict[str, Any]:
        return {**{k: getattr(self, k) for k in self.__dataclass_fields__}, "memory_per_gpu": self.memory_per_gpu,
                "gpu_hours": self.gpu_hours, "wall_hours": self.wall_hours}

    def __str__(self) -> str:
        mem = ", ".join(f"{k} {v / GiB:.2f}" for k, v in self.memory.items())
        return "\n".join([
            f"plan of {self.recipe} at size {self.size}",
            f"  parameters   {self.parameters:,} ({self.non_embedding:,} without the embedding)",
            f"  tokens       {self.tokens:,} in {self.steps:,} steps of {self.batch_size} sequences of {self.seq_len} "
            "tokens (shorter in the warm-up)",
            f"  FLOPs        {self.flops:.3g} (6 N D)",
            f"  GPU-hours    {self.gpu_hours:,.1f} at {self.mfu:.0%} of {self.peak_tflops:g} TFLOP/s per GPU "
            f"({self.wall_hours:,.1f} h on {self.gpus} GPU{'s' if self.gpus > 1 else ''})",
            f"  memory/GPU   {self.memory_per_gpu / GiB:.2f} GiB under FSDP over {self.gpus} GPU(s), micro-batch "
            f"{self.micro_batch}, {self.precision}, activation checkpointing "
            f"{'on' if self.activation_checkpointing else 'off'} (GiB: {mem})",
        ])


def batch_split(batch_size: int, ranks: int, micro_batch: int | None) -> tuple[int, int]:
    """``(rows per rank, rows per forward)`` of a global batch over ``ranks`` ranks, as the trainer splits it;
    a :class:`ConfigError` (the trainer's message) when it does not split evenly. The run checks it before
    building the model, and the plan for each GPU count, so a plan never shows a split the run refuses."""
    share, rem = divmod(batch_size, ranks)
    if share == 0:
        raise ConfigError(f"the global batch ({batch_size} sequences) is smaller than the {ranks} rank(s): each rank "
                          f"needs at least one sequence; use --batch-size {ranks} or a multiple of it (or fewer GPUs).")
    micro = micro_batch or share
    if rem or share % micro:
        raise ConfigError(f"the global batch ({batch_size} sequences) must split evenly over {ranks} rank(s) "
                          f"and then into micro-batches of {micro}; choose a batch size that is a multiple of "
                          f"{ranks * micro}.")
    return share, micro


def _meta_model(recipe: FamilyRecipe) -> Any:
    from phaselens.models.compressed.transformer import CompressedTransformer

    with torch.device("meta"):
        return CompressedTransformer(recipe.config)


def plan_run(recipe: FamilyRecipe, *, gpus: int = 1, micro_batch: int | None = None, precision: str = "bf16",
             activation_checkpointing: bool = True, pretrain_ratio: float = 0.0, peak_tflops: float = PEAK_TFLOPS,
             mfu: float = MFU) -> TrainPlan:
    """The :class:`TrainPlan` of ``recipe`` on ``gpus`` GPUs (FSDP), built without allocating the model."""
    model = _meta_model(recipe)
    cfg = recipe.config
    n = sum(p.numel() for p in model.parameters())
    emb = model.embed.weight.numel()
    s = recipe.settings
    seq = paper_task().seq_len()
    tokens = recipe.tokens()
    _, b = batch_split(s.batch_size, gpus, micro_batch)
    cbytes = 2 if precision == "bf16" else 4
    per_block = sum(p.numel() for p in model.blocks[0].parameters())
    root = n - per_block * cfg.n_layers
    H, Hkv, d, D = cfg.n_heads, cfg.n_key_value_heads, cfg.d_head, cfg.d_model
    strides = [sp.stride for sp in cfg.phase_specs() if sp is not None]
    keys = (cfg.local_window + seq / min(strides)) if strides else seq
    per_token_layer = cbytes * (6 * D + 2 * H * d + 2 * Hkv * d + 4 * cfg.d_mlp) + 4 * H * keys
    if activation_checkpointing:
        acts = b * seq * (cfg.n_layers * D * cbytes + per_token_layer)
    else:
        acts = b * seq * cfg.n_layers * per_token_layer
    task = paper_task()
    trained_task = task.n_demos + 1
    rows_trained = b * ((1 - pretrain_ratio) * trained_task + pretrain_ratio * seq)
    memory = {
        "sharded state": int(16 * n / gpus),
        "gathered weights": int(cbytes * (root + 2 * per_block) + cbytes * per_block),
        "activations": int(acts),
        "logits": int(3 * 4 * rows_trained * cfg.d_vocab),
    }
    return TrainPlan(recipe.name, recipe.size, n, n - emb, s.steps, s.batch_size, seq, tokens, 6.0 * n * tokens, gpus,
                     b, precision, activation_checkpointing, peak_tflops, mfu, memory)


def format_plans(plans: list[TrainPlan]) -> str:
    """Several plans (e.g. one per GPU count) as text, with how the numbers are counted."""
    return "\n\n".join(str(p) for p in plans) + (
        "\n\nN = parameters (the tied embedding once), D = processed tokens, FLOPs = 6 N D (attention's own products "
        "not counted), GPU-hours at the stated utilisation; memory per GPU is an estimate (phaselens.train.family.plan).")
