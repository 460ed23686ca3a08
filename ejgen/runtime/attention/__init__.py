"""The attention family at run time: the op's argument checks (``api``) and one subpackage or module
per backend (``triton``, ``gluon``, ``pallas``, ``xla``) that generated code imports."""
