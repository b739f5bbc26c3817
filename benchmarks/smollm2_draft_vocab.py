"""Write the shipped SmolLM2 drafter's draft vocabulary (draft_vocab.json): its last training
stage's loss vocabulary, which that run kept in a training state that was not committed.

The conversations stage (benchmarks/train_smollm2_dflash.sh) started on the first 3,000 ShareGPT
prompts, 2,984 stored after the held-out 16, and chose the 8,192 most frequent answer tokens of
those it could train on (plus the end tokens); the committed data store rebuilds that choice
exactly. Drafting from these rows only gives the same drafts on the benchmark prompts
(docs/dflash-training.md) at a fraction of the head's cost.
Usage: python benchmarks/smollm2_draft_vocab.py
"""

import mlxspec
from mlxspec.training.data import SequenceStore, eos_ids
from mlxspec.training.dflash_trainer import frequent_tokens, trainable_ids, write_draft_vocab

DEST = "mlxspec/drafters/trained/smollm2-135m-instruct-b16"
STORE = "data/dflash-smollm2/conversations"
STORED_AT_START, LOSS_VOCAB, MAX_SEQ_LEN = 2984, 8192, 1024


def stage2_answers() -> list:
    """The (tokens, prompt length) sequences the conversations stage chose its vocabulary from."""
    store = SequenceStore(STORE)
    first = [store[i] for i in range(STORED_AT_START)]
    return [first[i] for i in trainable_ids(first, MAX_SEQ_LEN)]


def main():
    _, tokenizer = mlxspec.load(None)
    ids = frequent_tokens(stage2_answers(), tokenizer.vocab_size, LOSS_VOCAB,
                          always=eos_ids(tokenizer))
    write_draft_vocab(DEST, ids)
    print(f"{DEST}: {len(ids)} draft tokens")


if __name__ == "__main__":
    main()
