"""`pk_jax.sharding.einsum`: the dense-layer einsums (`...d,df->...f`, `bsd,fd->bsf`, ...) on the
sharding-aware matmul, for code written with jnp.einsum."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pk_jax.sharding.jit_matmul import matmul


def _parse(subscripts: str) -> tuple[str, str, str, str]:
    """'...d,df->...f' -> (rows '...', contraction 'd', w subscripts 'df', features 'f')."""
    s = subscripts.replace(" ", "")
    try:
        lhs, out = s.split("->")
        xs, ws = lhs.split(",")
    except ValueError:
        raise ValueError(f"pk_jax.sharding.einsum: subscripts={subscripts!r}; write it as 'x,w->out', "
                         f"e.g. '...d,df->...f'") from None
    rows, d = xs[:-1], xs[-1:]
    if len(ws) != 2 or d not in ws or not d.isalpha():
        raise ValueError(f"pk_jax.sharding.einsum: subscripts={subscripts!r}; w must be 2-D and contract with "
                         f"the last dim of x ('...d,df->...f' or '...d,fd->...f')")
    f = ws.replace(d, "", 1)
    if out != rows + f or f in rows or d in rows:
        raise ValueError(f"pk_jax.sharding.einsum: subscripts={subscripts!r}; the output must be x's leading "
                         f"dims followed by w's other dim: '{xs},{ws}->{rows + f}'")
    return rows, d, ws, f


def einsum(subscripts: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """jnp.einsum(subscripts, x, w) for dense layers, lowered as `pk_jax.sharding.matmul`.

    Args:
      subscripts: x's dims ending with the contraction, w's two dims, then x's leading dims and w's
        other dim: '...d,df->...f', 'bsd,df->bsf', or with w stored (f, d): '...d,fd->...f'.
      x: (..., d). w: (d, f) or (f, d) as the subscripts say.

    Returns:
      (..., f), as jnp.einsum with float32 accumulation.
    """
    rows, d, ws, _ = _parse(subscripts)
    x, w = jnp.asarray(x), jnp.asarray(w)
    if rows != "..." and x.ndim != len(rows) + 1:
        raise ValueError(f"pk_jax.sharding.einsum: x has {x.ndim} dims but subscripts={subscripts!r} name "
                         f"{len(rows) + 1}")
    return matmul(x, w if ws[0] == d else w.T)
