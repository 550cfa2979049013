"""A long appended text (a second document) gets bases of its own: `s4r.layers.segments`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from s4r.config import S4RConfig
from s4r.core.budget import KVShape
from s4r.core.compress import compress_layer
from s4r.core.latent import merge_partial_attention
from s4r.core.rope import apply_rope, model_rope_fn
from s4r.layers.lowrank import LowRankLayer
from s4r.layers.segments import SegmentedLayer, settle_appended
from s4r.runtime.session import Session
from tests.helpers import CharTokenizer, tiny_model

HEADS, DIM, Q_HEADS = 2, 16, 4
SHAPE = KVShape(layers=1, kv_heads=HEADS, q_heads=Q_HEADS, head_dim=DIM, dtype_bytes=4)


def _in_subspace(basis: torch.Tensor, tokens: int, gen: torch.Generator) -> torch.Tensor:
    """[HEADS, tokens, DIM] vectors whose concatenated heads lie in `basis`'s span."""
    flat = torch.randn(tokens, basis.shape[1], generator=gen) @ basis.T
    return flat.view(tokens, HEADS, DIM).transpose(0, 1).contiguous()


def _exact_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Attention of one query [1, Hq, 1, d] over every key (GQA, no mask: the query comes last)."""
    rep = Q_HEADS // HEADS
    k, v = keys.repeat_interleave(rep, 0), values.repeat_interleave(rep, 0)
    probs = torch.softmax(query[0] @ k.transpose(1, 2) / DIM**0.5, dim=-1)
    return (probs @ v).unsqueeze(0)


def test_merged_partial_attention_is_one_softmax_over_the_union():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 10, generator=gen) * 4
    values = torch.randn(2, 10, 5, generator=gen)
    whole = torch.softmax(logits, dim=-1) @ values
    outs, lses = [], []
    for part in (slice(0, 3), slice(3, 10)):
        outs.append(torch.softmax(logits[..., part], dim=-1) @ values[:, part])
        lses.append(torch.logsumexp(logits[..., part], dim=-1))
    torch.testing.assert_close(merge_partial_attention(outs, lses), whole)


def _layer_with_append(cfg: S4RConfig, doc2_basis: torch.Tensor, gen: torch.Generator):
    """A layer compressed from a 600-token document in one subspace, then a 400-token document in another
    collected in its buffer as an append does; with the tokens of both."""
    basis1, _ = torch.linalg.qr(torch.randn(HEADS * DIM, 6, generator=gen))
    k1, v1 = (_in_subspace(basis1, 600, gen) for _ in range(2))
    k2, v2 = (_in_subspace(doc2_basis, 400, gen) for _ in range(2))
    layer = compress_layer(k1, v1, None, cfg, cfg.rank_k, cfg.rank_v, None)
    layer.collecting = True
    layer.update(k2.unsqueeze(0), v2.unsqueeze(0))
    return layer, torch.cat([k1, k2], dim=1), torch.cat([v1, v2], dim=1)


EXACT_CFG = S4RConfig(key_space="post_rope",
                      ratio=None, rank_k=8, rank_v=8, coef_dtype="model", coef_bands=None,
                      outlier_fraction=0.0, recon_fraction=1.0, segment_tokens=256)


def test_a_long_append_gets_its_own_bases_and_attention_stays_exact():
    gen = torch.Generator().manual_seed(1)
    basis2, _ = torch.linalg.qr(torch.randn(HEADS * DIM, 6, generator=gen))  # unrelated to document 1's
    layer, keys, values = _layer_with_append(EXACT_CFG, basis2, gen)
    assert layer.buffered == 400  # collected, not folded into document 1's bases
    settled = settle_appended(layer, SHAPE)
    assert isinstance(settled, SegmentedLayer) and len(settled.segments) == 2
    assert settled.logical == settled.stored_length() == 1000 and settled.segments[1].sinks == 0
    query = torch.randn(1, Q_HEADS, 1, DIM, generator=gen)
    new_k, new_v = torch.randn(1, HEADS, 1, DIM, generator=gen), torch.randn(1, HEADS, 1, DIM, generator=gen)
    settled.update(new_k, new_v)
    out = settled.attend(query, None, None, DIM**-0.5)
    # each document lies in a rank-6 subspace and every token is rebuilt: exact up to rounding
    expected = _exact_attention(query, torch.cat([keys, new_k[0]], 1), torch.cat([values, new_v[0]], 1))
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_a_pre_rope_append_is_rotated_from_where_it_starts():
    """Pre-RoPE keys: the second document's segment numbers its tokens from 0 but rotates them to their
    real positions (600..999), as do the rebuilt keys, the queries and a save/load round trip."""
    gen = torch.Generator().manual_seed(3)
    rope = model_rope_fn(tiny_model("llama"))
    cos, sin = rope(torch.arange(1001))
    basis1, basis2 = (torch.linalg.qr(torch.randn(HEADS * DIM, 6, generator=gen))[0] for _ in range(2))
    k1, k2 = _in_subspace(basis1, 600, gen), _in_subspace(basis2, 400, gen)  # low-rank before RoPE
    k1, k2 = apply_rope(k1, cos[:600], sin[:600]), apply_rope(k2, cos[600:1000], sin[600:1000])
    v1, v2 = _in_subspace(basis1, 600, gen), _in_subspace(basis2, 400, gen)
    cfg = S4RConfig(**{**EXACT_CFG.to_dict(), "key_space": "pre_rope"})
    layer = compress_layer(k1, v1, None, cfg, 8, 8, rope)
    layer.collecting = True
    layer.update(k2.unsqueeze(0), v2.unsqueeze(0))
    settled = settle_appended(layer, SHAPE)
    assert isinstance(settled, SegmentedLayer) and len(settled.segments) == 2
    new_k = apply_rope(torch.randn(HEADS, 1, DIM, generator=gen), cos[1000:], sin[1000:]).unsqueeze(0)
    new_v = torch.randn(1, HEADS, 1, DIM, generator=gen)
    query = apply_rope(torch.randn(1, Q_HEADS, 1, DIM, generator=gen), cos[1000:], sin[1000:])
    settled.update(new_k, new_v)
    expected = _exact_attention(query, torch.cat([k1, k2, new_k[0]], 1), torch.cat([v1, v2, new_v[0]], 1))
    torch.testing.assert_close(settled.attend(query, None, None, DIM**-0.5), expected, atol=1e-4, rtol=1e-4)
    # the queries sit at 1000, counted from each segment's start (what scoring un-rotates them by)
    assert [s.query_end for s in settled.segments] == [1001, 401]
    loaded = SegmentedLayer.from_state(settled.state(), settled.meta_state(), rope=rope)
    torch.testing.assert_close(loaded.attend(query, None, None, DIM**-0.5), expected, atol=1e-4, rtol=1e-4)


def test_folding_into_the_first_bases_loses_what_they_do_not_span():
    """The reason segments exist: the same append, folded (segment_tokens=0), is far from exact."""
    gen = torch.Generator().manual_seed(1)
    basis2, _ = torch.linalg.qr(torch.randn(HEADS * DIM, 6, generator=gen))
    cfg = S4RConfig(**{**EXACT_CFG.to_dict(), "segment_tokens": 0})
    layer, keys, values = _layer_with_append(cfg, basis2, gen)
    settled = settle_appended(layer, SHAPE)
    assert isinstance(settled, LowRankLayer) and settled.buffered == cfg.buffer_tokens
    query = torch.randn(1, Q_HEADS, 1, DIM, generator=gen)
    out = settled.attend(query, None, None, DIM**-0.5)
    expected = _exact_attention(query, keys, values)
    assert (out - expected).norm() > 0.1 * expected.norm()


def test_a_short_append_still_folds():
    gen = torch.Generator().manual_seed(2)
    basis2, _ = torch.linalg.qr(torch.randn(HEADS * DIM, 6, generator=gen))
    cfg = S4RConfig(**{**EXACT_CFG.to_dict(), "segment_tokens": 500})  # the append has 400 tokens
    layer, _, _ = _layer_with_append(cfg, basis2, gen)
    settled = settle_appended(layer, SHAPE)
    assert settled is layer and layer.buffered == cfg.buffer_tokens and not layer.collecting


# --- through a session: ratio, persistence, truncation -----------------------------------------------
DOC1 = "The quick brown fox jumps over the lazy dog near the river bank. " * 24
DOC2 = "Seven silver spoons sat quietly upon a mahogany shelf in Prague; " * 18


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", num_hidden_layers=2)


def _session(model, ratio: float = 2.5, **overrides) -> Session:
    loaded = SimpleNamespace(model=model, tokenizer=CharTokenizer(), name="tiny", device="cpu",
                             dtype=torch.float32, context_length=4096)
    return Session(loaded, method="s4r", ratio=ratio, config_overrides={"segment_tokens": 1024, **overrides})


@pytest.mark.parametrize("ingest", ["layerwise", "chunked"])
def test_a_second_document_becomes_a_segment_within_the_ratio(model, ingest, tmp_path):
    session = _session(model)
    session.ingest_mode = ingest
    session.ingest(DOC1)
    session.ingest(DOC2)
    layers = session.cache.layers
    assert all(isinstance(layer, SegmentedLayer) and len(layer.segments) == 2 for layer in layers)
    assert session.cache.ratio() >= 2.5
    # saved and loaded, the segments answer the same
    session.save(tmp_path / "two.s4r")
    loaded = Session.load(tmp_path / "two.s4r", session.loaded)
    assert all(isinstance(layer, SegmentedLayer) for layer in loaded.cache.layers)
    assert loaded.cache.nbytes() == session.cache.nbytes()
    answer = session.ask("Which shelf?", max_new_tokens=6)[0]
    assert loaded.ask("Which shelf?", max_new_tokens=6)[0] == answer


def _views_are_built(session, segments: int) -> bool:
    """Whether every layer has `segments` segments, each holding views current with its storage."""
    from s4r.kernels.s4r_step import _views

    for layer in session.cache.layers:
        parts = getattr(layer, "segments", [layer])
        if len(parts) != segments:
            return False
        for seg in parts:
            kept = seg.__dict__.get("_fused_views")
            if kept is None or _views(seg) is not kept:
                return False
    return True


@pytest.mark.parametrize("ingest", ["layerwise", "chunked"])
def test_each_stored_document_has_the_fused_step_views_before_a_question(model, ingest, tmp_path):
    """What the fused step reads of a layer is built when a document is stored or a saved cache loaded,
    not at the first question."""
    pytest.importorskip("numba")
    from s4r.kernels import jit

    if not jit.available():
        pytest.skip("the fused kernels do not run here")
    session = _session(model)
    session.ingest_mode = ingest
    session.ingest(DOC1)
    assert _views_are_built(session, 1)
    session.ingest(DOC2)
    assert _views_are_built(session, 2)
    session.save(tmp_path / "two.s4r")
    assert _views_are_built(Session.load(tmp_path / "two.s4r", session.loaded), 2)


def test_truncating_into_the_first_document_drops_the_segment(model):
    session = _session(model)
    session.ingest(DOC1)
    first = session.cache.logical_length()
    session.ingest(DOC2)
    session.cache.truncate(first - 10)
    for layer in session.cache.layers:
        assert len(layer.segments) == 1 and layer.logical == first - 10 == layer.stored_length()


def test_segment_tokens_zero_folds_the_second_document(model):
    session = _session(model, segment_tokens=0)
    session.ingest(DOC1)
    session.ingest(DOC2)
    assert all(isinstance(layer, LowRankLayer) for layer in session.cache.layers)


def _planted_pair(cfg: S4RConfig, in_first: bool, gen: torch.Generator):
    """A settled two-segment layer with 80 tokens the query looks at, in document 1 or 2; the query."""
    basis1, _ = torch.linalg.qr(torch.randn(HEADS * DIM, 6, generator=gen))
    basis2, _ = torch.linalg.qr(torch.randn(HEADS * DIM, 6, generator=gen))
    k1, v1 = (_in_subspace(basis1, 600, gen) * 0.1 for _ in range(2))
    k2, v2 = (_in_subspace(basis2, 400, gen) * 0.1 for _ in range(2))
    direction = (basis1 if in_first else basis2)[:, 0].view(HEADS, DIM)
    (k1 if in_first else k2)[:, 200:280] = direction.unsqueeze(1) * 3
    layer = compress_layer(k1, v1, None, cfg, cfg.rank_k, cfg.rank_v, None)
    layer.collecting = True
    layer.update(k2.unsqueeze(0), v2.unsqueeze(0))
    settled = settle_appended(layer, SHAPE)
    assert isinstance(settled, SegmentedLayer)
    settled.update(torch.zeros(1, HEADS, 1, DIM), torch.zeros(1, HEADS, 1, DIM))
    return settled, (direction * 4).repeat_interleave(Q_HEADS // HEADS, 0).view(1, Q_HEADS, 1, DIM)


def test_the_rebuild_budget_goes_where_the_query_looks_across_segments():
    """One top-k over every segment: a query about document 1 may rebuild more of it than its own share."""
    cfg = S4RConfig(**{**EXACT_CFG.to_dict(), "recon_fraction": 0.1})
    settled, query = _planted_pair(cfg, True, torch.Generator().manual_seed(3))
    settled.attend(query, None, None, DIM**-0.5)
    first = settled.segments[0]
    picked = set(first.selected[0].tolist())
    assert first.selection_size()[0] < 80 <= len(picked)
    assert set(range(200 - first.sinks, 280 - first.sinks)) <= picked


def test_the_drop_bound_grows_the_budget_over_every_segment():
    """With `recon_drop`, 80 planted tokens in document 1 are all rebuilt though the fixed count over
    both segments is smaller: the budget is sized on the probabilities normalized over both."""
    cfg = S4RConfig(**{**EXACT_CFG.to_dict(), "recon_fraction": 0.04, "recon_drop": 0.05, "recon_max": 0.5})
    settled, query = _planted_pair(cfg, True, torch.Generator().manual_seed(3))
    settled.attend(query, None, None, DIM**-0.5)
    first, second = settled.segments
    assert first.selection_size()[0] + second.selection_size()[0] < 80
    assert set(range(200 - first.sinks, 280 - first.sinks)) <= set(first.selected[0].tolist())


def test_the_token_cap_holds_for_the_layer_not_per_segment():
    cfg = S4RConfig(**{**EXACT_CFG.to_dict(), "recon_fraction": 0.3, "recon_token_cap": 50})
    settled, query = _planted_pair(cfg, True, torch.Generator().manual_seed(3))
    settled.attend(query, None, None, DIM**-0.5)
    rebuilt = sum(segment.selected.shape[1] for segment in settled.segments)
    assert rebuilt == 50 and all(s.selection_size()[0] <= 50 for s in settled.segments)


def test_a_segment_may_rebuild_nothing():
    """Banded storage (the default) when the whole budget goes to the other segment."""
    cfg = S4RConfig(key_space="post_rope",
                    ratio=None, rank_k=8, rank_v=8, recon_fraction=0.1, recon_drop=None,
                    outlier_fraction=0.0, segment_tokens=256)
    settled, query = _planted_pair(cfg, False, torch.Generator().manual_seed(4))
    out = settled.attend(query, None, None, DIM**-0.5)
    assert settled.segments[0].selected.shape[1] == 0 and bool(out.isfinite().all())
    assert set(range(200, 280)) <= set(settled.segments[1].selected[0].tolist())


def test_the_second_document_spends_what_the_first_left_under_the_ratio(model):
    """`segment_budget="layer"`: document 1's room for new tokens (taken over by the new last segment) and
    its rounding go to document 2's ranks, and the layer as a whole keeps the ratio, also after an answer
    long enough to fold; "segment" keeps 1/ratio of each document's own tokens."""
    sessions = {}
    for budget in ("layer", "segment"):
        session = _session(model, ratio=5.0, segment_budget=budget)  # ranks below the width at 5x
        session.ingest(DOC1)
        session.ingest(DOC2)
        sessions[budget] = session
    shared, own = (sessions[b].cache.layers[0].segments for b in ("layer", "segment"))
    assert shared[0].basis_k.shape == own[0].basis_k.shape  # document 1 is compressed alike
    assert shared[1].basis_k.shape[-1] + shared[1].basis_v.shape[-1] > (
        own[1].basis_k.shape[-1] + own[1].basis_v.shape[-1])
    assert 5.0 <= sessions["layer"].cache.ratio() < sessions["segment"].cache.ratio()
    session = sessions["layer"]
    session.ask("Which shelf?", max_new_tokens=150)
    assert session.cache.layers[0].segments[1].stored_coefs > 1190  # the answer was folded in
    assert session.cache.ratio() >= 5.0
    with pytest.raises(ValueError, match="segment_budget"):
        S4RConfig(segment_budget="document")


