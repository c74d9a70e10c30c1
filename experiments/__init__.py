"""Experiments whose results the docs quote: each writes (or prints) a JSON file in docs/data/.

Run each from the repository root as a module; its docstring gives the exact command that reproduces its
JSON, e.g. ``python -m experiments.stats_simulations --tables 2000``.
"""
