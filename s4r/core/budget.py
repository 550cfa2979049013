"""Byte accounting and the rank solver that turns `ratio=R` into ranks for a model and a length."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from s4r.config import S4RConfig
from s4r.core.band_plan import plan_bands
from s4r.errors import BudgetError


@dataclass(frozen=True)
class KVShape:
    """The attention shape that decides KV-cache sizes."""

    layers: int
    kv_heads: int
    q_heads: int
    head_dim: int
    dtype_bytes: int  # bytes of one element in the model's compute dtype

    @classmethod
    def from_config(cls, config, dtype_bytes: int) -> KVShape:
        """Read the shape from a transformers config (text config for multimodal wrappers)."""
        cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
        q_heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // q_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or q_heads
        return cls(cfg.num_hidden_layers, kv_heads, q_heads, head_dim, dtype_bytes)

    def full_bytes_per_token(self) -> int:
        """Bytes one token takes in the uncompressed cache of one layer (K and V)."""
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    def full_bytes(self, tokens: int) -> int:
        """Bytes of the uncompressed cache of `tokens` tokens over all layers."""
        return self.layers * tokens * self.full_bytes_per_token()


def group_shape(shape: KVShape, granularity: str) -> tuple[int, int]:
    """(number of basis groups, width of one group) for a basis granularity."""
    if granularity == "head":
        return shape.kv_heads, shape.head_dim
    return 1, shape.kv_heads * shape.head_dim


def coef_bytes(coef_dtype: str, dtype_bytes: int) -> int:
    """Bytes of one stored coefficient."""
    return 1 if coef_dtype == "int8" else dtype_bytes


def token_coef_bytes(cfg: S4RConfig, rank: int, dtype_bytes: int, values: bool = False) -> int:
    """Bytes one token's key (or value) coefficients of one basis group take at `rank`: codes, int8
    scale, band steps."""
    spec = cfg.band_spec(values)
    if spec is None:
        scale = dtype_bytes if cfg.coef_dtype == "int8" else 0
        return rank * coef_bytes(cfg.coef_dtype, dtype_bytes) + scale
    plan = plan_bands(rank, spec)
    return plan.lead + dtype_bytes + plan.tail_bytes + plan.tail_count * dtype_bytes


def lowrank_layer_bytes(shape: KVShape, cfg: S4RConfig, rank_k: int, rank_v: int, stored: int,
                        buffer: int, shared: tuple[int, int] = (0, 0)) -> int:
    """Bytes of one S4R layer: sinks, bases, coefficients (+int8 scales), scoring state (query window or
    relevance), outliers, buffer. The first `shared` (key, value) basis columns are stored by another
    segment (an extended basis, `s4r.layers.segments`) and not counted here."""
    groups, width = group_shape(shape, cfg.granularity)
    b = shape.dtype_bytes
    sinks = cfg.sinks * shape.full_bytes_per_token()
    bases = groups * width * (rank_k - shared[0] + rank_v - shared[1]) * b
    per_token = token_coef_bytes(cfg, rank_k, b) + token_coef_bytes(cfg, rank_v, b, values=True)
    coefs = groups * stored * per_token
    qwin = shape.q_heads * cfg.query_window * plan_bands(rank_k, cfg.bands).lead * b
    if cfg.scoring == "query":
        qwin = 0  # scores come from the current queries alone
    elif cfg.scoring != "summed":
        # relevance scoring: the window queries seed a relevance per KV head and token, then go
        qwin = max(qwin, (1 if cfg.shared_selection else shape.kv_heads) * stored * b)
    outliers = cfg.outlier_count(stored) * (shape.full_bytes_per_token() + 4)  # + an int32 index
    return sinks + bases + coefs + qwin + outliers + buffer * shape.full_bytes_per_token()


@dataclass(frozen=True)
class RankPlan:
    """Ranks chosen for a target ratio, and the bytes they imply at the planning length."""

    rank_k: int
    rank_v: int
    tokens: int
    planned_bytes: int
    full_bytes: int

    @property
    def ratio(self) -> float:
        """Ratio at the planning length with a full buffer (the worst case)."""
        return self.full_bytes / self.planned_bytes


@lru_cache(maxsize=256)  # a document's layers ask the same (about 170 byte counts each)
def solve_ranks(shape: KVShape, cfg: S4RConfig, tokens: int, spare_bytes: float = 0.0,
                shared: tuple[int, int] = (0, 0)) -> RankPlan:
    """Largest ranks whose stored bytes, with a full buffer, stay within 1/ratio of the full cache.

    The buffer is counted full so a chat can always grow without breaking the ratio: once the buffer is
    full each new token costs only its coefficients, which the plan keeps below 1/ratio of a full token.
    `spare_bytes` (per layer) may be spent on top of 1/ratio of these tokens: what earlier parts of the
    layer left unspent under their own share (an appended document's segment, `s4r.layers.segments`). With
    `shared` (key, value) columns, the basis extends one another segment stores: the ranks are at least
    those and only the new columns' bytes count.
    """
    groups, width = group_shape(shape, cfg.granularity)
    stored = max(tokens - cfg.sinks, 0)
    full = shape.full_bytes_per_token() * tokens
    if cfg.rank_k is not None and cfg.rank_v is not None:
        rk, rv = min(cfg.rank_k, width), min(cfg.rank_v, width)
        used = lowrank_layer_bytes(shape, cfg, rk, rv, stored, cfg.buffer_tokens, shared)
        return RankPlan(rk, rv, tokens, used * shape.layers, full * shape.layers)
    assert cfg.ratio is not None
    budget = full / cfg.ratio + spare_bytes
    for total in range(2 * width, max(1, sum(shared) - 1), -1):
        rk = min(width, max(1, shared[0], round(total * cfg.rank_key_share)))
        rv = min(width, max(shared[1], total - rk))
        if rv < 1:
            continue
        used = lowrank_layer_bytes(shape, cfg, rk, rv, stored, cfg.buffer_tokens, shared)
        if used <= budget:
            return RankPlan(rk, rv, tokens, used * shape.layers, full * shape.layers)
    floor = lowrank_layer_bytes(shape, cfg, max(1, shared[0]), max(1, shared[1]), stored, cfg.buffer_tokens,
                                shared) - spare_bytes
    best = full / floor if floor > 0 else float("inf")
    raise BudgetError(
        f"ratio {cfg.ratio:g} is not reachable for {tokens} tokens on this model "
        f"(at most {best:.2f}x with these settings; use a lower --ratio or a longer document)"
    )


def allocate_ranks(shape: KVShape, cfg: S4RConfig, tokens: int,
                   energies: list[tuple[torch.Tensor, torch.Tensor]],
                   min_rank: int = 1) -> list[tuple[int, int]]:
    """Per-layer (rank_k, rank_v) that capture the most sample energy within the byte budget.

    `energies[i]` holds, for layer i, the share of its normalized sample's energy each key/value basis
    column captures (descending). Every column costs the same bytes per unit of rank within a kind, so
    taking columns in order of energy per byte across all layers and both kinds is the greedy optimum;
    layers and kinds whose spectra are flat get more rank than those whose energy is concentrated.
    """
    assert cfg.ratio is not None
    stored = max(tokens - cfg.sinks, 0)
    budget = shape.full_bytes(tokens) / cfg.ratio

    def layer_bytes(rk: int, rv: int) -> int:
        return lowrank_layer_bytes(shape, cfg, rk, rv, stored, cfg.buffer_tokens)

    ranks = [[min_rank, min_rank] for _ in energies]
    used = sum(layer_bytes(rk, rv) for rk, rv in ranks)
    if used > budget:
        raise BudgetError(
            f"ratio {cfg.ratio:g} is not reachable for {tokens} tokens on this model "
            f"(at most {shape.full_bytes(tokens) / used:.2f}x with these settings; use a lower --ratio "
            "or a longer document)")
    unit = (layer_bytes(2, 1) - layer_bytes(1, 1), layer_bytes(1, 2) - layer_bytes(1, 1))
    candidates = [(float(share) / unit[kind], layer, kind)
                  for layer, pair in enumerate(energies) for kind in (0, 1)
                  for share in pair[kind][min_rank:].tolist()]
    candidates.sort(key=lambda c: -c[0])
    for _, layer, kind in candidates:
        if used + unit[kind] <= budget:
            ranks[layer][kind] += 1
            used += unit[kind]
    return [(rk, rv) for rk, rv in ranks]


def eviction_budget_tokens(shape: KVShape, tokens: int, ratio: float) -> int:
    """How many full-precision tokens an evicting method may keep for the same bytes as 1/ratio."""
    return max(1, int(tokens / ratio))
