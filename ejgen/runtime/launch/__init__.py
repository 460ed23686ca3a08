"""Launching Triton kernels from JAX: jax-triton on NVIDIA GPUs, Triton's interpreter on the CPU."""
