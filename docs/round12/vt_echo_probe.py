"""Where a compressed cache parts from the full cache's greedy variable-tracking answer (diagnostic).

For each chosen sample: the full cache answers greedily; that answer is then fed token by token (as
generation feeds it) through each variant, printing the log-probability of the full cache's token and
the variant's own best token wherever the variant would have chosen another one.
Usage: python docs/round12/vt_echo_probe.py SEED IDX[,IDX...] [VARIANT ...]
"""

import sys

import torch

from research.tuning import TUNING_VARIANTS
from s4r.bench.tasks import answer_budget, make_samples
from s4r.models.loading import load_model
from s4r.runtime.session import Session


def feed(session, sample, answer_ids):
    prompt = session._encode(session._turn_prefix() + sample.question.strip() + session.segments.to_assistant
                             + sample.answer_prefix)
    start = session.logical_length
    rows, pos = [], start
    with torch.inference_mode():
        for chunk in [prompt, *([t] for t in answer_ids[:-1])]:
            ids = torch.tensor([chunk])
            positions = torch.arange(pos, pos + len(chunk)).unsqueeze(0)
            out = session.model(input_ids=ids, position_ids=positions, cache=session.cache, use_cache=True,
                                logits_to_keep=1)
            rows.append(out.logits[0, -1].float())
            pos += len(chunk)
    session.cache.truncate(start)
    return torch.log_softmax(torch.stack(rows), dim=-1)


def main():
    seed, idxs = int(sys.argv[1]), [int(i) for i in sys.argv[2].split(",")]
    variants = sys.argv[3:] or ["default"]
    torch.set_num_threads(1)
    loaded = load_model("smollm2-135m")
    tok = loaded.tokenizer
    count = lambda s: len(tok.encode(s, add_special_tokens=False))  # noqa: E731
    samples = make_samples("variable_tracking", 4096, max(idxs) + 1, seed, count, book="romeo-and-juliet")
    for i in idxs:
        sample = samples[i]
        staged = Session(loaded, method="full")
        staged.ingest(sample.context, compress=False)
        full = staged.fork(method="full", ratio=1.0)
        budget = answer_budget(sample, count, 32)
        answer, _ = full.ask(sample.question, prime=sample.answer_prefix, max_new_tokens=budget)
        print(f"## sample {i}: answers {sample.answers}\nfull: {answer!r}")
        ids = tok.encode(answer, add_special_tokens=False)
        for name in variants:
            fork = staged.fork(method="s4r", ratio=5.0, config_overrides=TUNING_VARIANTS[name])
            own, _ = fork.ask(sample.question, prime=sample.answer_prefix, max_new_tokens=budget)
            fork = staged.fork(method="s4r", ratio=5.0, config_overrides=TUNING_VARIANTS[name])
            logp = feed(fork, sample, ids)
            print(f"{name}: own answer {own!r}")
            for j, t in enumerate(ids):
                best = int(logp[j].argmax())
                if best != t:
                    print(f"   at {j} {tok.decode([t])!r}: {logp[j, t]:.2f}; best {tok.decode([best])!r} "
                          f"{logp[j, best]:.2f}")
        del staged, full


if __name__ == "__main__":
    main()
