"""RepeatedSegments: generic induction data for the control's warm-up."""

from __future__ import annotations

import pytest
import torch

from phaselens.errors import TaskError
from phaselens.tasks.induction import RepeatedSegments


def _copies(tokens: torch.Tensor, targets: torch.Tensor, n: int) -> tuple[int, int]:
    """(src, dst) of one row's repeated segment, found from the trained positions."""
    trained = torch.nonzero(targets != -100).flatten()
    dst = int(trained[0])
    assert trained.tolist() == list(range(dst, dst + n - 1))  # the whole second copy but its last token
    seg = tokens[dst : dst + n]
    starts = [s for s in range(0, dst - n + 1) if torch.equal(tokens[s : s + n], seg)]
    assert starts, "the trained segment must occur earlier in the sequence"
    return starts[-1], dst


def test_second_copy_repeats_the_first_and_targets_are_next_tokens():
    data = RepeatedSegments(40, seq_len=64, segment=10)
    tokens, targets = data.sample_training_batch(64, seed=3)
    assert tokens.shape == targets.shape == (64, 64) and int(tokens.max()) < 40
    m = targets != -100
    assert torch.equal(targets[:, :-1][m[:, :-1]], tokens[:, 1:][m[:, :-1]])  # next-token targets
    gaps = {dst - src for src, dst in (_copies(tokens[b], targets[b], 10) for b in range(64))}
    assert min(gaps) >= 10 and len(gaps) > 10  # copies never overlap, and no fixed offset solves it


def test_deterministic_in_the_seed():
    data = RepeatedSegments(40, seq_len=64, segment=10)
    a, b, c = (data.sample_training_batch(8, seed=s)[0] for s in (1, 1, 2))
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("kw", [dict(seq_len=20, segment=10), dict(segment=1), dict(vocab_size=1)])
def test_bad_settings_raise_task_error(kw):
    args = dict(vocab_size=40, seq_len=64, segment=10) | kw
    with pytest.raises(TaskError):
        RepeatedSegments(**args)


@pytest.mark.slow  # about 25 s; the zoo's control (card checked in CI) is the same claim at full size
def test_a_full_attention_model_learns_induction_from_it():
    """The reason it exists: a small full-attention model forms a content-based induction circuit on it."""
    from phaselens.models import CompressedConfig, CompressedTransformer

    torch.manual_seed(0)
    data = RepeatedSegments(24, seq_len=40, segment=10)
    model = CompressedTransformer(CompressedConfig(n_layers=2, d_model=32, n_heads=2, n_kv_heads=2, d_head=16,
                                                   d_mlp=64, d_vocab=24, n_ctx=64, local_window=4))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(1200):  # the circuit forms near step 850 (loss 3.1 -> 0.3)
        tokens, targets = data.sample_training_batch(32, seed=step)
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    tokens, targets = data.sample_training_batch(256, seed=10**6)
    with torch.no_grad():
        pred = model(tokens).argmax(-1)
    m = targets != -100
    assert float((pred[m] == targets[m]).float().mean()) > 0.8  # chance is 1/24
