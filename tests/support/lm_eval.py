"""What the lm-evaluation-harness tests share: a tiny causal LM with a real byte-level BPE tokenizer (both built
here, nothing downloaded), the small tasks of tests/data/lm_eval copied with absolute data paths, and one call
of lm-eval's ``simple_evaluate`` that keeps every sample."""

from __future__ import annotations

import functools
import re
import shutil
from pathlib import Path
from typing import Any

import torch

DATA = Path(__file__).resolve().parents[1] / "data" / "lm_eval"
TASKS = ("tiny_mc", "tiny_gen")


@functools.cache
def bpe_tokenizer() -> Any:
    """The toy byte-level BPE (phaselens.tasks.train_toy_tokenizer: the tasks' words are single tokens) as a
    transformers fast tokenizer with a BOS (``<bos>``, added first), a pad token and an end-of-text token
    (``<eos>``, added as the last id: lm-eval's ``hf`` model needs one)."""
    from transformers import PreTrainedTokenizerFast

    from phaselens.tasks import train_toy_tokenizer

    return PreTrainedTokenizerFast(tokenizer_object=train_toy_tokenizer(), bos_token="<bos>", pad_token="<pad>",
                                   eos_token="<eos>")


def sharp_causal_lm(seed: int = 0) -> torch.nn.Module:
    """A tiny random Llama over the BPE's vocabulary, fp32, in eval mode, whose output head is scaled up so its
    greedy choices are decided by wide logit gaps: a different batch, padding or kernel (another process, a
    server) never flips an argmax on any CPU."""
    from tests.support.causal_lm import tiny_causal_lm

    model = tiny_causal_lm("llama", seed=seed, vocab=len(bpe_tokenizer())).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0)
    return model


def write_checkpoint(path: Path, model: torch.nn.Module) -> Path:
    """``model`` and the BPE tokenizer saved in ``path`` (what ``transformers serve`` and ``hf:PATH`` read)."""
    model.save_pretrained(path)
    bpe_tokenizer().save_pretrained(path)
    return path


def task_dir(dest: Path, names: tuple[str, ...] = TASKS) -> Path:
    """tests/data/lm_eval's tasks ``names`` copied into ``dest`` with their ``data_files`` made absolute (lm-eval
    reads a relative one from the working directory)."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in names:
        text = (DATA / f"{name}.yaml").read_text()
        text = re.sub(r"(test: )(\S+\.jsonl)", lambda m: m.group(1) + str(DATA / m.group(2)), text)
        (dest / f"{name}.yaml").write_text(text)
    return dest


def evaluate(lm: Any, tasks: list[Any], include: Path | None = None, **kwargs: Any) -> dict[str, Any]:
    """lm-eval's ``simple_evaluate`` with every sample kept (``results["samples"][task]``), local tasks only."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    # include_defaults=False: lm-eval's own ~15,000 task files are not indexed (30 s on a busy 2-core machine)
    manager = TaskManager(include_path=str(include) if include else None, include_defaults=False)
    return simple_evaluate(model=lm, tasks=tasks, task_manager=manager, log_samples=True, **kwargs)


def copy_tasks(dest: Path) -> Path:
    """tests/data/lm_eval itself (YAML and JSONL) copied to ``dest``, for tests that run from another folder."""
    shutil.copytree(DATA, dest, dirs_exist_ok=True)
    return dest
