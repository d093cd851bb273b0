"""mop: Mixture-of-Parallelisms training stack for Mixture-of-Experts language models."""
