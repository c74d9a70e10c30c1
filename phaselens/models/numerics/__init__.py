"""Bytes of modules (:mod:`.sizing`), read by the kinds' loaders and by memory estimates. Every other
shared numeric lives in :mod:`phaselens.models.parts`."""
