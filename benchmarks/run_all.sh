#!/usr/bin/env bash
# Run every benchmark and keep its JSON in benchmarks/results/ (quoted by docs/benchmarks.md).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p benchmarks/results
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
for b in bench_maps bench_record bench_eval bench_model bench_report bench_fingerprint bench_v4_numerics bench_v41_packed bench_family bench_v4_maps bench_v41_maps bench_causal_map bench_import bench_distributed bench_served bench_lm_eval; do
  echo "== $b" >&2
  nice_level=0
  [ "$b" = bench_v4_maps ] || [ "$b" = bench_v41_maps ] && nice_level=15  # CPU-timed and long (an hour or more on 2 cores): be kind
  nice -n "$nice_level" .venv/bin/python -m "benchmarks.$b" > "benchmarks/results/$b.json"
done
