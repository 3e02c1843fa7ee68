"""pk_jax: ParallelKittens for JAX.

Device-initiated multi-GPU collectives and a Hopper GEMM of our own (the base of the fused
GEMM+communication kernels) as XLA FFI custom calls. Every op is shaped like its jax.lax counterpart and falls back to it where
the GPU path is unavailable.
"""

from pk_jax import runtime
from pk_jax._ext import available as extension_available
from pk_jax.attention import attention
from pk_jax.distributed import DistributedInfo, initialize
from pk_jax.collectives import all_gather, all_reduce, all_to_all, reduce_scatter
from pk_jax.context import ring_attention, ulysses_attention
from pk_jax.matmul import matmul
from pk_jax.tp_gemm import all_gather_matmul, matmul_all_reduce, matmul_reduce_scatter

__all__ = [
    "attention", "DistributedInfo", "initialize", "all_gather", "all_gather_matmul", "all_reduce", "all_to_all", "extension_available", "matmul",
    "matmul_all_reduce", "matmul_reduce_scatter", "reduce_scatter", "ring_attention", "runtime", "ulysses_attention",
]
__version__ = "0.1.0"
