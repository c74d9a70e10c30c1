"""Tiny random transformers causal LMs built from configs (no downloads), and what the tests of the causal-LM kind
and of user objects share: a saved tokenizer, a TransformerLens bridge booted offline, and a snapshot of everything
phaselens must leave unchanged on a user's model."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

VOCAB = 128
ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gpt2")


def tiny_causal_lm(arch: str, *, seed: int = 0, layers: int = 2, vocab: int = VOCAB) -> nn.Module:
    """A 2-layer, 4-head (2 KV heads where the family has GQA) fp32 model of ``arch``, in training mode as
    transformers builds it (phaselens must switch to eval for its forwards and switch back)."""
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0)
    configs = {
        "llama": lambda: tf.LlamaConfig(**common, architectures=["LlamaForCausalLM"]),
        "qwen2": lambda: tf.Qwen2Config(**common, architectures=["Qwen2ForCausalLM"]),
        "qwen3": lambda: tf.Qwen3Config(**common, head_dim=16, architectures=["Qwen3ForCausalLM"]),
        "mistral": lambda: tf.MistralConfig(**common, sliding_window=8, architectures=["MistralForCausalLM"]),
        "gpt2": lambda: tf.GPT2Config(vocab_size=vocab, n_embd=64, n_layer=layers, n_head=4, n_positions=512,
                                      bos_token_id=1, eos_token_id=2, architectures=["GPT2LMHeadModel"]),
    }
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tf.AutoModelForCausalLM.from_config(configs[arch]())


def save_tokenizer(path: Path, vocab: int = VOCAB) -> Any:
    """A word-level tokenizer of ``vocab`` tokens saved to ``path`` and loaded back (TransformerLens reloads a
    tokenizer by its ``name_or_path``, so it must come from a directory)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(words, unk_token="t0")),
                                  pad_token="t0", bos_token="t1", eos_token="t2")
    tok.save_pretrained(path)
    return PreTrainedTokenizerFast.from_pretrained(str(path))


def boot_bridge(model: nn.Module, tokenizer_dir: Path, vocab: int = VOCAB) -> Any:
    """A TransformerLens ``TransformerBridge`` booted over ``model`` offline. It needs ``config.architectures``
    (to pick its adapter) and a tokenizer (it would download one by name): both are given here. Booting rewires
    ``model`` in place, as it does for users."""
    from transformer_lens.model_bridge import TransformerBridge

    os.environ["HF_HUB_OFFLINE"] = "1"
    tok = save_tokenizer(tokenizer_dir, vocab)
    if not getattr(model.config, "architectures", None):
        model.config.architectures = [type(model).__name__]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TransformerBridge.boot_transformers("phaselens-tiny", hf_model=model, device="cpu", tokenizer=tok)


@dataclass
class Snapshot:
    """What phaselens must leave as it was on a user's model: weights, hooks, modes, attention implementation,
    and the module tree."""

    state: dict[str, torch.Tensor]
    hooks: dict[str, tuple[tuple[int, ...], ...]]
    training: dict[str, bool]
    attn: Any
    types: dict[str, type]

    @staticmethod
    def of(model: nn.Module) -> Snapshot:
        return Snapshot(
            {k: v.detach().clone() for k, v in model.state_dict().items()},
            {n: tuple(tuple(getattr(m, d)) for d in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks"))
             for n, m in model.named_modules()},
            {n: m.training for n, m in model.named_modules()},
            model.config.__dict__.get("_attn_implementation_internal"),
            {n: type(m) for n, m in model.named_modules()},
        )

    def assert_same(self, model: nn.Module) -> None:
        now = Snapshot.of(model)
        assert now.state.keys() == self.state.keys()
        assert all(torch.equal(now.state[k], v) for k, v in self.state.items())
        assert now.hooks == self.hooks, "hooks left on the model"
        assert now.training == self.training, "modes changed"
        assert now.attn == self.attn, "attention implementation changed"
        assert now.types == self.types, "modules replaced"
