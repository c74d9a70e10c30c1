"""Is the full-attention control slow to learn retrieval, or is our implementation? Side by side on a small
version of the zoo task (4 records, 33 tokens): the zoo's `full` recipe and a transformers Llama of the
same size (2 layers, d_model 64, 4 heads, MLP 256), same data, AdamW 3e-3, 500 steps. Prints JSON.

Reproduces docs/data/control_vs_llama.json (from the repository root):

    .venv/bin/python -m experiments.control_vs_llama > docs/data/control_vs_llama.json

docs/zoo.md (``python -m tools.gen_zoo_docs``) quotes that file.
"""

from __future__ import annotations

import json
import tempfile

import torch
import torch.nn.functional as F

from phaselens.tasks import KVRecall
from phaselens.train.loop import TrainSettings, train
from phaselens.train.zoo_recipes import RECIPES

STEPS = 500
TASK = KVRecall(n_records=4, block_filler=0, n_demos=2, min_distance=0, modulus=4, padding="prefix")


def curve(losses: list[float]) -> list[float]:
    return [round(sum(losses[i : i + 50]) / 50, 3) for i in range(0, len(losses), 50)]


def ours() -> list[float]:
    s = TrainSettings(steps=STEPS, batch_size=64, lr=3e-3, warmup=50, checkpoint_every=STEPS, threads=None)
    res = train(RECIPES["full"].config, lambda b, seed: TASK.sample_training_batch(b, seed), s, tempfile.mkdtemp(),
                progress=False)
    return curve(res.losses)


def llama() -> list[float]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=TASK.vocab_size, hidden_size=64, intermediate_size=256,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                         max_position_embeddings=64))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    losses = []
    for step in range(STEPS):
        for g in opt.param_groups:
            g["lr"] = 3e-3 * min(1.0, (step + 1) / 50)
        batch = TASK.sample_training_batch(64, step)
        logits = model(batch.tokens).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch.targets.reshape(-1), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return curve(losses)


if __name__ == "__main__":
    print(json.dumps({"task": repr(TASK), "tokens": TASK.seq_len(), "steps": STEPS,
                      "copy_a_context_value_loss": round(float(torch.log(torch.tensor(4.0))), 3),
                      "phaselens_full_loss_every_50": ours(), "llama_loss_every_50": llama()}, indent=1))
