"""The Triton backend of the pooling family: ``host`` (tiles, work items, launches of a spec's generated kernels)."""
