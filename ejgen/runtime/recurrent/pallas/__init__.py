"""The Pallas backend of the linear recurrent family: the chunk arithmetic (chunk), the GPU kernels (gpu, Triton
lowering), the TPU kernels (tpu, Mosaic) and the dispatch and layout shared by every spec (kernels)."""
