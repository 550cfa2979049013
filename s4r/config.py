"""Every knob of the S4R method in one dataclass."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Literal

from s4r.validation import check_ratio

# past this ratio the presets change (docs/design.md, "Past 5x"): a step's rebuild budget stays at this
# ratio's (smaller ranks make a rebuilt token cheaper, and the lossier store needs more of them to keep what
# a query attends); the value coefficients, which score nothing, trade precision for rank and take more of
# it; the lower bands' columns are coded in units of their own RMS
HIGH_RATIO = 5.0
HIGH_RATIO_VALUE_BANDS = "8:1,2:22"
KEY_SHARE = 0.4
HIGH_RATIO_KEY_SHARE = 0.35
# the most stored tokens a pre-RoPE step rebuilds where `recon_token_cap` is unset, at every ratio
REBUILD_TOKENS = 1536

KeySpace = Literal["post_rope", "pre_rope"]
Granularity = Literal["head", "layer"]
CoefDtype = Literal["model", "int8"]


@dataclass(frozen=True)
class S4RConfig:
    """Settings of S4R compression (prefill) and sparse reconstruction (decode).

    Ranks are per basis group: with ``granularity="head"`` every KV head has its own ``head_dim``-wide
    basis; with ``"layer"`` the KV heads of a layer are concatenated into one ``kv_heads * head_dim``-wide
    basis. Leave ``rank_k``/``rank_v`` unset to let the budget solver derive them from ``ratio``.
    """

    # what a compressed cache may store, as a fraction 1/ratio of the uncompressed cache's bytes
    ratio: float | None = 5.0
    rank_k: int | None = None
    rank_v: int | None = None
    # share of the rank budget given to keys when the solver splits it: pre-RoPE keys are far more
    # low-rank than values, so values get the larger share (docs/design.md, "Rank split"). None: 0.4, past
    # HIGH_RATIO 0.35 (docs/design.md, "Past 5x")
    key_share: float | None = None
    # "uniform": the same ranks in every layer (split by key_share); "energy": ranks spread over layers
    # and between K and V by how much of each sample's energy a basis column captures
    rank_alloc: Literal["uniform", "energy"] = "uniform"

    sinks: int = 4
    # hybrid sample: `sample_tokens` in all, of which `recent_share` is the most recent contiguous block
    # and the rest uniform picks over the earlier part; None samples every token (the costly online SVD)
    sample_tokens: int | None = 2048
    recent_share: float = 0.25
    normalize: bool = True

    # share of the stored tokens the bases represent worst (largest relative residual) that are also
    # kept exact, like ShadowKV's outlier chunks: rare tokens (a needle) are what a sampled basis misses.
    # Pre-RoPE bases miss few tokens, so 1% is enough and leaves the bytes to rank (docs/design.md)
    outlier_fraction: float = 0.01
    # how outliers are chosen: "residual" (worst relative reconstruction error) or "attention" (largest
    # first-order change of the prompt's last queries' attention output, see compress.attention_effect)
    outlier_score: Literal["residual", "attention"] = "residual"

    # "pre_rope" (ShadowKV's and xKV's choice) fits the key bases before the rotary embedding, where keys
    # are far more low-rank; decoding then rebuilds the selected keys and rotates them (the paper's
    # sparse reconstruction). "post_rope" keys attend in latent space without rebuilding anything: a
    # faster step, less faithful (the `s4r-fast` method; docs/design.md, "Key space")
    key_space: KeySpace = "pre_rope"
    # pre-RoPE keys are scored without rotating each stored token to its position: "aligned" dots the
    # query with them as if every token sat at the query's own position (the dimensions that rotate fast
    # then add a large term no real distance gives); "expected" rotates the query by the mean rotation
    # over the stored tokens' distances, the expected logit, in which those dimensions average out
    rope_scoring: Literal["aligned", "expected"] = "expected"
    # with "expected": the mean is taken over chunks of this many stored tokens, each scored by its own
    # chunk's rotation (dimensions slow over a chunk keep their phase); 0: one chunk, every stored token.
    # Smaller chunks score better and cost more products per step (docs/design.md, "Scoring pre-RoPE keys")
    rope_chunk: int = 1024
    granularity: Granularity = "layer"
    # int8 coefficients (with a per-token scale) buy about twice the rank of model-dtype ones
    coef_dtype: CoefDtype = "int8"
    # bit widths of int8 coefficients along the rank as "bits:share,...": "8:2,4:3,2:3" keeps the leading
    # quarter of the columns in int8 (they score tokens), the next 3/8 in 4 bits, the rest in 2 bits (see
    # coef_bands.py); None keeps every column in int8. Ignored with coef_dtype "model". Fewer bits on the
    # trailing columns buy rank (docs/design.md, "Coefficient bands")
    coef_bands: str | None = "8:2,4:3,2:3"
    # bands of the value coefficients where they should differ from the keys' (None: `coef_bands`, or past
    # HIGH_RATIO a 1/23 int8 lead and 2 bits for the rest). Value coefficients score nothing, so they can
    # trade the wide int8 lead for rank
    value_bands: str | None = None
    # the lower bands' columns coded in units of their own RMS over the sample (the scale folded into the
    # basis column, so nothing more is stored): one step per token and band then fits every column.
    # None: on past HIGH_RATIO, where most columns sit in the 2-bit band (docs/design.md, "Past 5x")
    tail_norm: bool | None = None

    # decode
    local_window: int = 32
    # fraction of the stored tokens reconstructed per step; None means "the storage fraction" 1/ratio (the
    # paper's choice), at most `recon_cap`: at ratio 2.5, rebuilding 20% instead of 40% of the pre-RoPE
    # keys answers as well for half the work (docs/design.md, "How many tokens a step rebuilds")
    recon_fraction: float | None = None
    recon_cap: float = 0.2
    # adaptive budget: a step rebuilds more than the fraction above, up to `recon_max` of the stored
    # tokens, while a query row's estimated attention on the tokens left out exceeds `recon_drop` (flat
    # attention, as in counting tasks, needs many tokens; a needle needs few). None: always the fixed
    # fraction. The ceiling follows the storage's fidelity: lossy rebuilds of unimportant tokens dilute
    # sharp needles (docs/design.md, "How many tokens a step rebuilds")
    recon_drop: float | None = 0.02
    # None: twice the storage fraction, 2/ratio, at most every token (0.4 at ratio 5, 0.8 at 2.5; past
    # HIGH_RATIO it stays at that ratio's, see below)
    recon_max: float | None = None
    # at most this many stored tokens rebuilt per step, whatever the fractions above give; None:
    # REBUILD_TOKENS at every ratio, 0: no limit. A pre-RoPE step's work grows with the tokens it rebuilds,
    # so a share of a long context would cost more than attending all of it exactly; ShadowKV keeps a fixed
    # token budget too (docs/design.md, "How many tokens a step rebuilds")
    recon_token_cap: int | None = None
    # the dtype a pre-RoPE step rebuilds the selected keys in: "model" (a bf16 model's bf16, or the model's
    # dtype on a GPU: one product over the decoded coefficients, keys rounded as the model's own are;
    # faster, and answers as well), "float32" (fp32 products through byte planes), "int8" (on a CPU with
    # int8 coefficients: one int8 product, the lead band's codes as stored, the lower bands rounded to its
    # step, the basis in int8 per key dimension) or "auto" ("int8" where the CPU has int8 dot products,
    # else "model"; "model" for a bf16 model's large bases on AMX-BF16); docs/design.md
    rebuild_dtype: Literal["auto", "model", "float32", "int8"] = "auto"
    top_k: int | None = None
    pool_kernel: int = 7
    pool: Literal["avg", "max"] = "max"
    query_window: int = 32
    # a block of queries shorter than `dense_queries` (a question's prompt) shares one selection, scored by
    # its last `prompt_window` queries (`scoring_queries`): 8 answered as every query did and runs the
    # prompt faster (docs/design.md, "Blocks of queries")
    prompt_window: int = 8
    # a step of at least this many queries (an appended document's 256-token blocks; its last, shorter block
    # too) attends every stored token, each rebuilt once for all its rows (`s4r.layers.lowrank_dense`); a
    # shorter one (a question's prompt) shares one selection (`prompt_window`).
    # 0: always a selection; 2: prompts attend every token too, slower, with answers no measurably better
    # (docs/design.md, "Blocks of queries")
    dense_queries: int = 129
    # how stored tokens are scored for selection, from each query's (and query head's) own attention
    # probabilities: "query" those of the current queries only; "max" / "mean" aggregate them over
    # recent queries too (weight halving every `query_window` queries; a relevance per KV head and
    # token is stored); "summed" is the paper's proxy (window queries averaged, heads of a group summed)
    scoring: Literal["query", "max", "mean", "summed"] = "query"
    # one set of selected tokens for all KV heads of a layer (scored over all its query heads) rather
    # than one per KV head: with a layer basis their coefficient rows are gathered once, not per head
    shared_selection: bool = True

    # new tokens stay in full precision until the buffer holds this many; older ones are folded into
    # coefficients with the existing bases (in batches of `fold_tokens`)
    buffer_tokens: int = 64
    fold_tokens: int = 32
    # an appended text of at least this many tokens (a second document) gets bases of its own instead of
    # being folded into the first document's (`s4r.layers.segments`); 0 folds every append
    segment_tokens: int = 1024
    # what bytes a new segment's ranks may use: "layer" also spends what the earlier segments left under
    # the ratio (the first document's room for new tokens, which the new last segment takes over, and
    # rounding), so the layer keeps the ratio as a whole; "segment" keeps 1/ratio of its own tokens, so
    # two documents store less than the ratio allows (docs/design.md, "Appended documents")
    segment_budget: Literal["layer", "segment"] = "layer"
    # a new segment's bases: "extend": the previous segment's columns (stored once, shared) followed by
    # new ones fitted on what they leave of the new text; "own": fitted on its tokens alone. An appended
    # document's keys and values lie mostly in the first's subspace (the model's), so the bytes a basis of
    # its own would cost buy rank (docs/design.md, "Appended documents")
    segment_bases: Literal["own", "extend"] = "extend"
    # decode kernels: "auto" runs the fused CPU step (`s4r.kernels`, numba) and a GPU's Triton kernels where
    # they apply and the eager PyTorch step elsewhere; "eager" always runs the eager step (the reference
    # the fused ones are tested against); "fused" is "auto" under its explicit name
    kernels: Literal["auto", "eager", "fused"] = "auto"

    def __post_init__(self) -> None:
        if self.ratio is not None:
            check_ratio(self.ratio, ValueError, name="ratio", upper=None)
        if self.ratio is None and (self.rank_k is None or self.rank_v is None):
            raise ValueError("give either a ratio or both rank_k and rank_v")
        if self.key_share is not None and not 0.0 < self.key_share < 1.0:
            raise ValueError("key_share must be in (0, 1)")
        if self.dense_queries < 0:
            raise ValueError("dense_queries must be >= 0 (0: every step selects)")
        if self.sinks < 0 or self.local_window < 0 or self.query_window < 1 or self.prompt_window < 1:
            raise ValueError("sinks and local_window must be >= 0, query_window and prompt_window >= 1")
        if self.sample_tokens is not None and self.sample_tokens < 1:
            raise ValueError("sample_tokens must be positive (or None for all tokens)")
        if not 0.0 <= self.outlier_fraction < 1.0:
            raise ValueError("outlier_fraction must be in [0, 1)")
        if self.outlier_score not in ("residual", "attention"):
            raise ValueError("outlier_score must be 'residual' or 'attention'")
        if not 0.0 <= self.recent_share <= 1.0:
            raise ValueError("recent_share must be in [0, 1]")
        if self.recon_fraction is not None and not 0.0 < self.recon_fraction <= 1.0:
            raise ValueError("recon_fraction must be in (0, 1]")
        if not 0.0 < self.recon_cap <= 1.0:
            raise ValueError("recon_cap must be in (0, 1]")
        if self.recon_drop is not None and not 0.0 < self.recon_drop < 1.0:
            raise ValueError("recon_drop must be in (0, 1) (or None for a fixed fraction)")
        if self.recon_max is not None and not 0.0 < self.recon_max <= 1.0:
            raise ValueError("recon_max must be in (0, 1] (or None for the ratio's default)")
        if self.recon_token_cap is not None and self.recon_token_cap < 0:
            raise ValueError("recon_token_cap must be >= 0 (0: no limit, None: the ratio's default)")
        if self.rebuild_dtype not in ("auto", "model", "float32", "int8"):
            raise ValueError(f"rebuild_dtype: auto, model, float32 or int8, not {self.rebuild_dtype!r}")
        if self.rope_chunk < 0:
            raise ValueError("rope_chunk must be >= 0 (0: one chunk)")
        if self.rope_scoring not in ("aligned", "expected"):
            raise ValueError(f"rope_scoring must be aligned or expected, got {self.rope_scoring!r}")
        if self.scoring not in ("query", "max", "mean", "summed"):
            raise ValueError(f"scoring must be query, max, mean or summed, got {self.scoring!r}")
        if self.pool_kernel < 1 or self.pool_kernel % 2 == 0:
            raise ValueError("pool_kernel must be a positive odd number")
        for spec in (self.coef_bands, self.value_bands):
            if spec is not None:
                from s4r.core.band_plan import parse_band_spec

                parse_band_spec(spec)  # raises ValueError with the reason
        if self.buffer_tokens < 1 or not 1 <= self.fold_tokens <= self.buffer_tokens:
            raise ValueError("need 1 <= fold_tokens <= buffer_tokens")
        if self.segment_bases not in ("own", "extend"):
            raise ValueError(f"segment_bases must be own or extend, got {self.segment_bases!r}")
        if self.segment_budget not in ("layer", "segment"):
            raise ValueError(f"segment_budget must be layer or segment, got {self.segment_budget!r}")
        if self.kernels not in ("auto", "eager", "fused"):
            raise ValueError(f"kernels must be auto, eager or fused, got {self.kernels!r}")
        if self.segment_tokens < 0:
            raise ValueError("segment_tokens must be >= 0 (0: appended text folds into the first bases)")

    @classmethod
    def fast(cls, ratio: float = 5.0) -> S4RConfig:
        """Post-RoPE keys attended in latent space (no key is rebuilt), with the outliers that space
        needs: a faster decode step than the default's and less faithful (docs/design.md, "Key space")."""
        return cls(ratio=ratio, key_space="post_rope", outlier_fraction=0.03, recon_cap=1.0, key_share=0.5,
                   recon_drop=None, recon_token_cap=0)

    @classmethod
    def paper(cls, ratio: float = 5.0) -> S4RConfig:
        """The paper's literal settings: fixed K/V ranks split evenly, coefficients in the model's dtype,
        no outliers, W=32, kernel 7, p = 1/ratio, one set of bases per layer (appended text folds into
        them). What it leaves open (key space, granularity, sample size) takes the ShadowKV/xKV choice
        or ours."""
        return cls(ratio=ratio, key_share=0.5, rank_alloc="uniform", sample_tokens=1024, recent_share=0.5,
                   normalize=True, key_space="post_rope", granularity="layer", coef_dtype="model",
                   coef_bands=None, outlier_fraction=0.0, query_window=32, pool_kernel=7, recon_fraction=None,
                   recon_cap=1.0, recon_drop=None, recon_token_cap=0, scoring="summed", segment_tokens=0)

    def with_overrides(self, overrides: dict[str, Any] | None) -> S4RConfig:
        """A copy with `overrides` applied; unknown keys raise ValueError."""
        if not overrides:
            return self
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown S4R setting(s): {', '.join(unknown)}")
        return replace(self, **overrides)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (for saved caches and reports)."""
        return asdict(self)

    @property
    def bands(self) -> str | None:
        """The key coefficients' band spec in force (None with model-dtype coefficients)."""
        return self.coef_bands if self.coef_dtype == "int8" else None

    def band_spec(self, values: bool = False) -> str | None:
        """The band spec in force for the key or the value coefficients (None: model dtype, or int8
        without bands)."""
        if values and self.coef_dtype == "int8":
            if self.value_bands is not None:
                return self.value_bands
            if self.high_ratio:
                return HIGH_RATIO_VALUE_BANDS
        return self.bands

    @property
    def high_ratio(self) -> bool:
        """Whether the requested ratio is past HIGH_RATIO, where the presets below change."""
        return bool(self.ratio and self.ratio > HIGH_RATIO)

    @property
    def rank_key_share(self) -> float:
        """The keys' share of the rank the solver splits (`key_share`, or its preset for the ratio)."""
        if self.key_share is not None:
            return self.key_share
        return HIGH_RATIO_KEY_SHARE if self.high_ratio else KEY_SHARE

    @property
    def tails_normed(self) -> bool:
        """Whether the lower bands' columns are coded in units of their RMS (`tail_norm` or its preset)."""
        return self.high_ratio if self.tail_norm is None else self.tail_norm

    def scoring_queries(self, queries: int) -> int:
        """How many of a block's last `queries` score its selection: at most `query_window`, and at most
        `prompt_window` where keys are rebuilt (post-RoPE keys take every row's logits from the scoring)."""
        window = min(queries, self.query_window)
        return min(window, self.prompt_window) if self.key_space == "pre_rope" else window

    def outlier_count(self, stored_tokens: int) -> int:
        """How many of `stored_tokens` are kept exact as outliers."""
        return int(self.outlier_fraction * stored_tokens)

    @property
    def _budget_ratio(self) -> float:
        """The ratio the rebuild budget follows: the requested one, at most HIGH_RATIO."""
        return min(self.ratio or HIGH_RATIO, HIGH_RATIO)

    def recon_ceiling(self) -> float:
        """The largest share of the stored tokens a step may rebuild with `recon_drop`."""
        if self.recon_max is not None:
            return self.recon_max
        return min(1.0, 2.0 / self._budget_ratio) if self.ratio else 1.0

    def token_cap(self) -> int | None:
        """The most stored tokens a step rebuilds (`recon_token_cap`), or None for no limit."""
        if self.recon_token_cap is None:
            return REBUILD_TOKENS if self.ratio else None
        return self.recon_token_cap or None

    def reconstruct_count(self, stored_tokens: int) -> int:
        """How many compressed tokens to reconstruct per decode step (besides the local window)."""
        if self.top_k is not None:
            return min(self.top_k, stored_tokens)
        frac = self.recon_fraction
        if frac is None:
            frac = min(1.0 / (self.ratio or 1.0), self.recon_cap)
        return min(stored_tokens, max(1, int(round(frac * stored_tokens))))
