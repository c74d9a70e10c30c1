"""Error types. Every phaselens error says what was wrong and how to fix it.

All errors derive from :class:`PhaseLensError`, so ``except phaselens.PhaseLensError`` catches
everything the toolkit raises on purpose. Errors about bad values also derive from
:class:`ValueError`, so generic code that expects ``ValueError`` keeps working.
"""

from __future__ import annotations


class PhaseLensError(Exception):
    """Base class of every error phaselens raises deliberately."""


class PhaseGeometryError(PhaseLensError, ValueError):
    """A stride, window, origin or position that does not describe a valid compression layout."""


class ConfigError(PhaseLensError, ValueError):
    """A model or compressor configuration that cannot be built."""


class StoredFileError(PhaseLensError):
    """A file phaselens reads back that is missing, damaged or not the kind asked for. Catch this to handle all
    three kinds at once: a checkpoint, a journal, a saved result."""


class CheckpointError(StoredFileError):
    """A checkpoint (a model's weights, with its config: a zoo model, a released model's directory, a training
    step with its metrics log) that is missing, incomplete, damaged or does not match its config."""


class JournalError(StoredFileError):
    """A result journal (``journal=``, the file a resumable analysis writes its finished units to) that cannot
    be used: a path that is not a file path, a file phaselens did not write, a damaged journal, or one written
    by another run (another model, items or setting)."""


class ResultFileError(StoredFileError):
    """A saved result (``result.save(path)``) that is missing or damaged, or whose content phaselens will not
    rebuild: a type outside its closed registry of result
    and value types, a field that type does not declare (or lacks, or holds a value of another type), or a
    damaged skeleton. Raised before any of the file's content is called."""


class CacheError(PhaseLensError):
    """A compressed KV cache used out of order, past its capacity, or with the wrong batch."""


class InputError(PhaseLensError, ValueError):
    """Token ids or tensors with the wrong shape, dtype or range for the model."""


class DeviceMapError(InputError):
    """A ``device_map`` / ``max_memory`` that cannot place the model: an unknown module name, a GPU this machine
    lacks, a module left without a device, or a model that does not fit (the message names the fix)."""


class HookNameError(InputError, KeyError):
    """A hook name that the model does not have (e.g. ``hook_pattern`` on a compressed layer).

    Also a ``KeyError``, so code that looks names up in ``model.hook_dict`` and catches ``KeyError`` keeps
    working; the message says which names exist instead.
    """

    def __str__(self) -> str:  # KeyError would print the message in quotes
        return str(self.args[0]) if self.args else ""


class LabelError(InputError, KeyError):
    """A dimension, label or metric name that a labelled result does not hold (e.g. ``values.sel(phase=9)``
    on a stride-4 map); the message lists what it holds."""


class TaskError(PhaseLensError, ValueError):
    """A task specification that cannot produce the requested items."""


class BatchIndexError(TaskError, IndexError):
    """An item index out of range, or of a kind a ``TaskBatch`` cannot be indexed with.

    Also an ``IndexError``, so iteration and code that catches ``IndexError`` keep working.
    """


class ResidueError(TaskError):
    """A residue outside ``0..modulus-1`` or a modulus that is not a multiple of the stride."""


class ContextLengthError(TaskError):
    """A task (or a shifted copy of it) longer than the model's context."""


class PaddingError(TaskError):
    """A padding unit that is not exactly one token, or that merges with its neighbours."""


class NoDefaultTaskError(PhaseLensError):
    """A model without a ``default_task`` was evaluated without an explicit task."""


class StatsInputError(PhaseLensError, ValueError):
    """Counts or frames that the statistics battery cannot use (negative, larger than n, ...)."""


class HeadSpecError(PhaseLensError, ValueError):
    """A head specification (``"L2H3"``, ``(2, 3)``, ``"L2"``, ``"L2KV0"``) that is malformed or out of range."""


class NotApplicableError(PhaseLensError):
    """An analysis that does not apply to this model (e.g. gate cycling on uniform pooling)."""


class EngineError(NotApplicableError):
    """An explicit ``engine="suffix"`` that cannot run on this model (no query-suffix engine, or an architecture
    the engine does not support, such as alternating sliding-window and full layers); ``engine="full"`` runs."""


class UnsupportedModelError(PhaseLensError):
    """A model that phaselens cannot analyse faithfully."""


class ZooError(PhaseLensError):
    """An unknown zoo model, or a shipped checkpoint that fails its integrity check."""


class OutputError(PhaseLensError):
    """An output path phaselens will not write: an existing file where a directory goes, or a directory
    holding files phaselens did not write (pass ``overwrite=True`` to replace only phaselens's own files)."""


class ResourceError(PhaseLensError):
    """A run that would not fit in the memory available, priced before anything is allocated (or an
    allocation that failed); says the largest ``n_per_residue`` or ``batch_size`` that fits."""


class NonFiniteError(PhaseLensError):
    """A forward pass whose logits hold NaN or inf (usually a NaN/inf weight); names the first layer whose
    output is non-finite."""


class DistributedError(PhaseLensError):
    """A run across torch.distributed ranks that cannot go on: the ranks disagree on the work, or a rank
    was lost (killed or crashed). With ``journal=``, a rerun at any world size resumes."""


class RankError(DistributedError):
    """Another rank's share of the work failed; ``rank`` is that rank and the message is its error."""

    def __init__(self, message: str, rank: int = -1) -> None:
        super().__init__(message)
        self.rank = rank


class ServerError(PhaseLensError):
    """A served model's endpoint that cannot be reached, stopped answering, or answered a request with an
    error; the message names its address. With ``journal=``, a rerun resumes where the run stopped."""


class TokenizerMismatchError(PhaseLensError, ValueError):
    """A server that tokenizes differently from the local tokenizer (another tokenizer, an added BOS, a chat
    template): its answers would belong to other phases, so none is kept."""


class MissingDependencyError(PhaseLensError, ImportError):
    """An optional package a feature needs is not installed (lm-evaluation-harness for
    :mod:`phaselens.integrations.lm_eval`); the message names what to install."""


__all__ = [
    "BatchIndexError",
    "CacheError",
    "CheckpointError",
    "ConfigError",
    "ContextLengthError",
    "DeviceMapError",
    "DistributedError",
    "EngineError",
    "HeadSpecError",
    "HookNameError",
    "InputError",
    "JournalError",
    "LabelError",
    "MissingDependencyError",
    "NoDefaultTaskError",
    "NonFiniteError",
    "NotApplicableError",
    "OutputError",
    "PaddingError",
    "PhaseGeometryError",
    "PhaseLensError",
    "RankError",
    "ResidueError",
    "ResourceError",
    "ResultFileError",
    "ServerError",
    "StatsInputError",
    "TaskError",
    "TokenizerMismatchError",
    "UnsupportedModelError",
    "ZooError",
]
