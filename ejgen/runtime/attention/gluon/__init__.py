"""The hand-written Hopper attention kernels (Gluon), a declared kernel set of the triton platform."""
