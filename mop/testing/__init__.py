"""Test and measurement support: the spawned-ranks harness used by every distributed test (gloo on CPU,
NCCL on CUDA), and the memory instruments the tests and the benchmarks both read (`memory`)."""

from mop.testing.distributed import DistributedError, cuda_ranks_available, rank_device, run_distributed

__all__ = ["DistributedError", "cuda_ranks_available", "rank_device", "run_distributed"]
