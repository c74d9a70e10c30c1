"""Recipes of the zoo models: config, task and training settings. ``make zoo`` retrains them all."""

from __future__ import annotations

from dataclasses import dataclass, replace

from phaselens.core.checks import MAX_SEED
from phaselens.errors import ZooError
from phaselens.models.compressed.config import CompressedConfig, CompressorSpec, RopeSpec
from phaselens.tasks import KVRecall
from phaselens.tasks.induction import RepeatedSegments
from phaselens.train.settings import TrainSettings

# Training: 12 records spread through filler (in-sequence padding), residues mod 24 (covers S = 4, 6, 8).
# The target's value lies beyond the 8-token local window, so it is reachable only through entries.
ZOO_TASK = KVRecall(n_records=12, block_filler=8, padding="in_sequence", modulus=24)
# Evaluation (one setting for the whole zoo, the models' default task): the same 12 records in one rigid
# block, 40 filler tokens among them, that shifts as a whole (the paper's prefix padding). The difficulty
# was chosen so that every model sits between about 40% and 95% (see docs/zoo.md for the layouts tried:
# the training layout saturates w8s4 near 98%; packing the block more tightly pushes w8s8 and mean pooling
# below 40%). Records close together share entries with their neighbours, where phase sensitivity shows.
# The target's position spreads over two cycles of 24 slots (n_cycles=2): with one cycle each residue's
# position took only two values, and w4s4's accuracy then differed between cycles by a few points (the
# nested test rejected period 4 at 1,000 items per residue).
ZOO_EVAL_TASK = KVRecall(n_records=12, block_filler=40, padding="prefix", modulus=24, n_cycles=2)
ZOO_SETTINGS = TrainSettings(steps=1500, batch_size=64, lr=3e-3, warmup=100, weight_decay=0.01,
                             checkpoint_every=100, eval_every=500, threads=1)
EVAL_PER_RESIDUE = 1000  # items per residue in the card (24,000 in all)
COMPARE_STRIDE = 4  # the full-attention control is folded by this stride


# Full attention must learn a two-layer induction circuit (no compressed entry pools a key with its value,
# so the compressed models need only one attention hop). On the zoo task alone it stayed on the "copy some
# value from the context" plateau for 6,000 steps (8% accuracy). The control therefore first warms up on
# generic induction data (every token of a repeated segment is trained; the copies lie at random distances,
# so only a content-based head solves it), then trains the same 1,500 steps on the zoo task as the others.
CONTROL_WARMUP = 1500
WARMUP_DATA = RepeatedSegments(ZOO_TASK.vocab_size, seq_len=96, segment=24)


def _with_warmup(steps: int):
    """``(batch_size, seed, step)`` batch function: :data:`WARMUP_DATA` for ``steps`` steps, then the zoo task."""

    def batch(b: int, seed: int, step: int):
        if step < steps:
            return WARMUP_DATA.sample_training_batch(b, seed)
        return ZOO_TASK.sample_training_batch(b, seed)

    batch.uses_step = True  # type: ignore[attr-defined]
    return batch


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    config: CompressedConfig
    settings: TrainSettings
    warmup_steps: int = 0  # steps of WARMUP_DATA before the zoo task (the full-attention control only)

    def batch_fn(self):
        if self.warmup_steps:
            return _with_warmup(self.warmup_steps)
        return lambda b, seed: ZOO_TASK.sample_training_batch(b, seed)


DEFAULT_ROPE = RopeSpec()


