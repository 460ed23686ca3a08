"""The Triton backend of the linear recurrent family: ``host`` (launches of a spec's generated fused and chunked
kernels)."""
