"""The fake-GPU layer: the GPU paths as rank 3 of an 8-rank NCCL world on cuda:3, on a CPU (fakegpu.py)."""