def _base(compression: CompressorSpec | None, *, seed: int = 0, rope: RopeSpec | None = DEFAULT_ROPE) -> CompressedConfig:
    return CompressedConfig(
        n_layers=2, d_model=64, n_heads=4, n_kv_heads=4, d_head=16, d_mlp=256, d_vocab=ZOO_TASK.vocab_size,
        n_ctx=256, local_window=8, sink=True, compression=compression, rope=rope, seed=seed,
    )


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in [
        Recipe("full", f"full-attention control, same dims ({CONTROL_WARMUP} steps of induction warm-up, then the "
               "zoo task)", _base(None),
               replace(ZOO_SETTINGS, steps=CONTROL_WARMUP + ZOO_SETTINGS.steps,
                       curriculum=f"{CONTROL_WARMUP} steps of {WARMUP_DATA}, then the zoo task"),
               warmup_steps=CONTROL_WARMUP),
        Recipe("w4s4", "W=S=4, learned scalar gates with per-offset bias, separate K/V, RoPE",
               _base(CompressorSpec(4)), ZOO_SETTINGS),
        Recipe("w8s4", "DeepSeek-V4-style: W=8, S=4 overlap_split, per-channel gates + position bias, tied K=V, "
               "RMSNorm and RoPE on entries",
               _base(CompressorSpec(4, 8, gate="vector", overlap_split=True, tied_kv=True, norm=True)), ZOO_SETTINGS),
        Recipe("w6s6", "W=S=6, learned scalar gates with per-offset bias", _base(CompressorSpec(6)), ZOO_SETTINGS),
        Recipe("w8s8", "W=S=8, learned scalar gates with per-offset bias", _base(CompressorSpec(8)), ZOO_SETTINGS),
        Recipe("w4s4-mean", "W=S=4 uniform averaging (mean pooling)",
               _base(CompressorSpec(4, gate="uniform", position_bias=False)), ZOO_SETTINGS),
        Recipe("w4s4-norope", "W=S=4 with no positional encoding at all",
               _base(CompressorSpec(4, rope="none"), rope=None), ZOO_SETTINGS),
    ]
}

# Seed replicates (issue 16 §7: every claim of docs/zoo.md should hold across seeds). Seed 0 is the base model.
SEED_CONFIGS = ("full", "w4s4", "w8s4", "w6s6", "w8s8")
# Seeds shipped per configuration: full-seed2 is not trained (the control's 3,000 steps take over an hour on
# one CPU thread); get_recipe("full-seed2") still names its recipe.
SHIPPED_SEEDS: dict[str, tuple[int, ...]] = {"full": (1,), "w4s4": (1, 2), "w8s4": (1, 2), "w6s6": (1, 2),
                                             "w8s8": (1, 2)}
SEED_SUFFIX = "-seed"


def seeded(name: str, seed: int) -> Recipe:
    """``name``'s recipe with another seed for both the initial weights and the training data.

    ``seeded("w4s4", 2)`` is the recipe ``w4s4-seed2`` (trained by ``python -m tools.train_zoo w4s4 --seed 2``).
    Seed 0 is the base recipe itself.
    """
    in_range = isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed <= MAX_SEED
    if SEED_SUFFIX in name or name not in RECIPES or not in_range:
        raise ZooError(f"seeded() takes a base recipe ({', '.join(SEED_CONFIGS)}, ...) and a seed in "
                       f"0..{MAX_SEED:,} (2^63 - 1: torch's generators take 64 bits); got {name!r} and {seed!r}.")
    base = RECIPES[name]
    if seed == 0:
        return base
    return replace(base, name=f"{name}{SEED_SUFFIX}{seed}",
                   description=f"{name} with another seed (weights and data)",
                   config=replace(base.config, seed=seed), settings=replace(base.settings, seed=seed))


def get_recipe(name: str) -> Recipe:
    """The recipe called ``name``: a base recipe, or ``BASE-seedK`` for any seed K >= 1 of a base recipe.

    Raises:
        ZooError: for a name that is neither.
    """
    if name in RECIPES:
        return RECIPES[name]
    base, sep, seed = name.rpartition(SEED_SUFFIX)
    if sep and base in RECIPES and seed.isascii() and seed.isdigit() and int(seed) >= 1 and SEED_SUFFIX not in base:
        return seeded(base, int(seed))
    raise ZooError(f"no recipe {name!r}; recipes: {', '.join(RECIPES)}, or BASE{SEED_SUFFIX}K for another "
                   f"seed K >= 1 of a base recipe (e.g. w4s4{SEED_SUFFIX}3).")


RECIPES.update({r.name: r for r in (seeded(n, k) for n in SEED_CONFIGS for k in SHIPPED_SEEDS[n])})
