"""Emitters of the linear recurrent family: the template contexts every backend shares and the hooks module's
(common; triton adds the kernels' hooks), the notation block (describe) and the op's files (op)."""
