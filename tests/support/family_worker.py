"""One process of a family training run, started by ``tests/train/family/test_train.py`` (alone or under torchrun).

``python tests/support/family_worker.py RUN_DIR STEPS [STOP_AFTER]``: with torchrun's environment it joins a gloo
process group and trains with FSDP2; alone it trains without. Rank 0 writes ``RUN_DIR/weights.safetensors``
(the gathered model) when the run finishes.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from phaselens.models import CompressedConfig, CompressorSpec, RopeSpec  # noqa: E402
from phaselens.tasks import KVRecall  # noqa: E402
from phaselens.train.family.data import FamilyData  # noqa: E402
from phaselens.train.loop import TrainSettings  # noqa: E402

TASK = dict(n_records=6, block_filler=4, n_demos=2, min_distance=8, modulus=8)
DATA = FamilyData((KVRecall(padding="prefix", **TASK), KVRecall(padding="in_sequence", **TASK)))
# the family's backbone (Qwen3 options) at a test size
CFG = CompressedConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_head=8, d_mlp=48,
                       d_vocab=DATA.tasks[0].vocab_size, n_ctx=128, local_window=8, sink=False,
                       compression=CompressorSpec(4, norm=True), rope=RopeSpec(style="half"), norm_eps=1e-6,
                       qk_norm=True, mlp="swiglu", mlp_bias=False, tie_embeddings=True)
SETTINGS = dict(batch_size=8, lr=3e-3, warmup=3, checkpoint_every=2, eval_every=1000, threads=1)


def settings(steps: int) -> TrainSettings:
    return TrainSettings(steps=steps, **SETTINGS)


def main() -> None:
    from safetensors.torch import save_file

    from phaselens.train.family.trainer import train_family

    run_dir, steps = Path(sys.argv[1]), int(sys.argv[2])
    stop = int(sys.argv[3]) if len(sys.argv) > 3 else None
    torch.set_num_threads(1)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    res = train_family(CFG, DATA, settings(steps), run_dir, progress=False, stop_after=stop)
    if res.model is not None:
        save_file({k: v.contiguous() for k, v in res.model.state_dict().items() if k != "unembed.weight"},
                  str(run_dir / "weights.safetensors"))


if __name__ == "__main__":
    main()
