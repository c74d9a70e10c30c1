"""Parallelism over torch.distributed ranks: where a process stands (world), the split of an analysis's work
across ranks, model replicas over groups of GPUs, and progress bars (shown on rank 0 only)."""
