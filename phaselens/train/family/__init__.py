"""The paper's from-scratch family: the Qwen3 backbone with compressors, its recipes, data and training."""
