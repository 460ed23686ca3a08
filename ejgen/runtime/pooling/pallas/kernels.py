"""The Pallas backend of the pooling family, shared by every spec: the GPU kernels (Triton lowering, `gpu`) when
lowering for CUDA or ROCm, the TPU kernels (Mosaic, `tpu`) for TPUs, interpreted on any other platform
(``ejgen.runtime.core.pallas.interpret_kernels`` picks which)."""

from __future__ import annotations

import functools

from ejgen.runtime.core import pallas as _platforms
from ejgen.runtime.pooling.pallas.gpu import GpuKernels
from ejgen.runtime.pooling.pallas.tpu import TpuKernels

available = _platforms.available


class PallasPooling:
    """Forward and backward of one spec's reduction (``kind``, ``scaled``), on the kernels of the lowering
    platform."""

    def __init__(self, name: str, kind: str, scaled: bool):
        self.gpu = GpuKernels(name, kind, scaled)
        self.tpu = TpuKernels(name, kind, scaled)

    def forward(self, x, w, ctx, cfg, save):
        gpu = functools.partial(self.gpu.forward, cfg=cfg, save=save)
        tpu = functools.partial(self.tpu.forward, cfg=cfg, save=save)
        return _platforms.dispatch(gpu, tpu, x, w, ctx)

    def backward(self, x, w, ctx, res, dy, cfg):
        gpu = functools.partial(self.gpu.backward, cfg=cfg)
        tpu = functools.partial(self.tpu.backward, cfg=cfg)
        return _platforms.dispatch(gpu, tpu, x, w, ctx, res, dy)
