"""The ``"flex"`` mode of the tree attention: compiled FlexAttention on every device, with a bounded number of
compilations.

``torch.compile`` specialises a kernel to its shapes, so each new packed length N would compile again (5-7 s on CPU,
10-15 s reported on GPUs), and past dynamo's recompile limit (8) it would silently run the uncompiled flex, which
materialises N × N scores. (``dynamic=True`` does not compile on CPU inductor in torch 2.13; ``mark_dynamic`` on CUDA
is untested: neither is used.) Here every call is padded to a length on a ladder instead (``ladder_length``: 1, 2,
3, 4, 6, 8, 12, 16, 24, ... blocks, two rungs per octave), so a run compiles once per rung its lengths touch. Padded
rows are roots that see only themselves and no real row sees a padded key, so a padded query block costs one tile.
Measured on GRPO-shaped micro-batches (8 answers per prompt, budgets of 8k, 16k and 32k tokens, B = 128): 60
micro-batches of 48 distinct lengths compile 6 times at +1.2% tiles (one rung per octave: 3 times at +2.2%; four: 11
times at +0.6%).

The bound: one variant per (query rung, key rung, layer kind: window and sinks, dtype, head layout, scale, whether a
gradient is recorded). For one model, plain micro-batches compile at most once per rung, layer kind and grad mode;
a step plan (``rows`` > 0: the query rows past a cached prefix, Q_LEN their own rung) at most once per (query rung,
key rung) pair. Dynamo is given ``COMPILE_LIMIT`` as the function's recompile limit, and with ``fullgraph=True``
reaching it raises, here a TreepackError (E_LIMIT): never the fall-back to uncompiled flex. (Dynamo also guards
every variant on the number of pytree node types registered, which a model module's first import raises: a model
class imported after the first compilations makes them compile again.)

Sinks run as one more key that every query sees: a block of B keys after the padded ones, whose first key is the
sink (value 0); a ``score_mod`` gives that key's score as the head's sink logit (a captured tensor: on CUDA its
gradient flows), so the softmax denominator gains ``exp(sink)``. That costs a tile per query block; flex's returned
log-sum-exp would not, but CPU inductor refuses ``return_lse``, and the kernel the CPU tests run must be the GPU's.

On CPU, torch compiles flex's forward only (float32, bfloat16, float16): a call that records a gradient, or float64,
is refused. Inside a caller's own ``torch.compile`` the flex call is left to that compile.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from ..microbatch import TreepackError
from .blocks import block_arrays

# The recompile limit of the compiled flex function (dynamo's default is 8 per function): rungs × layer kinds × grad
# modes of a run, with room for step plans' (query rung, key rung) pairs.
COMPILE_LIMIT = 64
CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def ladder_length(n: int, block_size: int) -> int:
    """The padded length flex runs a call of ``n`` query or key rows at: the least multiple ``m · block_size`` with
    m on the ladder 1, 2, 3, 4, 6, 8, 12, ... (2^e and 3 · 2^e), at least ``n``. At most 1.5× the blocks of ``n``
    (above 2 blocks), so the padding adds at most one tile per 2 real query blocks.

        >>> [ladder_length(n, 128) // 128 for n in (1, 128, 129, 300, 513, 700, 1025, 1600, 8000)]
        [1, 1, 2, 3, 6, 6, 12, 16, 64]
    """
    nb = -(-n // block_size)
    if nb <= 2:
        return nb * block_size
    p = 1 << (nb - 1).bit_length()  # the least power of two >= nb
    return (3 * p // 4 if 3 * p // 4 >= nb else p) * block_size


def _flex_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: BlockMask,
    score_mod: Callable[..., Any] | None,
    scale: float | None,
    gqa: bool,
) -> torch.Tensor:
    # A function of our own, so dynamo's cache entries (and its recompile limit) count this path's variants alone.
    return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=gqa)


_compiled: Any = None


def _compiled_flex() -> Any:
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(_flex_call, dynamic=False, fullgraph=True)
    return _compiled


def flex_compilations() -> int:
    """The compilations of the ``"flex"`` attention so far in this process: the variants dynamo holds of its
    compiled function, one per (padded lengths, layer kind, dtype, head layout, grad mode), ``COMPILE_LIMIT`` at
    most."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(_flex_call.__code__))


def _padded_mask(mask: Any, rows: int, sinks: bool) -> tuple[BlockMask, int, int]:
    """The BlockMask flex runs for query rows [rows, N) of ``mask`` (a TreeMask) and the padded (Q_LEN, KV_LEN):
    the forest padded to its rung with root nodes, the query range starting at ``rows`` (also padded to its rung;
    query rows past the padded forest see nothing), plus the sink block. Cached on the mask."""
    key = ("flex", rows, sinks)
    got: tuple[BlockMask, int, int] | None = mask._cache.get(key)
    if got is not None:
        return got
    se, pos, window = mask.subtree_end, mask.position_ids, mask.window
    B = mask.BLOCK_SIZE[0]
    n, dev = int(se.shape[0]), se.device
    L, Lq = ladder_length(n, B), ladder_length(n - rows, B)
    # Padded nodes are roots of one node (subtree_end = i + 1): they see themselves, and nobody sees them.
    se_pad = torch.cat([se, torch.arange(n + 1, L + 1, dtype=se.dtype, device=dev)])
    pos_pad = None if window is None else torch.cat([pos, pos.new_zeros(L - n)])
    kv_num, kv_idx, full_num, full_idx = block_arrays(se_pad, B, pos_pad, window, q_start=rows)
    nbq, nbk = Lq // B, L // B + sinks

    def rows_and_width(a: torch.Tensor) -> torch.Tensor:
        # The builder lists the query blocks of [rows, L); the rung has nbq of them (fewer or more: the extra ones see
        # nothing), and the sink block widens every row by one kv block.
        a = a[:nbq]
        return F.pad(a, (0, nbk - a.shape[1], 0, nbq - a.shape[0])) if a.dim() == 2 else F.pad(a, (0, nbq - a.shape[0]))

    kv_num, kv_idx, full_num, full_idx = (rows_and_width(a.to(torch.int32)) for a in (kv_num, kv_idx, full_num, full_idx))
    if sinks:
        # The sink block is partial for every query block, listed after its other partial blocks.
        kv_idx = kv_idx.scatter(1, kv_num[:, None].long(), torch.full((nbq, 1), L // B, dtype=torch.int32, device=dev))
        kv_num = kv_num + 1
    off = torch.full((), rows, dtype=torch.int64, device=dev)  # a fill on the device: no host copy, no sync
    got = mask._cache[key] = (
        BlockMask.from_kv_blocks(
            kv_num[None, None],
            kv_idx[None, None],
            full_num[None, None],
            full_idx[None, None],
            BLOCK_SIZE=B,
            mask_mod=_mask_mod(se_pad, pos_pad, window, off, L if sinks else None),
            seq_lengths=(Lq, nbk * B),
        ),
        Lq,
        nbk * B,
    )
    return got


def flex_tiles(mask: Any, rows: int = 0, sinks: bool = False) -> int:
    """The B×B tiles compiled flex computes for query rows [rows, N) of ``mask``: those its padded BlockMask lists
    (with ``sinks``, one more per query block)."""
    block_mask = _padded_mask(mask, rows, sinks)[0]
    full = block_mask.full_kv_num_blocks
    return int(block_mask.kv_num_blocks.sum() + (0 if full is None else full.sum()))


def _mask_mod(se: torch.Tensor, pos: torch.Tensor | None, window: int | None, off: torch.Tensor, sink: int | None) -> Callable[..., Any]:
    """The tree rule on the padded forest for query rows offset by ``off`` (a tensor, so a new offset is no new
    compilation), windowed when ``window`` is given, plus key ``sink`` seen by every query. Every captured value is
    a tensor whose shape the rung fixes, or an integer the rung or the layer fixes."""
    last = int(se.shape[0]) - 1
    if window is not None and pos is None:
        raise TreepackError("E_ARG", f"a windowed mask (window {window}) needs position_ids", field="position_ids")

    def tree(b: Any, h: Any, q: Any, kv: Any) -> Any:
        qa, kc = q + off, kv.clamp(max=last)
        seen = (kv <= qa) & (qa < se[kc])
        if window is not None and pos is not None:
            seen = seen & (pos[qa.clamp(max=last)] - pos[kc] < window)
        return seen if sink is None else seen | (kv == sink)

    return tree


def _sink_score(sinks: torch.Tensor, sink: int) -> Callable[..., Any]:
    def score_mod(score: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
        return torch.where(kv == sink, sinks[h], score)

    return score_mod


def flex_attend(
    mask: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, gqa: bool, sinks: torch.Tensor | None, rows: int
) -> torch.Tensor:
    """Compiled flex for query rows [rows, N) of ``mask`` (a TreeMask, windowed as it says): [1, H, N - rows, Dv]."""
    n = int(mask.subtree_end.shape[0])
    records = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, sinks))
    if q.device.type == "cpu":
        if records:
            raise TreepackError(
                "E_ARG", "FlexAttention has no backward on CPU; use tree_mask(batch, mode='block') to train on CPU", field="mode"
            )
        if q.dtype not in CPU_DTYPES:
            raise TreepackError(
                "E_ARG",
                f"compiled FlexAttention on CPU runs float32, bfloat16 or float16, not {q.dtype}; use tree_mask(batch, mode='block')",
                field="mode",
            )
        # torch refuses requires_grad inputs on CPU even under no_grad, where nothing is recorded anyway.
        q, k, v = q.detach(), k.detach(), v.detach()
        sinks = None if sinks is None else sinks.detach()
    if rows >= n:
        return q.new_zeros(1, q.shape[1], 0, v.shape[-1])
    block_mask, Lq, Lk = _padded_mask(mask, rows, sinks is not None)
    qp = F.pad(q[:, :, rows:], (0, 0, 0, Lq - (n - rows)))
    kp, vp = (F.pad(x, (0, 0, 0, Lk - n)) for x in (k, v))
    score_mod = None if sinks is None else _sink_score(sinks.float(), Lk - mask.BLOCK_SIZE[1])
    if torch.compiler.is_compiling():
        out = flex_attention(qp, kp, vp, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    else:
        from torch._dynamo.exc import FailOnRecompileLimitHit

        try:
            # Grad mode is part of a variant's key: a call that records no gradient runs as no_grad whatever the mode.
            with torch._dynamo.config.patch(recompile_limit=COMPILE_LIMIT), torch.set_grad_enabled(records):
                out = _compiled_flex()(qp, kp, vp, block_mask, score_mod, scale, gqa)
        except FailOnRecompileLimitHit:
            limits = f"{COMPILE_LIMIT} for this function, {torch._dynamo.config.accumulated_recompile_limit} for all"
            raise TreepackError(
                "E_LIMIT",
                f"compiled FlexAttention cannot compile padded lengths {Lq} × {Lk}: dynamo's recompile "
                f"limit is reached ({limits}), by more lengths, layer kinds or dtypes than a run should have; the "
                "uncompiled fall-back is refused (it materialises N × N scores)",
                field="mode",
            ) from None
    return out[:, :, : n - rows]
