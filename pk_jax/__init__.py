"""pk_jax: ParallelKittens for JAX.

Device-initiated multi-GPU collectives, a Hopper GEMM and attention of our own, GEMMs fused with their
collectives (forward and backward), context and expert parallelism, as XLA FFI custom calls. Every op is
shaped like its jax.lax counterpart and falls back to it where the GPU path is unavailable. Multi-process
jobs: pk_jax.initialize() (python -m pk_jax.launch starts the ranks).
"""

from pk_jax import runtime
from pk_jax._ext import available as extension_available
from pk_jax.attention import attention
from pk_jax.distributed import DistributedInfo, initialize
from pk_jax.collectives import all_gather, all_reduce, all_to_all, pcast, reduce_scatter
from pk_jax.context import ring_attention, ulysses_attention
from pk_jax.matmul import matmul
from pk_jax import moe
from pk_jax.moe import grouped_matmul
from pk_jax.tp_gemm import all_gather_matmul, matmul_all_reduce, matmul_reduce_scatter

__all__ = [
    "DistributedInfo", "attention", "initialize", "all_gather", "all_gather_matmul", "all_reduce", "all_to_all",
    "extension_available", "grouped_matmul", "matmul", "matmul_all_reduce", "matmul_reduce_scatter", "moe",
    "pcast", "reduce_scatter", "ring_attention", "runtime", "ulysses_attention",
]
__version__ = "0.1.0"
