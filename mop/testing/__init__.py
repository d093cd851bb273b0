"""Test support: the spawned-gloo-ranks harness used by every distributed test."""

from mop.testing.distributed import DistributedError, run_distributed

__all__ = ["DistributedError", "run_distributed"]
