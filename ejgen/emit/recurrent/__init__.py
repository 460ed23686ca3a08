"""Emitters of the linear recurrent family: template contexts per backend (triton, pallas, xla), the notation block
(describe) and the op's files (op)."""
