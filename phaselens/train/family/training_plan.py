"""What a family run costs before it starts: parameters, tokens, FLOPs, memory per GPU under FSDP, GPU-hours.

The model is built on the meta device (no memory, no initialisation), so the plan of the 0.6b size prints in
seconds (most of it importing torch). How each number is counted (:mod:`phaselens.train.family.costs`):

- **parameters** N: every parameter once (the tied embedding once); ``non_embedding`` leaves the embedding out.
- **tokens** D: ``batch_size x sequence length`` summed over the steps (every processed token, trained or not;
  the warm-up's rows are shorter).
- **FLOPs**: per token ``6 (N - embedding)`` + attention per layer kind (``12 H d K``: K = T in full layers,
  ``local_window + T // S`` in compressed ones) + the unembedding at the trained positions only, summed over
  the warm-up's and the task's rows (:func:`~phaselens.train.family.costs.flops_per_token`); checked against
  ``torch.utils.flop_counter.FlopCounterMode`` (``tests/train/family/test_costs.py``).
- **GPU-hours**: the FLOPs the GPUs execute (model FLOPs plus activation recompute's second forward of
  every block) / (peak x utilisation) / 3600, at a stated peak (default 989 TFLOP/s: dense bf16 of an
  H100/H200 SXM) and utilisation of that peak (default 40%); the model-FLOPs utilisation (MFU) this implies
  is printed beside it.
- **memory per GPU** with FSDP over ``gpus`` ranks (an estimate; ``benchmarks/bench_family_gpu.py`` prints it
  beside the measured peak):
  - sharded state: fp32 weights, fp32 gradients and AdamW's two fp32 moments, ``16 N / gpus`` bytes;
  - gathered weights (FSDP only): the root's (embedding, final norm) plus two blocks (the current one and the
    prefetched next) in the compute dtype, and one block's unsharded gradient;
  - activations of one micro-batch of ``b`` rows of ``T`` tokens, counted from the tensors autograd saves
    (:func:`~phaselens.train.family.costs.activation_bytes`, within 1-3% of the measured saved tensors); with
    activation recompute only each block's input is kept, plus one block's activations in the backward;
  - logits: fp32 ``[rows_trained, vocab]`` three times (logits, their fp32 copy, the gradient), where
    ``rows_trained`` is the task's trained positions plus every position of pretraining rows.
- **recompute needed**: whether the run without activation recompute exceeds ``gpu_gib`` (default
  80 GB, an H100's 79.1 GiB usable as 0.9 of it); ``phaselens train`` on a GPU turns it on only then.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from phaselens.train.family.costs import StepFlops, activation_bytes, flops_per_token, layer_kinds
from phaselens.train.family.recipes import FamilyRecipe, paper_task
from phaselens.train.settings import batch_split  # noqa: F401  (the plan's check is the run's)

GiB = 2**30
PEAK_TFLOPS = 989.0  # H100 / H200 SXM, dense bf16
MFU = 0.40  # the utilisation of the peak the plan assumes, on the FLOPs the GPU executes
GPU_GIB = 80e9 / GiB  # an 80 GB H100: 74.5 GiB


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
    flops: float  # model FLOPs of the whole run (what MFU divides by)
    gpus: int
    micro_batch: int
    precision: str
    recompute_activations: bool
    peak_tflops: float
    mfu: float  # the utilisation of the peak on executed FLOPs (recompute included)
    memory: dict[str, int] = field(default_factory=dict)
    per_token: StepFlops | None = None  # FLOPs per token of a task step (after the warm-up)
    executed_flops: float = 0.0  # model FLOPs plus activation recompute
    memory_without_recompute: int = 0
    gpu_gib: float = GPU_GIB
    largest_micro_batch_without_recompute: int = 0  # the most rows per forward that fit gpu_gib without it

    @property
    def memory_per_gpu(self) -> int:
        return sum(self.memory.values())

    @property
    def needs_recompute(self) -> bool:
        """Whether the run without activation recompute would exceed ``gpu_gib`` (90% of it usable)."""
        return self.memory_without_recompute > 0.9 * self.gpu_gib * GiB

    @property
    def gpu_hours(self) -> float:
        return (self.executed_flops or self.flops) / (self.peak_tflops * 1e12 * self.mfu) / 3600

    @property
    def wall_hours(self) -> float:
        return self.gpu_hours / self.gpus

    @property
    def model_flops_utilisation(self) -> float:
        return self.mfu * self.flops / (self.executed_flops or self.flops)

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["per_token"] = self.per_token.to_dict() if self.per_token else None
        return {**out, "memory_per_gpu": self.memory_per_gpu, "gpu_hours": self.gpu_hours,
                "wall_hours": self.wall_hours, "needs_recompute": self.needs_recompute,
                "model_flops_utilisation": self.model_flops_utilisation}

    def __str__(self) -> str:
        mem = ", ".join(f"{k} {v / GiB:.2f}" for k, v in self.memory.items())
        t = self.per_token
        parts = (f" per task token {t.model:.3g} = 6(N-emb) {t.dense:.3g} + attention {t.attention + t.local_window:.3g}"
                 f" + unembedding {t.unembedding:.3g}" if t else "")
        recompute = (f" + recompute {self.executed_flops - self.flops:.3g}" if self.executed_flops > self.flops else "")
        ac = "needed" if self.needs_recompute else "not needed"
        return "\n".join([
            f"plan of {self.recipe} at size {self.size}",
            f"  parameters   {self.parameters:,} ({self.non_embedding:,} without the embedding)",
            f"  tokens       {self.tokens:,} in {self.steps:,} steps of {self.batch_size} sequences of {self.seq_len} "
            "tokens (shorter in the warm-up)",
            f"  FLOPs        {self.flops:.3g}{recompute} ({parts.strip()})",
            f"  GPU-hours    {self.gpu_hours:,.1f} at {self.mfu:.0%} of {self.peak_tflops:g} TFLOP/s per GPU, MFU "
            f"{self.model_flops_utilisation:.0%} ({self.wall_hours:,.1f} h on {self.gpus} GPU{'s' if self.gpus > 1 else ''})",
            f"  memory/GPU   {self.memory_per_gpu / GiB:.2f} GiB under FSDP over {self.gpus} GPU(s), micro-batch "
            f"{self.micro_batch}, {self.precision}, activation recompute "
            f"{'on' if self.recompute_activations else 'off'} (GiB: {mem}); without recompute "
            f"{self.memory_without_recompute / GiB:.2f} GiB: recompute {ac} on a {self.gpu_gib * GiB / 1e9:.0f} GB GPU "
            f"(without it, micro-batches of up to {self.largest_micro_batch_without_recompute} rows fit)",
        ])


def _meta_model(recipe: FamilyRecipe) -> Any:
    from phaselens.models.compressed.transformer import CompressedTransformer

    with torch.device("meta"):
        return CompressedTransformer(recipe.config)


def _phases(recipe: FamilyRecipe, pretrain_ratio: float) -> list[tuple[int, int, float]]:
    """``(steps, row length, trained positions per row)`` of the warm-up and of the task, from one small batch
    of each (the data is a function of the step; pretraining rows train every position)."""
    from phaselens.train.family.run import family_data

    data = family_data(recipe)
    warm = min(recipe.settings.steps, recipe.warmup_steps)
    out = []
    for steps, at in ((warm, 0), (recipe.settings.steps - warm, warm)):
        if steps:
            tokens, targets = data(8, 0, at)
            trained = float((targets != -100).sum()) / len(targets)
            if at == warm:
                trained = (1 - pretrain_ratio) * trained + pretrain_ratio * tokens.shape[1]
            out.append((steps, int(tokens.shape[1]), trained))
    return out


def plan_run(recipe: FamilyRecipe, *, gpus: int = 1, micro_batch: int | None = None, precision: str = "bf16",
             recompute_activations: bool = True, pretrain_ratio: float = 0.0, peak_tflops: float = PEAK_TFLOPS,
             mfu: float = MFU, gpu_gib: float = GPU_GIB) -> TrainPlan:
    """The :class:`TrainPlan` of ``recipe`` on ``gpus`` GPUs (FSDP), built without allocating the model."""
    model = _meta_model(recipe)
    cfg = recipe.config
    n = sum(p.numel() for p in model.parameters())
    emb = model.embed.weight.numel()
    s = recipe.settings
    seq = paper_task().seq_len()
    _, b = batch_split(s.batch_size, gpus, micro_batch)
    flops = executed = 0.0
    per_token = None
    for steps, length, trained in _phases(recipe, pretrain_ratio):
        step = flops_per_token(cfg, n, emb, seq=length, trained=trained,
                               recompute_activations=recompute_activations)
        flops += step.model * steps * s.batch_size * length
        executed += step.executed * steps * s.batch_size * length
        per_token = step
    cbytes = 2 if precision == "bf16" else 4
    memory = _memory(model, recipe, gpus, b, cbytes, recompute_activations, pretrain_ratio)
    without = sum(_memory(model, recipe, gpus, b, cbytes, False, pretrain_ratio).values())
    one, two = (sum(_memory(model, recipe, gpus, k, cbytes, False, pretrain_ratio).values()) for k in (1, 2))
    largest = int((0.9 * gpu_gib * GiB - (2 * one - two)) // (two - one))  # memory is linear in the rows
    return TrainPlan(recipe.name, recipe.size, n, n - emb, s.steps, s.batch_size, seq, recipe.tokens(), flops, gpus,
                     b, precision, recompute_activations, peak_tflops, mfu, memory, per_token, executed,
                     int(without), gpu_gib, max(largest, 0))


def _memory(model: Any, recipe: FamilyRecipe, gpus: int, b: int, cbytes: int, recompute: bool,
            pretrain_ratio: float) -> dict[str, int]:
    """Bytes per GPU by part for micro-batches of ``b`` rows (see the module docstring)."""
    cfg = recipe.config
    n = sum(p.numel() for p in model.parameters())
    seq = paper_task().seq_len()
    per_block = sum(p.numel() for p in model.blocks[0].parameters())
    root = n - per_block * cfg.n_layers
    rows_trained = b * ((1 - pretrain_ratio) * (paper_task().n_demos + 1) + pretrain_ratio * seq)
    memory = {"sharded state": int(16 * n / gpus)}
    if gpus > 1:  # FSDP gathers bf16 (or fp32) weights; one process keeps them whole in the state
        memory["gathered weights"] = int(cbytes * (root + 2 * per_block) + cbytes * per_block)
    # one process runs bf16 under autocast (bf16 copies of each block's weights are held); FSDP casts them
    weights = 0 if gpus > 1 else sum(p.numel() for p in model.blocks[0].parameters() if p.dim() >= 2)
    blocks = [activation_bytes(cfg, kind, rows=b, seq=seq, cbytes=cbytes, block_weights=weights)
              for kind in layer_kinds(cfg)]
    resid = 4 if gpus == 1 else cbytes  # the residual stream: fp32 under autocast, bf16 under FSDP's policy
    kept = int(b * seq * cfg.n_layers * cfg.d_model * resid + max(blocks))
    memory["activations"] = kept if recompute else sum(blocks)
    memory["logits"] = int(3 * 4 * rows_trained * cfg.d_vocab)
    return memory


def format_plans(plans: list[TrainPlan]) -> str:
    """Several plans (e.g. one per GPU count) as text, with how the numbers are counted."""
    return "\n\n".join(str(p) for p in plans) + (
        "\n\nN = parameters (the tied embedding once), D = processed tokens; FLOPs per token = 6 (N - embedding) + "
        "12 H d K per layer (K = keys per query: T in full layers, window + T/S in compressed ones) + the "
        "unembedding at the trained positions; GPU-hours include activation recompute at the "
        "stated utilisation of the peak; memory per GPU is an estimate (phaselens.train.family.training_plan).")
