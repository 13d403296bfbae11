"""Compute kernels. Each has a torch reference (used on CPU and as the test oracle)."""
