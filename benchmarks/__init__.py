"""Benchmarks: run each from the repository root as a module, e.g. ``python -m benchmarks.bench_model``
(``benchmarks/run_all.sh`` runs them all and keeps their JSON in benchmarks/results/)."""
