"""Checks that need a CUDA GPU, run by hand on a GPU machine (not collected by pytest: no ``test_`` files).

From the repository root: ``python -m tests.gpu.session [--budget SECONDS]`` runs every check, each in its own
process; ``python -m tests.gpu.packed``, ``tests.gpu.reliability`` and ``tests.gpu.served`` run one.
"""