# --- extended bases (`segment_bases="extend"`) ------------------------------------------------------
def test_an_extended_basis_adds_what_the_first_lacks_and_is_stored_once():
    """Document 2 lies in document 1's rank-6 subspace plus two directions of its own: extended to rank 8,
    the segment's basis is document 1's six columns (the same storage) and two new ones, and attention
    over both documents is exact; the shared columns are counted once."""
    gen = torch.Generator().manual_seed(5)
    basis1, _ = torch.linalg.qr(torch.randn(HEADS * DIM, 6, generator=gen))
    extra, _ = torch.linalg.qr(torch.randn(HEADS * DIM, 2, generator=gen))
    basis2, _ = torch.linalg.qr(torch.cat([basis1[:, :4], extra], dim=1))  # 4 shared directions, 2 new
    cfg = S4RConfig(**{**EXACT_CFG.to_dict(), "segment_bases": "extend"})
    k1, v1 = (_in_subspace(basis1, 600, gen) for _ in range(2))
    k2, v2 = (_in_subspace(basis2, 400, gen) for _ in range(2))
    layer = compress_layer(k1, v1, None, cfg, 6, 6, None)
    layer.collecting = True
    layer.update(k2.unsqueeze(0), v2.unsqueeze(0))
    settled = settle_appended(layer, SHAPE)
    first, second = settled.segments
    assert (second.shared_k, second.shared_v) == (6, 6) and second.basis_k.shape[-1] == 8
    assert first.basis_k.data_ptr() == second.basis_k.data_ptr()  # one storage, first is its prefix view
    torch.testing.assert_close(second.basis_k[..., :6], first.basis_k)
    own_bytes = sum(b.numel() * b.element_size() for b in (*first.own_bases(), *second.own_bases()))
    assert own_bytes == (8 + 8) * HEADS * DIM * 4  # 6 shared + 2 new columns per kind, each once
    query = torch.randn(1, Q_HEADS, 1, DIM, generator=gen)
    expected = _exact_attention(query, torch.cat([k1, k2], 1), torch.cat([v1, v2], 1))
    torch.testing.assert_close(settled.attend(query, None, None, DIM**-0.5), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tail_norm", [False, True])
def test_extended_bases_keep_the_ratio_and_survive_save_load_and_truncation(model, tmp_path, tail_norm):
    """With `tail_norm` the bases carry their lower columns' scales: the segment keeps document 1's
    (scaled) columns as they are stored and scales only its own."""
    sessions = {}
    for bases in ("own", "extend"):
        session = _session(model, ratio=5.0, segment_bases=bases, tail_norm=tail_norm)
        session.ingest(DOC1)
        first = session.logical_length
        session.ingest(DOC2)
        sessions[bases] = session
    own, extended = (sessions[b].cache.layers[0].segments[1] for b in ("own", "extend"))
    assert extended.shared_k > 0 and extended.basis_v.shape[-1] > own.basis_v.shape[-1]
    doc1 = sessions["extend"].cache.layers[0].segments[0]
    assert torch.equal(extended.basis_v[..., : extended.shared_v], doc1.basis_v)
    scaled = (extended.basis_v.float().norm(dim=-2)[0] - 1).abs() > 1e-3
    assert bool(scaled.any()) == tail_norm and not bool(scaled[: doc1.plan_v.lead].any())
    session = sessions["extend"]
    assert session.cache.ratio() >= 5.0
    session.save(tmp_path / "ext.s4r")
    loaded = Session.load(tmp_path / "ext.s4r", session.loaded)
    assert loaded.cache.nbytes() == session.cache.nbytes()
    seg0, seg1 = loaded.cache.layers[0].segments
    assert seg0.basis_k.data_ptr() == seg1.basis_k.data_ptr()
    answer = session.ask("Which shelf?", max_new_tokens=120)[0]
    assert loaded.ask("Which shelf?", max_new_tokens=120)[0] == answer
    assert session.cache.ratio() >= 5.0
    # cut back into document 1: the segment goes, and with it the columns only it used
    session.cache.truncate(first - 10)
    for layer in session.cache.layers:
        (only,) = layer.segments
        basis = only.basis_k
        assert basis.untyped_storage().nbytes() == basis.numel() * basis.element_size()


def test_a_third_document_extends_the_chain_and_each_column_is_stored_once(model, tmp_path):
    session = _session(model, ratio=5.0, segment_bases="extend")
    session.ingest(DOC1[:1100])
    session.ingest(DOC2)
    session.ingest("Nine amber lanterns hung above the quiet harbour of Valletta. " * 17)
    assert session.cache.ratio() >= 5.0
    segments = session.cache.layers[0].segments
    assert len(segments) == 3
    assert all(s.shared_k == p.basis_k.shape[-1] for p, s in zip(segments, segments[1:], strict=False))
    assert len({s.basis_v.data_ptr() for s in segments}) == 1  # one storage for the whole chain
    storage = segments[-1].basis_v.untyped_storage().nbytes()
    assert storage == sum(s.own_bases()[1].numel() * s.own_bases()[1].element_size() for s in segments)
    session.save(tmp_path / "three.s4r")
    loaded = Session.load(tmp_path / "three.s4r", session.loaded)
    assert loaded.cache.nbytes() == session.cache.nbytes()
    assert loaded.ask("Where?", max_new_tokens=8)[0] == session.ask("Where?", max_new_tokens=8)[0]
