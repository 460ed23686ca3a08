"""The pooling family's runtime (docs/DESIGN.md §3 pooling): argument checks and layout (api), the call's static
configuration (config), work items (work), the kernel sets (kernels) and the spec-independent kernels of each
backend (xla, triton/, pallas/)."""
