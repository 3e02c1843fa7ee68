"""Ulysses (DeepSpeed) sequence parallelism: trade the sequence sharding for a head sharding.

An all-to-all turns each member's (B, S/G, N, H) into (B, S, N/G, H): the whole sequence for N/G
heads. Attention then runs locally and unchanged (jax.nn.dot_product_attention), and a second
all-to-all restores the sequence sharding. Both all-to-alls are pk_jax.all_to_all (device-initiated
on GPUs, jax.lax.all_to_all elsewhere) and differentiable, so jax.grad needs nothing extra. The
price: the full-sequence K/V of N/G heads lives on every member, and G must divide the head count.

Head chunks ($PK_JAX_ULYSSES_CHUNKS=c, read when traced): each member's N/G heads are cut into c chunks, each
exchanged, attended and sent back on its own, so that chunk i+1's exchange has no dependency on chunk i's attention
and can run under it. $PK_JAX_ULYSSES_A2A picks the exchange:
- "auto" (default): the windowed pipeline at G 2 on the GPUs of one process (below; 8 chunks), else "pk";
- "pk": one pk_jax.all_to_all each way (a kernel on XLA's stream, so no overlap; c = 1 unless set);
- "lax": jax.lax.all_to_all (NCCL, which XLA may schedule asynchronously);
- "async": the exchanges on the side stream, chunk i+1's q/k/v and chunk i-1's output moving under chunk i's
  attention, as the issue's "a head's attention starts as soon as its slices have landed"; the backward pipelines
  its exchanges the same way. Windowed all-to-alls (the windowed pipeline) with the copy engines
  ($PK_JAX_RING_SHIFT_ENGINE=copy, the default) outside multi-process jobs; else shifts at distances 1..G-1
  (pk_jax/context/async_all_to_all.py).
The windowed pipeline (pk_jax/context/window_exchange.py): chunk i is read from the whole q/k/v by the copy engines
and its output written into its heads of the whole result; only peer blocks travel on the side stream (flagged to
prefer overlap with compute, they run beside an attention kernel holding every SM), and each own block is placed on
XLA's stream ($PK_JAX_WINDOW_OWN, default "xla": a local strided copy on the side stream waited for free SMs and
held up the peer copies behind it); the own input blocks of the first chunks after chunk 0 are placed while chunk
0's exchange is on the wire ($PK_JAX_ULYSSES_PREFILL, own_prefill). On 2x H100 (2026-11-26), 8 chunks, cuDNN between:
forward 1.68 / 1.46 / 1.27x the lax composition at S 2048 / 4096 / 8192 (one pk exchange each way: 1.33 / 1.23 /
1.16x), fwd+bwd 1.31 / 1.24 / 1.14x (1.25 / 1.18x). The shift-based async chunks lost to one exchange on 4x H100
(per chunk a slice of every array and a select assembling the arrivals cost more than the overlap saved;
docs/benchmarks.md), and chunks of one batch element (every block contiguous after a transpose) lost on 2x H100
(0.95-1.05x). $PK_JAX_ULYSSES_HALF_ENDS=1 makes the first and last chunks half as wide: less exchange exposed
before the first attention and after the last (on 2x H200, 2026-11-26, 0.01-0.02x ahead in five rows of one run:
within noise, so opt-in; with the prefill, 2026-11-28, 0-0.03x behind). On 2x H200 (2026-11-28, three runs) the
defaults give 1.73-1.77 / 1.43-1.44 / 1.18-1.20x forward at S 2048 / 4096 / 8192, against 1.66-1.67 / 1.40 /
1.16-1.17x with no prefill.
$PK_JAX_ULYSSES_LOCAL=pk makes the local attention our kernels (they can leave SMs free for the SM shift); the
default is jax.nn.dot_product_attention (cuDNN on GPUs). Same result for every setting (the same per-head attention).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax

from pk_jax._env import choice_setting, int_setting
from pk_jax.collectives import all_to_all
from pk_jax.context.async_all_to_all import all_to_all_done, all_to_all_start
from pk_jax import sdpa
from pk_jax.context import window_exchange
from pk_jax.context.ring import check_attention_args
from pk_jax.context.ring_schedule import Layout
from pk_jax.context.ring_shift import after_token, shift_done, shift_engine, shift_sms
from pk_jax.sharding import group_size, normalize_axis_name
from pk_jax.sharding.mesh_groups import AxisName
from pk_jax.sharding.zigzag import from_zigzag, to_zigzag


def kv_head_replication(kv_heads: int, q_heads: int, g: int) -> int:
    """How many times each K/V head is repeated so that G divides the K/V head count (1 if it does).

    With K not divisible by G, every K/V head is repeated rep = G / gcd(K, G) times in place (head j
    becomes heads j*rep .. j*rep+rep-1), which keeps query head n on its K/V head n // (N / K) and makes
    K * rep divisible by G; it needs N divisible by G, as Ulysses always does.
    """
    rep = g // math.gcd(kv_heads, g)
    assert (q_heads // kv_heads) % rep == 0, (kv_heads, q_heads, g)
    return rep


CHUNKS_VAR = "PK_JAX_ULYSSES_CHUNKS"
A2A_VAR = "PK_JAX_ULYSSES_A2A"
EXCHANGES = ("auto", "pk", "lax", "async")
AUTO_WINDOWED_CHUNKS = 8  # head chunks of the automatic windowed pipeline (2x H100, 2026-11-26: 8 >= 16 > 4)
LOCAL_VAR = "PK_JAX_ULYSSES_LOCAL"
RESERVE_VAR = "PK_JAX_ULYSSES_RESERVE_SMS"
OWN_VAR = "PK_JAX_WINDOW_OWN"
HALF_ENDS_VAR = "PK_JAX_ULYSSES_HALF_ENDS"
PREFILL_VAR = "PK_JAX_ULYSSES_PREFILL"
DEFAULT_PREFILL = 4  # chunks whose own blocks fit under chunk 0's exchange at G 2 (see own_prefill)
BWD_BARRIER_VAR = "PK_JAX_ULYSSES_BWD_BARRIER"


def head_chunks(default: int = 1) -> int:
    """$PK_JAX_ULYSSES_CHUNKS: head chunks per exchange (`default` when unset), read when traced."""
    return int_setting(CHUNKS_VAR, default, minimum=1, owner="pk_jax.ulysses_attention", what="a count of head chunks")


def backward_barrier() -> str:
    """$PK_JAX_ULYSSES_BWD_BARRIER, read when traced: "none" (default) or "chunks", the async backward held behind
    one optimization barrier over d_out and every chunk's forward attention output (opt-in; see _async_bwd)."""
    return choice_setting(BWD_BARRIER_VAR, "none", ("none", "chunks"), owner="pk_jax.ulysses_attention")


