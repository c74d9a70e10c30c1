"""Analyses: one module per analysis, each run by the shared pipeline (``runner``) on any
:class:`~phaselens.contract.protocol.PhaseModel`. Analyses never import a model class."""
