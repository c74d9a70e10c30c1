"""The embedded zoo: tiny compressed models trained here, plus their full-attention control.

Each model lives in ``phaselens/zoo/<name>/`` as ``model.safetensors`` + ``config.json`` (config and the
default task) + ``card.json`` (training settings, loss curve, per-residue evaluation, battery, the sha256
of the weights and of the config) + ``eval_batch.safetensors`` (a small fixed evaluation batch to re-check
the card). Load with ``phaselens.load("zoo:NAME")``; both hashes are verified on every load, so an edited
config or default task is refused like edited weights. A loaded zoo model has a word-level tokenizer in which id
``N`` is the word ``tN`` (:mod:`phaselens.models.word_tokenizer`), so text routes (lm-evaluation-harness) reach
its ids exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phaselens.errors import CheckpointError, ZooError
from phaselens.storage.manifest import sha256_file
from phaselens.storage.resumable import read_json

ZOO_DIR = Path(__file__).resolve().parents[1] / "zoo"  # the trained models ship as package data


HASHED = {"weights_sha256": "model.safetensors", "config_sha256": "config.json"}  # card key -> file


@dataclass(frozen=True)
class ZooEntry:
    name: str
    path: Path

    @property
    def card(self) -> dict[str, Any]:
        """The model's card; a missing or unreadable one is a :class:`ZooError`."""
        try:
            return read_json(self.path / "card.json", fix="reinstall phaselens, or rebuild the model with `make zoo`.")
        except CheckpointError as err:
            raise ZooError(f"zoo model {self.name!r}: {err}") from None


def file_digests(path: Path) -> dict[str, str]:
    """The sha256 a card records for each hashed file of the model directory ``path`` (``HASHED``)."""
    return {key: sha256_file(path / name) for key, name in HASHED.items()}


def list_models() -> list[str]:
    """Names of the shipped zoo models, sorted."""
    return sorted(p.name for p in ZOO_DIR.iterdir() if (p / "model.safetensors").is_file())


def entry(name: str) -> ZooEntry:
    names = list_models()
    if name not in names:
        raise ZooError(f"no zoo model {name!r}; available: {', '.join(names) or 'none (run make zoo)'}.")
    return ZooEntry(name, ZOO_DIR / name)


def verify(e: ZooEntry) -> dict[str, Any]:
    """Check the weights and the config (with its default task) against the card's sha256; return the card."""
    card = e.card
    for key, fname in HASHED.items():
        if not (e.path / fname).is_file():
            raise ZooError(f"zoo model {e.name!r} lacks {fname}; reinstall phaselens or retrain with `make zoo`.")
        digest = sha256_file(e.path / fname)
        if card.get(key) != digest:
            raise ZooError(
                f"zoo model {e.name!r}: {fname} has sha256 {digest[:12]}..., but its card says "
                f"{str(card.get(key))[:12]}...; the file was edited or damaged. Reinstall phaselens or retrain "
                "with `make zoo`."
            )
    return card


def load_zoo_model(name: str, *, device: str = "cpu") -> Any:
    """Load a zoo model after checking its weights and config against the sha256 in its card."""
    from phaselens.models.compressed.loader import load_model

    e = entry(name)
    verify(e)
    from phaselens.models.word_tokenizer import word_tokenizer

    model = load_model(e.path, device=device)
    model.name = name
    model.tokenizer = word_tokenizer(model.config.d_vocab)  # id N is the word "tN" (text routes: lm-eval)
    return model
