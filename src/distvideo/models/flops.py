"""Analytic FLOP counts of model forwards, for achieved FLOP/s and model FLOP utilisation (MFU).

Only matrix multiplications are counted, each as 2*m*n*k (a multiply and an add per term). Norms, RoPE, the
adaLN modulation, activations, softmax, bias and residual adds and the sinusoidal timestep embedding are
elementwise and left out. Attention over the text counts every text position the transformer is given, padding
included, because that is what it computes.
"""

from __future__ import annotations

import math

__all__ = ["matmul_flops"]


def matmul_flops(m: int, n: int, k: int) -> int:
    """FLOPs of one (m x k) @ (k x n) matmul: 2*m*n*k."""
    return 2 * math.prod((m, n, k))
