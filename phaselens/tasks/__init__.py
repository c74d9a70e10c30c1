"""Phase-controlled tasks: items whose relevant token sits at a chosen residue ``(t - origin) mod M``.

- :class:`KVRecall`: token-level key -> value recall for the toy-model zoo (training sampler included).
- :class:`Needle`: key -> value lookup in text, for any HF tokenizer.
- :class:`PaddingProbe`: one prompt, a sweeping padding line, a two-way completion (the FP8 probe).
- :class:`RepeatedSegments`: generic induction data (no phases) for warming up full-attention models.

Every task has ``build(spec, *, n_per_residue, residues=None, seed=0) -> TaskBatch``, ``seq_len(spec)``
and ``to_dict()``; :func:`task_from_dict` rebuilds any of them. See ``docs/tasks.md``.
"""

from phaselens.tasks.batch import TaskBatch, require_context
from phaselens.tasks.design import PositionDesign
from phaselens.tasks.induction import RepeatedSegments
from phaselens.tasks.kv_recall import KVRecall
from phaselens.tasks.layout import SCHEMES, RegionPlan
from phaselens.tasks.lm_batches import TrainingBatch
from phaselens.tasks.needle import Needle
from phaselens.tasks.probe import PaddingProbe
from phaselens.tasks.serialization import SerializableTask, registered_kinds, task_from_dict
from phaselens.tasks.toy_tokenizer import train_toy_tokenizer

__all__ = [
    "SCHEMES",
    "KVRecall",
    "Needle",
    "PaddingProbe",
    "PositionDesign",
    "RegionPlan",
    "RepeatedSegments",
    "SerializableTask",
    "TaskBatch",
    "TrainingBatch",
    "registered_kinds",
    "require_context",
    "task_from_dict",
    "train_toy_tokenizer",
]