def exchange() -> str:
    """$PK_JAX_ULYSSES_A2A: "auto" (default: see _auto_windowed), "pk" (pk_jax.all_to_all), "lax"
    (jax.lax.all_to_all) or "async" (the head chunks' exchanges on the side stream under the previous chunk's
    attention), read when traced."""
    return choice_setting(A2A_VAR, "auto", EXCHANGES, owner="pk_jax.ulysses_attention")


def _on_gpus() -> bool:
    return jax.default_backend() == "gpu"


def _chunk_plan(xs: list[jax.Array], g: int, default: int) -> tuple[int, window_exchange.HeadSpans]:
    """(c, the windowed pipeline's chunks): c head chunks ($PK_JAX_ULYSSES_CHUNKS, else `default`) cut down so they
    split every member's query and K/V heads evenly (GQA: a chunk's queries keep their K/V heads); with
    $PK_JAX_ULYSSES_HALF_ENDS=1 (read when traced) c + 1 windowed chunks, the first and the last
    half as wide, where the blocks split that finely."""
    c = math.gcd(head_chunks(default), xs[0].shape[2] // g, xs[1].shape[2] // g)
    half = choice_setting(HALF_ENDS_VAR, "0", ("0", "1"), owner="pk_jax.ulysses_attention") == "1"
    spans = window_exchange.HeadSpans.half_ends(c)
    return c, spans if half and spans.fits([x.shape[2] // g for x in xs]) else window_exchange.HeadSpans.uniform(c)


def _windows_fit(xs: list[jax.Array], g: int, chunks: window_exchange.HeadSpans) -> bool:
    """Whether the windowed pipeline can serve: every member a GPU of this process, and every window of q, k, v
    (and so of the output, dO and the gradients, which have their shapes) a 3-D copy layout."""
    from pk_jax.distributed import is_multiprocess

    return not is_multiprocess() and window_exchange.usable([x.shape for x in xs], g, chunks, xs[0].dtype.itemsize)


def _auto_windowed(xs: list[jax.Array], g: int) -> bool:
    """What "auto" runs: the windowed pipeline (async exchanges as windowed all-to-alls by the copy engines, own
    blocks placed by XLA, AUTO_WINDOWED_CHUNKS head chunks, cuDNN between) at G 2 on the GPUs of one process, where
    it was measured faster (2x H100, 2026-11-26: forward 1.68 / 1.46 / 1.27x the lax composition at S 2048 / 4096 /
    8192 against 1.33 / 1.23 / 1.16x for one pk exchange each way; fwd+bwd 1.31 / 1.24 / 1.14x against 1.25 /
    1.18x); elsewhere one pk exchange each way (the windowed pipeline is not yet measured at G > 2)."""
    return g == 2 and _on_gpus() and _windows_fit(xs, g, _chunk_plan(xs, g, AUTO_WINDOWED_CHUNKS)[1])


def local_kernel() -> bool:
    """$PK_JAX_ULYSSES_LOCAL=pk: the local attention is our kernel (pk_jax.attention's, forward and backward),
    which leaves the side stream's shift its SMs under PK_JAX_ULYSSES_A2A=async (cuDNN's kernels may hold every
    SM until they end); "" or "default": jax.nn.dot_product_attention with `implementation`. Read when traced."""
    return choice_setting(LOCAL_VAR, "default", ("default", "pk"), owner="pk_jax.ulysses_attention") == "pk"


def window_reserve_sms() -> int:
    """$PK_JAX_ULYSSES_RESERVE_SMS: SMs our local attention leaves free beside head-chunked windowed exchanges
    (default 0, read when traced). The peer copies, flagged to prefer overlap with compute, ran beside a kernel
    holding every SM; leaving 16 free slowed the attention by ~9 % and moved nothing (2x H100, 2026-11-26). Only
    the own block's local strided copy ($PK_JAX_WINDOW_OWN=copy) waits for free SMs."""
    return int_setting(RESERVE_VAR, 0, minimum=0, owner="pk_jax.ulysses_attention", what="a count of SMs")


def own_on_xla() -> bool:
    """$PK_JAX_WINDOW_OWN: who places each member's own block in the windowed exchanges, "xla" (default: a
    dynamic-update-slice on XLA's stream once the exchange has landed) or "copy" (a local strided copy on the side
    stream, ahead of the peer copies). Read when traced."""
    return choice_setting(OWN_VAR, "xla", ("xla", "copy"), owner="pk_jax.ulysses_attention") == "xla"


def own_prefill() -> int:
    """$PK_JAX_ULYSSES_PREFILL (default DEFAULT_PREFILL), read when traced: with own blocks placed by XLA, how many
    chunks after the first get their own blocks placed while chunk 0's exchange is on the wire, where XLA's stream
    has nothing else to do. Placing one own block reads and writes 1/G of a chunk's array in HBM (~3 TB/s); chunk
    0's exchange sends (G-1)/G of three arrays over NVLink (~370 GB/s), so at G 2 about four chunks' three own blocks
    fit under it. Each one placed early leaves XLA's stream between two attention kernels (at S 2048 / 8192, 2x
    H200: ~22 / 81 us per block, 3 blocks per chunk). The price: those chunks' exchange buffers are held from the
    start (at B16 S 8192 H128 D128, 0.75 GiB per chunk)."""
    return int_setting(PREFILL_VAR, DEFAULT_PREFILL, minimum=0, owner="pk_jax.ulysses_attention",
                       what="a count of head chunks")


def chunk_heads(x: jax.Array, g: int, c: int, i: int) -> jax.Array:
    """Chunk i of c of every member's block of heads: (B, T, heads, H) -> (B, T, heads / c, H), member j's
    block of heads/G cut into c runs, run i of every block kept in member order (so an all-to-all over the
    heads hands member j its run i)."""
    b, t, heads, h = x.shape
    return x.reshape(b, t, g, c, heads // (g * c), h)[:, :, :, i].reshape(b, t, heads // c, h)


def unchunk_heads(chunks: list[jax.Array], g: int) -> jax.Array:
    """Inverse of chunk_heads over i = 0 .. c-1: the c (B, T, heads / c, H) chunks -> (B, T, heads, H)."""
    b, t, part, h = chunks[0].shape
    blocks = [x.reshape(b, t, g, part // g, h) for x in chunks]
    return jnp.stack(blocks, axis=3).reshape(b, t, part * len(chunks), h)


def ulysses_attention(q: jax.Array, k: jax.Array, v: jax.Array, axis_name: AxisName, *, causal: bool = False,
                      scale: float | None = None, layout: Layout = "contiguous",
                      implementation: Literal["xla", "cudnn"] | None = None) -> jax.Array:
    """Attention over a sequence sharded along `axis_name` by head-parallel all-to-alls.

    Call inside `jax.shard_map` with the sequence axis of q, k, v sharded over `axis_name` (G members).

    Args:
      q: (B, T, N, H) this member's queries, T = S / G; G must divide N.
      k, v: (B, T, K, H), K dividing N. If G does not divide K, each K/V head is replicated
        G / gcd(K, G) times before the exchange (see kv_head_replication) instead of failing.
      axis_name: the mesh axis (or tuple of axes) the sequence is sharded over.
      causal: mask key positions after the query's global position.
      scale: score scale, default 1/sqrt(H).
      layout: "contiguous" (member r holds positions [r T, (r+1) T)) or "zigzag" (the order of
        pk_jax.sharding.to_zigzag, as ring_attention's default); the result keeps the input's layout.
      implementation: the local attention's, as jax.nn.dot_product_attention takes it ("cudnn", "xla");
        None: cuDNN where it takes the call, else XLA (pk_jax.sdpa; jax's own None is always XLA).

    Returns:
      (B, T, N, H) in q's dtype: this member's rows of the attention output.
    """
    check_attention_args("ulysses_attention", q, k, v)
    g = group_size(axis_name)
    n, kv_heads = q.shape[2], k.shape[2]
    if n % g:
        raise ValueError(f"pk_jax.ulysses_attention: the group size {g} must divide the query heads ({n}); "
                         f"use ring_attention, or a smaller sequence-parallel axis")
    if layout not in ("zigzag", "contiguous"):
        raise ValueError(f"pk_jax.ulysses_attention: layout={layout!r}; use 'zigzag' or 'contiguous'")
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"pk_jax.ulysses_attention: layout='zigzag' needs an even local sequence length; "
                         f"got {q.shape[1]}")
    rep = kv_head_replication(kv_heads, n, g)
    if rep > 1:
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)

    mode = exchange()
    auto_windowed = mode == "auto" and _auto_windowed([q, k, v], g)
    if mode == "auto":
        mode = "async" if auto_windowed else "pk"
    c, chunks = _chunk_plan([q, k, v], g, AUTO_WINDOWED_CHUNKS if auto_windowed else 1)
    windowed = auto_windowed or (mode == "async" and g > 1 and _windowed([q, k, v], g, chunks))
    # SMs our attention leaves free beside the side stream: the SM shift's CTAs, or $PK_JAX_ULYSSES_RESERVE_SMS for
    # strided windowed copies; none without async exchanges.
    reserve = 0 if mode != "async" else window_reserve_sms() if windowed else shift_sms()
    pk_reserve = reserve if local_kernel() else None
    cfg = _Local(bool(causal), scale, layout, implementation, g, pk_reserve)
    if mode == "async" and g > 1:  # the custom VJP takes the settings as static (hashable) arguments
        own_xla = windowed and own_on_xla()
        static = dataclasses.replace(cfg, scale=None if scale is None else float(scale), windowed=windowed,
                                     own_on_xla=own_xla, chunks=chunks if windowed else None,
                                     prefill=own_prefill() if own_xla else 0)
        return _ulysses_async(q, k, v, normalize_axis_name(axis_name), c, static)
    a2a = (lambda x, split, concat: all_to_all(x, axis_name, split, concat, tiled=True)) if mode != "lax" else \
        (lambda x, split, concat: jax.lax.all_to_all(x, axis_name, split, concat, tiled=True))

    def attend(q, k, v):  # one chunk: exchange, local attention, exchange back
        return a2a(cfg(a2a(q, 2, 1), a2a(k, 2, 1), a2a(v, 2, 1)), 1, 2)

    if c == 1:
        return attend(q, k, v)
    return unchunk_heads([attend(*(chunk_heads(x, g, c, i) for x in (q, k, v))) for i in range(c)], g)


@dataclasses.dataclass(frozen=True)
class _Local:
    """The attention between the exchanges, on (B, S, heads / G, H) in the exchange's order (hashable with a
    Python float scale: the async path's custom_vjp takes it as a static argument)."""
    causal: bool
    scale: float | None
    layout: str
    implementation: str | None
    g: int
    pk_reserve: int | None = None  # our kernel leaving this many SMs free (local_kernel()), None: dot_product_attention
    windowed: bool = False  # the async pipeline's exchanges are windowed all-to-alls (_windowed), both ways
    own_on_xla: bool = False  # windowed, each own block placed on XLA's stream (own_on_xla())
    chunks: window_exchange.HeadSpans | None = None  # windowed: the head chunks (_chunks)
    prefill: int = 0  # own_on_xla: chunks after the first whose own input blocks are placed under chunk 0's exchange

    def __call__(self, q, k, v):
        from pk_jax.attention import _kernel_attention, _kernel_refusal, _offset_array  # it imports this package

        if self.layout == "zigzag":  # the whole sequence in global order, attention, back
            q, k, v = (from_zigzag(x, self.g, axis=1) for x in (q, k, v))
        scale = 1.0 / math.sqrt(q.shape[-1]) if self.scale is None else self.scale
        if self.pk_reserve is not None and _kernel_refusal(q, k, scale) is None:
            out = _kernel_attention(q, k, v, _offset_array(0, 0), scale, self.causal, self.pk_reserve)[0]
        else:
            out = sdpa.dot_product_attention(q, k, v, scale=self.scale, is_causal=self.causal,
                                             implementation=self.implementation)
        return to_zigzag(out, self.g, axis=1) if self.layout == "zigzag" else out


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _ulysses_async(q, k, v, axes, c, local):
    return _async_forward(q, k, v, axes, c, local, False)[0]


def _pipelined(chunks: list[list[jax.Array]], compute, axes) -> list[list[jax.Array]]:
    """For each chunk i: its arrays exchanged sequence -> heads (all_to_all split 2, concat 1), compute(i, arrays)
    -> arrays, those exchanged back (split 1, concat 2). The exchanges run on the side stream
    (pk_jax/context/async_all_to_all.py): chunk i+1's inputs and chunk i-1's results move while chunk i computes.
    Each wait drains the side stream, so chunk i's inputs are waited for before chunk i+1's exchange starts, and
    barriers hold XLA to that order."""
    start = lambda xs, split, concat: [all_to_all_start(x, axes, split, concat) for x in xs]
    pending_in, pending_out = start(chunks[0], 2, 1), []
    res = None
    for i in range(len(chunks)):
        xs = [all_to_all_done(p, after=() if res is None else res) for p in pending_in]
        issued = []
        if i + 1 < len(chunks):  # its inputs read after the wait above: started behind it on the side stream
            pending_in = start(lax.optimization_barrier((chunks[i + 1], xs))[0], 2, 1)
            issued += [t for p in pending_in for t in p.tokens]
        if res is not None:
            pending_out.append(start(lax.optimization_barrier((res, xs))[0], 1, 2))
            issued += [t for p in pending_out[-1] for t in p.tokens]
        res = compute(i, after_token(xs, *issued) if issued else xs)  # not movable above those starts
    pending_out.append(start(res, 1, 2))
    return [[all_to_all_done(p, after=res) for p in ps] for ps in pending_out]


def _windowed(xs: list[jax.Array], g: int, chunks: window_exchange.HeadSpans) -> bool:
    """Whether an explicit "async" pipeline's exchanges are windowed all-to-alls (pk_jax/context/window_exchange.py):
    with copy engines ($PK_JAX_RING_SHIFT_ENGINE=copy, the default) where the windows fit. Decided once, for forward and
    backward."""
    return shift_engine() == "copy" and _windows_fit(xs, g, chunks)


def _pipelined_in_place(xs: list[jax.Array], chunks: window_exchange.HeadSpans, compute, axes,
                        own_on_xla: bool, prefill: int = 0) -> list[jax.Array]:
    """_pipelined with windowed all-to-alls: chunk i's inputs read from the whole (B, T, heads, D) xs, its results
    (B, S, w, D) written into their heads of the whole outputs (B, T, heads, D), so no head-chunk slice, no assembly of
    the arrivals in source order and no unchunk pass. Same order on the side stream as _pipelined: chunk i+1's inputs
    and chunk i-1's results move under chunk i's compute; each wait drains the side stream, so the results of chunk
    i-2 have landed once chunk i's inputs have (their wait is placed there: it costs nothing then). own_on_xla: the
    side stream carries only the peer blocks; each own block is placed on XLA's stream once its exchange landed,
    except the inputs of chunks 1 .. prefill: those are placed into buffers of their own (window_exchange.uninitialized)
    after chunk 0's exchange has started and before its wait (own_prefill), and their exchanges fill the rest."""
    g, c = group_size(axes), len(chunks.spans)
    windows_in = lambda shape, i: window_exchange.heads_in(shape, g, chunks, i)
    windows_out = lambda shape, i: window_exchange.heads_out(shape, g, chunks, i)

    def start(arrays, i, windows, into=None, placed=False):
        pending = []
        for x, acc in zip(arrays, into or [None] * len(arrays)):
            src, dst, shape = windows(x.shape, i)
            y, token = window_exchange.window_all_to_all_start(x, axes, src=src, dst=dst, out_shape=shape, into=acc,
                                                               own=not own_on_xla)
            pending.append((x, y, token, src, dst, own_on_xla and not placed))
        return pending

    start_out = lambda results, i, into: start(results, i, windows_out, into)

    def finish(pending, after):
        done = [(shift_done((y,), token, keep_alive=sent, after=after)[0], sent, src, dst, place)
                for sent, y, token, src, dst, place in pending]
        return [window_exchange.place_own(sent, y, axes, src, dst) if place else y for y, sent, src, dst, place in done]

    def prefilled(arrays, i):  # chunk i's exchange buffers with this member's own blocks already in place
        out = []
        for x in arrays:
            src, dst, shape = windows_in(x.shape, i)
            out.append(window_exchange.place_own(x, window_exchange.uninitialized(x, shape), axes, src, dst))
        return out

    tokens = lambda pending: [p[2] for p in pending]
    pending_in, pending_out = start(xs, 0, windows_in), []
    # Placed once chunk 0's copies are on the wire (after its starts), and before its wait (its `after`).
    early = {i: prefilled(after_token(xs, *tokens(pending_in)), i) for i in range(1, min(prefill, c - 1) + 1)}
    start_in = lambda arrays, i: start(arrays, i, windows_in, early.get(i), placed=i in early)
    outs = None  # the whole outputs so far (chunk 0's exchange starts them)
    res = None
    for i in range(c):
        ins = finish(pending_in, list(early.values()) if res is None else res)
        if pending_out:  # chunk i-2's results: landed with the wait above
            outs = finish(pending_out, ins)
        issued = []
        if i + 1 < c:  # read after both waits above (else a wait placed after this start would drain it too)
            pending_in = start_in(lax.optimization_barrier((xs, ins, outs))[0], i + 1)
            issued += tokens(pending_in)
        if res is not None:
            res_b, outs_b = lax.optimization_barrier(((res, outs), ins))[0]
            pending_out = start_out(res_b, i - 1, outs_b)
            issued += tokens(pending_out)
        res = compute(i, after_token(ins, *issued) if issued else ins)  # not movable above those starts
    if pending_out:
        outs = finish(pending_out, res)
    return finish(start_out(res, c - 1, outs), res)


def _async_forward(q, k, v, axes, c: int, local: _Local, keep_vjps: bool):
    """The head chunks pipelined (_pipelined, or _pipelined_in_place). keep_vjps: also return each chunk's attention
    output and VJP (the backward's residuals)."""
    g = local.g
    vjps = []

    def compute(i, xs):
        if not keep_vjps:
            return [local(*xs)]
        out, vjp = jax.vjp(local, *xs)
        vjps.append((out, vjp))
        return [out]

    if local.windowed:
        return _pipelined_in_place([q, k, v], local.chunks, compute, axes, local.own_on_xla, local.prefill)[0], vjps
    chunks = [[chunk_heads(x, g, c, i) for x in (q, k, v)] for i in range(c)]
    return unchunk_heads([o for (o,) in _pipelined(chunks, compute, axes)], g), vjps


def _async_fwd(q, k, v, axes, c, local):
    return _async_forward(q, k, v, axes, c, local, True)  # (out, the residuals: each chunk's output and VJP)


def _async_bwd(axes, c, local, residuals, d_out):
    """The same pipeline backwards: each chunk's output cotangent exchanged to the heads layout (the transpose of
    its output exchange), its attention's VJP, the three gradients exchanged back (the transpose of the input
    exchange), chunk i+1's cotangent and chunk i-1's gradients moving under chunk i's VJP."""
    g = local.g
    chunk_outs, vjps = zip(*residuals)
    # XLA may defer the forward attention of chunks 1.. (only their residuals are needed) into the backward, where
    # their exchanges and the backward's share the side stream and each wait drains both (2x H100, 2026-11-26: most
    # copies of fwd+bwd exposed). Tried on 4x H200 (2026-11-26): a barrier over d_out and every VJP residual held
    # the order (all forward attention first) but made XLA 0.11.2 segfault compiling fwd+bwd with cuDNN's attention
    # between (the G 2 default); one over d_out and the whole output compiled but did not hold the order. The one
    # below, over each chunk's attention output, compiled with cuDNN and held the order on 4x H200 (session 19) but
    # was not faster (G 2 fwd+bwd S 2048 / 4096: 18.55 / 61.77 ms with it, 18.85 / 61.01 without) and took more
    # memory, so it stays opt-in.
    if backward_barrier() == "chunks":
        d_out = lax.optimization_barrier((d_out, list(chunk_outs)))[0]
    vjp = lambda i, xs: list(vjps[i](xs[0]))
    if local.windowed:
        return tuple(_pipelined_in_place([d_out], local.chunks, vjp, axes, local.own_on_xla, local.prefill))
    grads = _pipelined([[chunk_heads(d_out, g, c, i)] for i in range(c)], vjp, axes)
    return tuple(unchunk_heads([gr[j] for gr in grads], g) for j in range(3))


_ulysses_async.defvjp(_async_fwd, _async_bwd)
