"""TaskBatch container behaviour, JSON round-trips and the task registry."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from phaselens.core.geometry import PhaseSpec
from phaselens.errors import ContextLengthError, TaskError
from phaselens.tasks import KVRecall, TaskBatch, registered_kinds, require_context, task_from_dict

SPEC = PhaseSpec(4)


@pytest.fixture(scope="module")
def batch() -> TaskBatch:
    return KVRecall(n_records=6, n_demos=2, block_filler=4, modulus=8).build(SPEC, n_per_residue=3, seed=1)


def _same_rows(a: TaskBatch, b: TaskBatch, rows: list[int]) -> None:
    assert len(a) == len(rows)
    assert torch.equal(a.tokens, b.tokens[rows, : a.seq_len])
    assert torch.equal(a.answer, b.answer[rows])
    assert a.frame["t_K"].tolist() == b.frame["t_K"].iloc[rows].tolist()


def test_indexing_forms_agree(batch: TaskBatch) -> None:
    _same_rows(batch[2:5], batch, [2, 3, 4])
    _same_rows(batch[[4, 0]], batch, [4, 0])
    _same_rows(batch[torch.tensor([1, 7])], batch, [1, 7])
    _same_rows(batch[np.array([3])], batch, [3])
    _same_rows(batch[-1], batch, [len(batch) - 1])
    mask = torch.as_tensor(batch.frame["residue"].to_numpy() == 2)
    sub = batch.subset(mask)
    assert len(sub) == 3 and set(sub.frame["residue"]) == {2}
    assert list(sub.frame.index) == [0, 1, 2]
    with pytest.raises(IndexError):
        batch[len(batch)]
    with pytest.raises(IndexError):
        batch[[0, len(batch)]]


def test_to_and_repr(batch: TaskBatch) -> None:
    moved = batch.to("cpu")
    assert torch.equal(moved.tokens, batch.tokens) and moved.frame is batch.frame
    text = repr(batch)
    assert "24 items" in text and "M=8" in text and "3 per residue" in text and "kv_recall" in text


def test_validation_rejects_inconsistent_fields(batch: TaskBatch) -> None:
    from dataclasses import replace

    with pytest.raises(TaskError, match="answer"):
        replace(batch, answer=batch.answer[:-1])
    with pytest.raises(TaskError, match="frame"):
        replace(batch, frame=batch.frame.iloc[:-1])
    with pytest.raises(TaskError, match="int64"):
        replace(batch, tokens=batch.tokens.int())


def test_concat_right_pads_and_checks_specs() -> None:
    a = KVRecall(n_records=4, n_demos=1, modulus=8).build(SPEC, n_per_residue=1, seed=0)
    b = KVRecall(n_records=8, n_demos=1, modulus=8).build(SPEC, n_per_residue=1, seed=0)
    both = TaskBatch.concat([a, b])
    assert both.seq_len == b.seq_len > a.seq_len
    assert torch.equal(both.tokens[: len(a), : a.seq_len], a.tokens)
    assert bool((both.tokens[: len(a), a.seq_len :] == a.pad_id).all())
    assert torch.equal(both.query_pos, torch.cat([a.query_pos, b.query_pos]))
    other = KVRecall(n_records=4, n_demos=1, modulus=8).build(PhaseSpec(8), n_per_residue=1)
    with pytest.raises(TaskError, match="concatenate"):
        TaskBatch.concat([a, other])


@pytest.mark.parametrize(
    "task",
    [KVRecall(), KVRecall(target_records=(3, 9), padding="in_sequence", paired=True, modulus=12, n_cycles=2)],
)
def test_kv_recall_json_round_trip(task: KVRecall) -> None:
    d = json.loads(json.dumps(task.to_dict()))
    assert d["kind"] == "kv_recall"
    back = task_from_dict(d)
    assert back == task and back.to_dict() == task.to_dict()


def test_registry_errors() -> None:
    assert {"kv_recall", "needle", "padding_probe"} <= set(registered_kinds())
    with pytest.raises(TaskError, match="unknown task kind"):
        task_from_dict({"kind": "nope"})
    with pytest.raises(TaskError, match="kind"):
        task_from_dict({"n_records": 3})
    with pytest.raises(TaskError, match="unknown kv_recall field"):
        task_from_dict({"kind": "kv_recall", "n_recs": 3})
    with pytest.raises(TaskError, match="tokenizer"):
        task_from_dict({"kind": "needle"})


def test_require_context_names_the_maximum() -> None:
    task = KVRecall()
    assert require_context(task, 4096) == task.seq_len()
    with pytest.raises(ContextLengthError, match="at most 100"):
        require_context(task, 100)


def test_checkpoint_default_task_round_trip(tmp_path) -> None:
    # The checkpoint loader imports task_from_dict from phaselens.tasks; a saved default task comes back equal.
    from phaselens.models import CompressedConfig, CompressedTransformer

    task = KVRecall(n_records=8, padding="in_sequence")
    model = CompressedTransformer(
        CompressedConfig(
            n_layers=1,
            d_model=16,
            n_heads=2,
            n_kv_heads=1,
            d_head=8,
            d_mlp=32,
            d_vocab=task.vocab_size,
            n_ctx=256,
        )
    )
    model.default_task = task
    model.save(tmp_path / "ckpt")
    from phaselens.models.compressed.loader import load_model

    assert load_model(tmp_path / "ckpt").default_task == task
