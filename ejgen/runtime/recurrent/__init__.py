"""The linear recurrent family's runtime (docs/DESIGN.md §3 linear recurrent): argument checks and layout (api), the
call's static configuration (config), the chunk layout of packed and reversed sequences (packing), the kernel sets
(kernels) and the spec-independent code of each backend (xla, triton/, pallas/)."""
