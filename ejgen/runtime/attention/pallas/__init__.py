"""The Pallas attention kernels (GPU through the Triton lowering, TPU through Mosaic) and their plumbing."""
