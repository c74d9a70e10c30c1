"""The contract between analyses and models: the :class:`~phaselens.contract.protocol.PhaseModel` protocol,
the hook context and hook-name table, and capabilities. Models implement it; analyses use nothing else."""
