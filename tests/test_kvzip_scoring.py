"""KVzip's scoring as the paper and its reference code do it: the self-task, the local softmax, the head.

Tiny random models and hand-made tensors keep these fast; what is checked is which tokens each
reconstruction chunk scores, how its attention is normalized, and which prompt tokens are always kept.
"""

from __future__ import annotations

import math

import torch

from s4r.layers.eviction import EvictedLayer
from s4r.methods.kvzip import KVzipMethod, prompt_head, repeat_prompts
from s4r.methods.kvzip_scoring import RepeatChunk, RepeatPrompts, ScoringLayer, kvzip_scores, repeat_chunks
from tests.helpers import CharTokenizer
from tests.test_methods import compressed, model_for, random_ids, staged


def test_repeat_chunks_follow_the_self_task():
    """First chunk: the request, the turn to the answer, the chunk; later ones quote the chunk before."""
    prompts = RepeatPrompts(first=[1, 2], part=[3], to_answer=[9], overlap=2)
    chunks = repeat_chunks(list(range(10, 20)), 4, prompts)
    assert chunks == [
        RepeatChunk(0, 4, [1, 2, 9, 10, 11, 12, 13]),
        RepeatChunk(4, 8, [3, 12, 13, 9, 14, 15, 16, 17]),
        RepeatChunk(8, 10, [3, 16, 17, 9, 18, 19]),
    ]


def test_the_requests_open_the_answer_in_the_chat_format():
    tok = CharTokenizer()  # no chat template: the plain "User:/Assistant:" fallback
    prompts = repeat_prompts(tok)
    assert prompts.to_answer == tok.encode("\nAssistant:")
    assert prompts.first == tok.encode("\n\nRepeat the previous context exactly.")
    assert prompts.part == tok.encode("\n\nRepeat the part of the previous context exactly, starting with ")


def _layer_after_one_chunk(local: bool, head: int = 1):
    """A 6-token context, one KV head, two query heads; the chunk repeats tokens [3, 5)."""
    gen = torch.Generator().manual_seed(0)
    keys, values = torch.randn(1, 6, 4, generator=gen), torch.randn(1, 6, 4, generator=gen)
    new_k, new_v = torch.randn(1, 3, 4, generator=gen), torch.randn(1, 3, 4, generator=gen)
    query = torch.randn(1, 2, 3, 4, generator=gen)
    layer = ScoringLayer(keys, values, head=head, local=local)
    layer.start_chunk(3, 5)
    layer.update(new_k[None], new_v[None])
    out = layer.attend(query, None, None, 0.5)
    # reference: plain causal attention of the 3 fed tokens over context + themselves, per query head
    k_all, v_all = torch.cat([keys, new_k], 1)[0], torch.cat([values, new_v], 1)[0]
    logits = query[0] @ k_all.T * 0.5  # [2, 3, 9]
    logits[:, :, 6:] = logits[:, :, 6:].masked_fill(torch.ones(3, 3).triu(1).bool(), -math.inf)
    return layer, out, logits, v_all


def test_scoring_attention_is_the_models_and_scores_only_the_repeated_chunk():
    layer, out, logits, v_all = _layer_after_one_chunk(local=True)
    assert torch.allclose(out[0], logits.softmax(-1) @ v_all, atol=1e-5)  # the forward is untouched
    assert torch.all(layer.scores[:, :3] == 0) and torch.all(layer.scores[:, 5:] == 0)
    assert torch.all(layer.scores[:, 3:5] > 0)


def test_local_softmax_is_over_the_head_the_chunk_and_the_fed_tokens():
    """KVzip's normalization: the head (token 0), the repeated chunk (3, 4) and the fed tokens (6-8)."""
    layer, _, logits, _ = _layer_after_one_chunk(local=True)
    visible = torch.tensor([True, False, False, True, True, False, True, True, True])
    local = logits.masked_fill(~visible, -math.inf).softmax(-1)
    expected = local[..., 3:5].amax(dim=(0, 1))  # max over query heads and queries
    assert torch.allclose(layer.scores[0, 3:5], expected, atol=1e-5)
    # normalized over the whole context instead (the earlier approximation), every score is lower
    wide, _, _, _ = _layer_after_one_chunk(local=False)
    assert torch.allclose(wide.scores[0, 3:5], logits.softmax(-1)[..., 3:5].amax(dim=(0, 1)), atol=1e-5)
    assert torch.all(wide.scores[0, 3:5] < layer.scores[0, 3:5])


def test_each_chunk_scores_its_own_tokens_in_a_model_forward():
    model = model_for()
    ids = random_ids(300, 21)
    source = staged(model, ids)
    chunk = RepeatChunk(100, 200, [5, 6, 7] + ids[100:200].tolist())
    scores = kvzip_scores(model, source, [chunk])
    assert len(scores) == len(source.layers) and scores[0].shape == (2, 300)
    for layer_scores in scores:
        assert torch.all(layer_scores[:, :100] == 0) and torch.all(layer_scores[:, 200:] == 0)
        assert torch.all(layer_scores[:, 100:200] > 0) and float(layer_scores.max()) <= 1.0


def test_prompt_head_is_found_only_at_the_start():
    assert prompt_head([7, 8, 9, 1], [7, 8]) == 2
    assert prompt_head([1, 7, 8], [7, 8]) == 0
    assert prompt_head([7, 8], []) == 0


def test_the_chat_template_head_is_always_kept():
    """KVzip never evicts the system prompt: every head keeps the template's head at ratio 5."""
    model = model_for()
    head = CharTokenizer().encode("User: ")
    ids = torch.cat([torch.tensor(head), random_ids(1200, 22)])
    source = staged(model, ids)
    cache, info = compressed(model, source, KVzipMethod(ratio=5.0, chunk_tokens=256), 5.0)
    assert info["protected_tokens"] == len(head) and cache.ratio() >= 5.0
    for kept, full in zip(cache.layers, source.layers, strict=True):
        assert isinstance(kept, EvictedLayer)
        first = full.keys_view[0][:, : len(head)]
        # kept tokens are in position order, so the head's keys lead every KV head's kept set
        assert torch.equal(kept.keys_view[:, : len(head)], first)
