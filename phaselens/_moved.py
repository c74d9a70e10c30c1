"""Deprecated module paths of phaselens 0.1 (before the layered layout), kept importable with a warning.

``import phaselens.interventions`` or ``from phaselens.files import atomic_write_dir`` still work and emit a
:class:`DeprecationWarning` that names the new path. The table is the CHANGELOG's list of moved modules.
``phaselens.evaluate`` and ``phaselens.record`` are not aliased: those names are the public functions.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

# old module path -> new module path; a target of "phaselens" means the names moved to several places and
# the package exports them all
MOVED: dict[str, str] = {
    "phaselens._quiet_tqdm": "phaselens.runtime.quiet_tqdm",
    "phaselens.adapters": "phaselens",
    "phaselens.adapters.deepseek_v4": "phaselens.models.deepseek_v4",
    "phaselens.adapters.deepseek_v4.loading": "phaselens.models.deepseek_v4.checkpoint",
    **{f"phaselens.adapters.deepseek_v4.{m}": f"phaselens.models.deepseek_v4.{m}" for m in (
        "adapter", "config", "construct", "engine", "gates", "geometry", "hookpoints", "memory", "nnsight_backend",
        "notices", "numerics", "patterns", "prefill", "quantization", "torch_hooks")},
    "phaselens.attribution": "phaselens.analyses.attribution",
    "phaselens.by_residue": "phaselens.stats.by_residue",
    "phaselens.checkpointing": "phaselens.runtime.checkpoints",
    "phaselens.cli": "phaselens.presentation.cli",
    "phaselens.distributed": "phaselens.runtime.distributed",
    "phaselens.effects": "phaselens.stats.effects",
    "phaselens.engine": "phaselens.models.compressed.engine",
    "phaselens.errors": "phaselens.core.errors",
    "phaselens.files": "phaselens.runtime.files",
    "phaselens.fingerprint": "phaselens.runtime.fingerprints",
    "phaselens.finite": "phaselens.runtime.finite",
    "phaselens.geometry": "phaselens.core.geometry",
    "phaselens.heads": "phaselens.core.heads",
    "phaselens.hooknames": "phaselens.contract.hooknames",
    "phaselens.interventions": "phaselens",
    "phaselens.interventions.ablate": "phaselens.analyses.ablation",
    "phaselens.interventions.cycling": "phaselens.analyses.cycling",
    "phaselens.interventions.knockout": "phaselens.analyses.knockouts",
    "phaselens.interventions.patch": "phaselens.analyses.patching",
    "phaselens.interventions.run": "phaselens.analyses.knockout_runs",
    "phaselens.items": "phaselens.analyses.items",
    "phaselens.labelled": "phaselens.core.labelled",
    "phaselens.loading": "phaselens.models.sources",
    "phaselens.maps": "phaselens.analyses.maps",
    "phaselens.models.attention": "phaselens.models.compressed.attention",
    "phaselens.models.cache": "phaselens.models.compressed.cache",
    "phaselens.models.compressor": "phaselens.models.compressed.compressor",
    "phaselens.models.config": "phaselens.models.compressed.config",
    "phaselens.models.deepseek_v41.loading": "phaselens.models.deepseek_v41.checkpoint",
    "phaselens.models.io": "phaselens.models.compressed.io",
    "phaselens.models.rope": "phaselens.models.compressed.rope",
    "phaselens.models.transformer": "phaselens.models.compressed.transformer",
    "phaselens.plan": "phaselens.runtime.planning",
    "phaselens.plots.knockout": "phaselens.plots.knockouts",
    "phaselens.progress": "phaselens.runtime.progress",
    "phaselens.protocol": "phaselens.contract.protocol",
    "phaselens.repair": "phaselens",
    "phaselens.repair.ensemble": "phaselens.models.ensemble",
    "phaselens.repair.table": "phaselens.analyses.repair",
    "phaselens.replicas": "phaselens.runtime.replicas",
    "phaselens.reporting": "phaselens.presentation.reporting",
    "phaselens.reporting.browser": "phaselens.presentation.reporting.browser",
    "phaselens.reporting.compute": "phaselens.presentation.reporting.compute",
    "phaselens.reporting.render": "phaselens.presentation.reporting.render",
    "phaselens.reporting.write": "phaselens.presentation.reporting.write",
    "phaselens.scoring": "phaselens.analyses.scoring",
    "phaselens.specialization": "phaselens.stats.specialization",
    "phaselens.stats.items": "phaselens.stats.item_data",
    "phaselens.stats.results": "phaselens.stats.outcomes",
    "phaselens.zoo": "phaselens.models.zoo",
    "phaselens.zoo.build": "phaselens.train.zoo",
    "phaselens.zoo.recipes": "phaselens.train.recipes",
}


class _Alias(types.ModuleType):
    """A stand-in module: every attribute is read from the module the code moved to."""

    def __init__(self, name: str, target: str) -> None:
        super().__init__(name)
        self.__dict__["_target"] = target

    def __getattr__(self, attr: str):
        return getattr(importlib.import_module(self.__dict__["_target"]), attr)

    def __dir__(self) -> list[str]:
        return dir(importlib.import_module(self.__dict__["_target"]))


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED:
            return importlib.util.spec_from_loader(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        new = MOVED[spec.name]
        where = "the package phaselens (import the names from there)" if new == "phaselens" else new
        warnings.warn(f"{spec.name} moved to {where} in phaselens 0.2; the old path will be removed.",
                      DeprecationWarning, stacklevel=2)
        return _Alias(spec.name, new)

    def exec_module(self, module) -> None:
        return None


def install() -> None:
    """Put the alias finder first (once), so an old path wins over the zoo's data folder ``phaselens/zoo``."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
