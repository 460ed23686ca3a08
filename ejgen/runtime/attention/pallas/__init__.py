"""The Pallas attention kernels and their plumbing: ``kernels`` (the front a generated ``pallas.py``
builds: `PallasAttention`, dispatching per lowering platform), ``hooks`` (the spec's `Hooks`, the
`Tile` they see, the tile math both kernel families share), ``gpu`` (GPU kernels, Triton lowering),
``tpu`` (TPU kernels, Mosaic) and ``common`` (spec-independent helpers, ``interpret_kernels``)."""
