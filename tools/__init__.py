"""Maintenance of the repository's generated files: docs pages, notebooks and the shipped zoo.

Run each from the repository root as a module, e.g. ``python -m tools.gen_zoo_docs`` (``make docs`` runs the
doc generators; ``make zoo`` retrains the zoo and regenerates docs/zoo.md).
"""
