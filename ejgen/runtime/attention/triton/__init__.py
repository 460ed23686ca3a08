"""Host side of the generated Triton attention kernels: launch, configs, tuning cache, shared jit helpers."""
