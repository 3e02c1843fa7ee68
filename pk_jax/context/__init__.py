"""Context parallelism: attention over a sequence sharded across a mesh axis (ring and Ulysses)."""

from pk_jax.context.ring import ring_attention
from pk_jax.context.ulysses import ulysses_attention

__all__ = ["ring_attention", "ulysses_attention"]
