"""The Pallas backend of the pooling family: ``kernels`` (PallasPooling: the GPU or TPU kernels per lowering
platform), ``gpu`` (Triton lowering) and ``tpu`` (Mosaic)."""
