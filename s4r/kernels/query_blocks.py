"""What a block of queries (a question's prompt) adds to the fused step (`s4r.kernels.s4r_step`): the rows
that score, each query's mask over the block's later tokens, and the selected tokens' logits and value
rows, and their latent values' share through the value basis, as matrix products once a step has more rows
than a decode step's few.

Reference: the eager step's `LowRankLayer.exact_step` (the mask, `causal_mask`) and `_window_logits` (the
scoring rows: the block's last queries, `S4RConfig.scoring_queries`), the same selection serving every row.
"""

from __future__ import annotations

import numpy as np
import torch

from s4r.kernels.jit import compose_angles, fine_shift, inline, kernel, rotated_row

PRODUCT_ROWS = 16  # query rows per KV head from which logits and value rows are matrix products
# exact tokens from which a block's exact logits and values are products too: a document's blocks through the
# selection (`dense_queries=0`) attend the document's own tokens, still exact in the buffer
EXACT_PRODUCT = 256


def window_rows(x: np.ndarray, heads: int, group: int, positions: int, window: int,
                out: np.ndarray) -> np.ndarray:
    """The rows of x [H * G * Q, ...] (or [H, G * Q, ...]) of the block's last `window` positions, in the
    same fold ([H * G * window, ...] into `out`); x itself where every position is in the window."""
    if window == positions:
        return x
    tail = x.reshape(heads, group, positions, -1)[:, :, positions - window :]
    np.copyto(out.reshape(heads, group, window, -1), tail)
    return out


def mask_later_tokens(el: np.ndarray, seg, heads: int, positions: int) -> None:
    """-inf on the exact logits el [H * M, e] of a block's queries for the buffered tokens after each
    query's own position (the block's own tokens come last), as the eager step's `causal_mask`."""
    e = seg.exact_length
    rows = el.reshape(heads, -1, positions, e)
    for i in range(positions - 1):
        rows[:, :, i, max(e - positions + i + 1, e - seg._n_buf) :] = -np.inf


def exact_products(rows: int, e: int) -> bool:
    """Whether a step's exact logits and values (`e` exact tokens, `rows` query rows per KV head) are
    products (`exact_logits_product`, `exact_values_product`) rather than the kernels' loops."""
    return rows > PRODUCT_ROWS and e >= EXACT_PRODUCT


def _tensor(x: np.ndarray) -> torch.Tensor:
    """x as a tensor sharing its memory: bf16 where x holds bf16 bits (uint16)."""
    t = torch.from_numpy(x)
    return t.view(torch.bfloat16) if x.dtype == np.uint16 else t


def exact_logits_product(q: np.ndarray, ek: np.ndarray, e: int, scaling: float, out: np.ndarray,
                         keys: torch.Tensor) -> None:
    """`exact_logits` as one fp32 product a head: out[h * M + m, :e] = scaling * q[h, m] . ek[h, t] for the
    exact keys ek [H, >=e, d] (fp32, or bf16 bits), widened into `keys`, an fp32 buffer [H, e, d]."""
    heads, rows, _ = q.shape
    keys.copy_(_tensor(ek)[:, :e])
    scaled, dst = torch.from_numpy(q) * scaling, torch.from_numpy(out)
    for h in range(heads):
        torch.matmul(scaled[h], keys[h].T, out=dst[h * rows : (h + 1) * rows, :e])


def exact_values_product(probs: np.ndarray, e: int, ev: np.ndarray, out: np.ndarray,
                         values: torch.Tensor) -> None:
    """out[h, m] += probs[h * M + m, :e] @ ev[h, :e]: the exact values' share `softmax_exact_values` leaves
    (exact values ev [H, >=e, d], fp32 or bf16 bits, widened into `values`, an fp32 buffer [H, e, d]), as
    one fp32 product a head."""
    heads, rows, _ = out.shape
    values.copy_(_tensor(ev)[:, :e])
    p, dst = torch.from_numpy(probs), torch.from_numpy(out)
    for h in range(heads):
        dst[h].addmm_(p[h * rows : (h + 1) * rows, :e], values[h])


