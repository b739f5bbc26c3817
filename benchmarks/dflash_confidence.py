"""Is the shipped drafter's first draft right more often when it is confident? Teacher-forced on
the target's own greedy continuations of the benchmark prompts (10 a suite, 64 tokens): for every
generated position, the drafter's slot-1 token (argmax over its draft vocabulary) against the
target's next token, and its confidence (the softmax's largest probability over that vocabulary).

Why: a gate that verifies drafts only when the drafter is confident would save the verify cost
of the drafts that fail. Whether it pays depends on how well confidence sorts them, measured
here, against the costs the benchmark measures (docs/dflash-training.md).

Usage: python benchmarks/dflash_confidence.py
"""

import json

import mlxspec
import mlx.core as mx
import numpy as np

from mlxspec.bench import chat_prompt
from mlxspec.drafters.shipped import find_shipped_drafter
from mlxspec.generate import encode_prompt, stream_generate
from mlxspec.models.dflash import DFlashConfig, read_draft_vocab, read_weights
from mlxspec.prompts import humaneval_prompts, mtbench_prompts
from mlxspec.backends.mlx.target_parts import embedding_checksum, head_rows, target_head, target_sizes
from mlxspec.training.dflash_trainer import MLXDFlashTraining, _schedule, training_logits

def slot1_confidence(math, rows, vocab, tokens, prompt_len):
    """(confidence, right) per generated position after the first; `rows`: the head's rows for
    `vocab`, as drafting computes them."""
    feats, labels = math.features(tokens)
    anchors = mx.arange(prompt_len, len(tokens) - 1)
    logits = training_logits(math.model, feats, mx.array(tokens), anchors,
                             embed_tokens=math.embed, lm_head=rows)[:, 0]
    right = vocab[mx.argmax(logits, axis=-1)] == labels[anchors + 1]
    return np.array(mx.softmax(logits, axis=-1).max(axis=-1)), np.array(right)


def main():
    model, tokenizer = mlxspec.load(None)
    shipped = find_shipped_drafter(target_sizes(model), lambda: embedding_checksum(model))
    args = DFlashConfig.from_dict(json.loads((shipped / "config.json").read_text()))
    math = MLXDFlashTraining(model, args, dict(read_weights(shipped)),
                             schedule=_schedule(1e-3, 1, 2), weight_decay=0.0, grad_clip=0.0,
                             gamma=2.0, loss_ids=None, inv_scale=None, labels="target")
    vocab = mx.array(read_draft_vocab(shipped, args.vocab_size))
    rows = head_rows(target_head(model), vocab)
    for suite, prompts in (("HumanEval", humaneval_prompts(10)), ("MT-Bench", mtbench_prompts(10))):
        confidence, right = [], []
        for text in prompts:
            prompt = chat_prompt(tokenizer, text)
            ids = encode_prompt(tokenizer, prompt)
            tokens = ids + [r.token for r in stream_generate(model, tokenizer, prompt, 64)]
            if len(tokens) - 1 > len(ids):
                c, r = slot1_confidence(math, rows, vocab, tokens, len(ids))
                confidence.append(c)
                right.append(r)
        confidence, right = np.concatenate(confidence), np.concatenate(right)
        order = np.argsort(-confidence)
        print(f"{suite}: {len(order)} positions, slot 1 right {right.mean():.3f}")
        for share in (0.1, 0.2, 0.3, 0.5):
            top, rest = order[:int(share * len(order))], order[int(share * len(order)):]
            print(f"  most confident {share:.0%} (>= {confidence[top].min():.2f}): right "
                  f"{right[top].mean():.3f}; the rest {right[rest].mean():.3f}")


if __name__ == "__main__":
    main()
