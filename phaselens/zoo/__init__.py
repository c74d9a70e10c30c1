"""The embedded zoo: tiny compressed models trained here, plus their full-attention control.

Each model lives in ``phaselens/zoo/<name>/`` as ``model.safetensors`` + ``config.json`` (config and the
default task) + ``card.json`` (training settings, loss curve, per-residue evaluation, battery, sha256 of the
weights) + ``eval_batch.safetensors`` (a small fixed evaluation batch to re-check the card). Load with
``phaselens.load("zoo:NAME")``; the weights' sha256 is verified on every load.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phaselens.errors import ZooError

ZOO_DIR = Path(__file__).resolve().parent
DEFAULT_MODEL = "w8s4"
DEFAULT_CONTROL = "full"


@dataclass(frozen=True)
class ZooEntry:
    name: str
    path: Path

    @property
    def card(self) -> dict[str, Any]:
        return json.loads((self.path / "card.json").read_text())


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def list_models() -> list[str]:
    """Names of the shipped zoo models, sorted."""
    return sorted(p.name for p in ZOO_DIR.iterdir() if (p / "model.safetensors").is_file())


def entry(name: str) -> ZooEntry:
    names = list_models()
    if name not in names:
        raise ZooError(f"no zoo model {name!r}; available: {', '.join(names) or 'none (run make zoo)'}.")
    return ZooEntry(name, ZOO_DIR / name)


def load_zoo_model(name: str, *, device: str = "cpu") -> Any:
    """Load a zoo model after checking its weights against the sha256 in its card."""
    from phaselens.models.io import load_model

    e = entry(name)
    card = e.card
    digest = sha256_file(e.path / "model.safetensors")
    if card.get("weights_sha256") != digest:
        raise ZooError(
            f"zoo model {name!r}: model.safetensors has sha256 {digest[:12]}..., but its card says "
            f"{str(card.get('weights_sha256'))[:12]}...; reinstall phaselens or retrain with `make zoo`."
        )
    model = load_model(e.path, device=device)
    model.name = name
    return model