def key_logits_product(q: np.ndarray, rotated: np.ndarray, k: int, scaling: float, out: np.ndarray) -> None:
    """out[h * M + m, :k] = scaling * q[h, m] . rotated key j of head h, for the rotated keys rotated
    [B, >=k, W] (`rotate_keys`; B = 1: head h's columns h*d.., B = H: per head), as one product a head."""
    heads, rows, d = q.shape
    keys = torch.from_numpy(rotated)
    dst = torch.from_numpy(out)
    scaled = torch.from_numpy(q) * scaling  # the few query rows scaled, not the M x k logits after
    for h in range(heads):
        block = keys[0, :k, h * d : (h + 1) * d] if keys.shape[0] == 1 else keys[h, :k]
        torch.matmul(scaled[h], block.T, out=dst[h * rows : (h + 1) * rows, :k])


def value_rows_product(probs: np.ndarray, k: int, decoded: np.ndarray, z: np.ndarray) -> None:
    """z[b, m] = probs[b * M + m, :k] @ decoded[b, :k] for each basis group b of the decoded value rows
    decoded [G, >=k, r_v] (`decode_rows`): `weighted_value_rows` as one product a group."""
    groups, rows, _ = z.shape
    p, rows_v, out = torch.from_numpy(probs), torch.from_numpy(decoded), torch.from_numpy(z)
    for g in range(groups):
        torch.matmul(p[g * rows : (g + 1) * rows, :k], rows_v[g, :k], out=out[g])


def add_value_basis_product(z: np.ndarray, basis: np.ndarray, out: np.ndarray) -> None:
    """out[h] += z's rows of head h (z [H * M, r_v], rows in head order) @ basis[h] [r_v, d]:
    `add_value_basis` as one batched product over the heads."""
    heads, rows = out.shape[0], out.shape[1]
    latent = torch.from_numpy(z).view(heads, rows, z.shape[1])
    torch.from_numpy(out).baddbmm_(latent, torch.from_numpy(basis))


@inline
def _rotate_keys(keys, idx, k, pos0, coarse, fine, col_scale, row_scale, out, half, width):
    shift = fine_shift(fine)
    scaled = col_scale.shape[1] > 0
    ang = np.empty(2 * half, np.float32)
    # each key widened and scaled into a local row, rotated into another, then copied out: loops over
    # local arrays vectorize (rotating from `keys` into `out` directly ran 4-5x slower)
    row = np.empty(width, np.float32)
    rot = np.empty(width, np.float32)
    ones = np.ones(width, np.float32)
    for j in range(k):
        compose_angles(idx[j] + pos0, coarse, fine, shift, half, ang)
        for b in range(out.shape[0]):
            factor = row_scale[b, j] if scaled else np.float32(1.0)
            rotated_row(keys[b, j], factor, col_scale[b] if scaled else ones, ang, half, width, row, rot)
            dst = out[b, j]
            for i in range(width):
                dst[i] = rot[i]


@kernel
def rotate_keys(keys, idx, k, pos0, coarse, fine, col_scale, row_scale, out):
    """out[b, j] = the rebuilt pre-RoPE key keys[b, j] [W] of token idx[j] (its d-column heads; int32 sums
    scaled by col_scale[b] and row_scale[b, j] as `rotated_key_logits` takes them, else empty scales)
    rotated to position idx[j] + pos0, in fp32: the keys `key_logits_product` multiplies."""
    half, width = coarse.shape[1] // 2, out.shape[2]
    # the common shapes get loops of a known trip count, which LLVM vectorizes whole
    if half == 32 and width == 192:
        _rotate_keys(keys, idx, k, pos0, coarse, fine, col_scale, row_scale, out, 32, 192)
    elif half == 32:
        _rotate_keys(keys, idx, k, pos0, coarse, fine, col_scale, row_scale, out, 32, width)
    elif half == 64:
        _rotate_keys(keys, idx, k, pos0, coarse, fine, col_scale, row_scale, out, 64, width)
    else:
        _rotate_keys(keys, idx, k, pos0, coarse, fine, col_scale, row_scale, out, half, width)
