"""Rotary position embedding helpers: rotate keys to positions and undo it (for pre-RoPE key spaces)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")

# (positions [n]) -> (cos [n, head_dim], sin [n, head_dim]); built from the model's own rotary module so
# every RoPE variant (llama3, yarn, dynamic ...) is handled by transformers itself.
RopeFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The 90-degree rotation RoPE pairs dimension i with i + d/2 by (transformers' convention)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [..., n, d] to the positions whose `cos`/`sin` [n, d] are given."""
    return x * cos + rotate_half(x) * sin


def undo_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Inverse of `apply_rope`, also when cos/sin carry an attention scaling (cos^2 + sin^2 != 1):
    (x cos - rotate_half(x) sin) / (cos^2 + sin^2), each half updated in place (a layer's keys in a few
    passes, not eight fresh tensors; the same values)."""
    half = x.shape[-1] // 2
    out = x * cos
    out[..., :half] += x[..., half:] * sin[..., :half]
    out[..., half:] -= x[..., :half] * sin[..., half:]
    return out.div_(cos * cos + sin * sin)


def model_rope_fn(model) -> RopeFn | None:
    """A RopeFn from a transformers causal LM's rotary module, or None if it has none."""
    inner = getattr(model, "model", model)
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None:
        return None
    param = next(model.parameters())

    def rope(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dummy = torch.empty(0, device=param.device, dtype=param.dtype)
        cos, sin = rotary(dummy, positions.to(param.device).view(1, -1))
        return cos[0], sin[0]

    # RoPE types whose frequencies depend on the sequence seen so far change them inside forward
    if getattr(rotary, "rope_type", None) not in ("dynamic", "longrope") and hasattr(rotary, "inv_freq"):
        rope.rotary = rotary  # type: ignore[attr-defined]  (read by `half_angles`)
    return rope


def shifted(rope: RopeFn | None, offset: int) -> RopeFn | None:
    """`rope` for positions counted from `offset` (an appended document's segment: its token 0 sits at
    `offset`), so code that numbers a layer's tokens from 0 rotates them to where they are."""
    if rope is None or offset == 0:
        return rope
    base = getattr(rope, "base", rope)
    total = getattr(rope, "offset", 0) + offset

    def moved(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return base(positions + total)

    moved.base, moved.offset = base, total  # type: ignore[attr-defined]
    if hasattr(base, "rotary"):
        moved.rotary = base.rotary  # type: ignore[attr-defined]
    return moved


def rope_rows(rope: RopeFn, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope(torch.arange(start, end))`: (cos, sin) [end - start, d] in the model's dtype. Where the
    frequencies are static (`model_rope_fn` found them) these are rows of one table of positions 0.. kept
    on the model's rope function (a segment's rows sit at its offset; regrown by doubling): compressing a
    document asks for the same positions in every layer and block. Rows are computed position by
    position, so they are the values a call for these positions alone gives."""
    if getattr(rope, "rotary", None) is None:
        return rope(torch.arange(start, end))
    base, offset = getattr(rope, "base", rope), getattr(rope, "offset", 0)
    kept = getattr(base, "s4r_rope_rows", None)
    if kept is None or kept[0].shape[0] < offset + end:
        kept = base.s4r_rope_rows = base(torch.arange(max(4096, 1 << int(offset + end - 1).bit_length())))
    return kept[0][offset + start : offset + end], kept[1][offset + start : offset + end]


def half_angles(rope: RopeFn, positions: torch.Tensor,
                upto: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (cos, sin) [d/2, n] of `positions`, dimension-major: RoPE rotates the pair (i, i + d/2) by
    one angle, so half of `rope`'s [n, d] tables is all a rotation needs. Computed from the model's
    static frequencies where `model_rope_fn` found them (a quarter of the work of the full tables, no
    round trip through the model's dtype), else taken from `rope`. With `upto` (every position is below
    it) they are gathered from a table of all positions kept on the rotary module (`angle_table`): a
    decode step asks for thousands of positions in every layer."""
    rotary = getattr(rope, "rotary", None)
    if rotary is not None:
        offset = getattr(rope, "offset", 0)
        if upto is not None:
            flat = positions.reshape(-1) + offset if offset else positions.reshape(-1)
            # whole rows of a position-major copy (cos | sin of one position, contiguous), then one
            # transpose: gathering the dimension-major table's columns touched every row's cache lines
            # (about 3x slower in a decode step)
            rows = angle_rows(rotary, upto + offset).index_select(0, flat).T.contiguous()
            half = rows.shape[0] // 2
            return rows[:half], rows[half:]
        inv = rotary.inv_freq.float()
        angles = inv[:, None] * (positions + offset).to(inv.device, torch.float32)[None, :]
        scale = float(rotary.attention_scaling)
        return angles.cos().mul_(scale), angles.sin().mul_(scale)
    cos, sin = rope(positions)
    half = cos.shape[-1] // 2
    return cos[:, :half].float().T.contiguous(), sin[:, :half].float().T.contiguous()


def angle_table(rotary, upto: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (cos, sin) [d/2, P] of positions 0..P-1 (P > `upto`), as `half_angles` computes them, kept on
    `rotary` and regrown by doubling. The same values as computing them per call: integer positions are
    exact in fp32 below 2^24."""
    inv, scale = rotary.inv_freq, float(rotary.attention_scaling)
    memo = getattr(rotary, "s4r_angle_table", None)
    if memo is None or memo[0] is not inv or memo[1] != scale or memo[2].shape[1] <= upto:
        size = max(4096, 1 << int(upto).bit_length())
        angles = inv.float()[:, None] * torch.arange(size, device=inv.device, dtype=torch.float32)[None, :]
        memo = (inv, scale, angles.cos().mul_(scale), angles.sin().mul_(scale))
        rotary.s4r_angle_table = memo
    return memo[2], memo[3]


ANGLE_STEP = 64  # rows of `angle_parts`' fine table: a power of two, so a position splits by shift and mask


def angle_parts(rotary, upto: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 rows (cos | sin, as `angle_rows`) of the positions 0, 64, 128, .. up past `upto` (times the
    attention scaling) and, unscaled, of 0..63: position p's angles are the sum of rows p >> 6 and
    p & 63 (cos a cos b - sin a sin b, sin a cos b + cos a sin b). A decode step gathers thousands of
    positions a layer; these two tables stay in cache where one row per position does not. The sum
    differs from `angle_rows`' row p by that row's phase rounding (fp32, at most 5e-4 rad below 8,192)."""
    inv, scale = rotary.inv_freq, float(rotary.attention_scaling)
    memo = getattr(rotary, "s4r_angle_parts", None)
    if memo is None or memo[0] is not inv or memo[1] != scale or memo[2].shape[0] * ANGLE_STEP <= upto:

        def rows(positions: torch.Tensor, times: float) -> torch.Tensor:
            angles = positions.to(inv.device, torch.float32)[:, None] * inv.float()[None, :]
            return torch.cat([angles.cos(), angles.sin()], 1).mul_(times).contiguous()

        coarse = torch.arange(0, 2 * max(upto + 1, 4096), ANGLE_STEP)
        memo = (inv, scale, rows(coarse, scale), rows(torch.arange(ANGLE_STEP), 1.0))
        rotary.s4r_angle_parts = memo
    return memo[2], memo[3]


def angle_rows(rotary, upto: int) -> torch.Tensor:
    """`angle_table` position-major: fp32 [P, d] rows (cos of the d/2 frequencies, then sin), the same
    values, kept on `rotary` beside the table it copies."""
    cos, sin = angle_table(rotary, upto)
    memo = getattr(rotary, "s4r_angle_rows", None)
    if memo is None or memo[0] is not cos:
        memo = (cos, torch.cat([cos, sin]).T.contiguous())
        rotary.s4r_angle_rows = memo
    return memo[1]


def mean_rotation(rope: RopeFn, first: torch.Tensor,
                  last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(cos, sin) [C, d] of the mean of RoPE's rotation over the integer distances first[c]..last[c] (C
    ranges), as `apply_rope` takes them: rotating a query by one gives, dotted with an un-rotated key,
    that key's expected logit over the range. None without the model's static frequencies (see
    `half_angles`)."""
    rotary = getattr(rope, "rotary", None)
    if rotary is None:
        return None
    device = rotary.inv_freq.device
    theta = rotary.inv_freq.double()[None, :]  # [1, d/2]
    start = first.to(device, torch.float64)[:, None]
    count = (last.to(device, torch.float64) - start[:, 0] + 1).clamp_min(1)[:, None]
    def unit(angle: torch.Tensor) -> torch.Tensor:  # e^{i angle}
        return torch.polar(torch.ones_like(angle), angle)

    # sum of e^{i theta k}, k = first..last, as a geometric series (the theta -> 0 limit is count)
    total = unit(theta * start) * (1 - unit(theta * count)) / (1 - unit(theta))
    total = torch.where(theta * count < 1e-9, count.to(total.dtype).expand_as(total), total)
    mean = total / count
    return torch.cat([mean.real, mean.real], -1).float(), torch.cat([mean.imag, mean.imag], -1).float()


def chunk_rotations(rope: RopeFn, stored: int, chunk: int,
                    last: int) -> tuple[list[int], torch.Tensor, torch.Tensor] | None:
    """Chunked expected-logit scoring of `stored` un-rotated keys, the last of them `last` positions
    before the query (token j at distance last - j): (chunk bounds, cos [C, d], sin [C, d]), each chunk's
    `mean_rotation`. The same for every layer of a step, so the last answer is kept on `rope`."""
    def compute() -> tuple[list[int], torch.Tensor, torch.Tensor] | None:
        rotary = getattr(rope, "rotary", None)
        if rotary is None:
            return None
        # on the rotary's device: a tensor copied from the host would wait for a GPU's queue every step
        starts = torch.arange(0, stored, chunk, device=rotary.inv_freq.device)
        ends = (starts + chunk).clamp_max(stored)
        mean = mean_rotation(rope, last - (ends - 1), last - starts)
        return None if mean is None else ([*range(0, stored, chunk), stored], *mean)

    return last_answer(rope, "chunk_memo", (stored, chunk, last), compute)


def last_answer(rope: object, name: str, key: tuple, compute: Callable[[], T]) -> T:
    """`compute()`, or the answer kept as `name` when it was for the same `key`: what every layer of a
    decode step asks again (the step's rotations), kept once on the model's rope function, one answer per
    segment offset: a segment's `shifted` rope (one per layer) keeps its answer there too, so the layers
    of a step share it."""
    holder, offset = getattr(rope, "base", rope), getattr(rope, "offset", 0)
    memos = getattr(holder, name, None)
    if memos is None or len(memos) > 16:  # one entry per segment offset
        memos = {}
        setattr(holder, name, memos)
    memo = memos.get(offset)
    if memo is not None and memo[0] == key:
        return memo[1]
    result = compute()
    memos[offset] = (key, result)
    return result


def rotate_dim_major(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rope` for dimension-major vectors x [..., d, n] with `half_angles` tables [d/2, n]."""
    half = x.shape[-2] // 2
    x1, x2 = x[..., :half, :], x[..., half:, :]
    out = torch.empty_like(x)
    torch.mul(x1, cos, out=out[..., :half, :]).addcmul_(x2, sin, value=-1.0)
    torch.mul(x2, cos, out=out[..., half:, :]).addcmul_(x1, sin)
    return out
