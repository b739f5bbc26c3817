"""Run on every rank by tests/test_distributed.py under `mlx.launch` (and in-process, with no
group, for the single-process reference): the same generations, rank 0 printing each one's
tokens as a `RESULT {json}` line.

    python tests/distributed_job.py pipeline|tensor
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import mlxspec  # noqa: E402  (loads OpenBLAS before anything imports mlx.core)
import mlx.core as mx  # noqa: E402

from mlxspec.engine import Draft, Drafter  # noqa: E402

PROMPT = "def is_palindrome(s):\n    \"\"\"Return True when s reads the same backwards.\"\"\"\n"
MAX_TOKENS = 16


class WrongDrafts(Drafter):
    """Drafts that are never the target's token: every position is rejected, every pass cuts
    the caches on every rank."""

    name = "wrong"
    default_num_draft = 3

    def propose(self, tokens, k, sampling):
        return Draft(tokens=[(tokens[-1] + 1 + i) % 4096 for i in range(k)])


def cases(model, tokenizer, leads: bool):
    """(name, stream_generate keyword arguments); drafters are built on rank 0 only."""

    def shipped(kind, **options):
        return mlxspec.load_drafter(kind, model=model, tokenizer=tokenizer, **options) \
            if leads else None

    def dflash(**options):
        return shipped("dflash", **options)

    return [
        ("none", dict(drafter="none")),
        ("lookup", dict(drafter="lookup")),
        ("dflash", dict(drafter=dflash())),
        ("dflash-tree", dict(drafter=dflash(tree_budget=8))),
        ("medusa", dict(drafter=shipped("medusa"))),
        ("wrong", dict(drafter=WrongDrafts() if leads else None, adaptive=False)),
        ("none-sampled", dict(drafter="none", temp=1.0, seed=7)),
        # A fixed K: the adaptive one follows timings, and other drafts draw other numbers.
        ("dflash-sampled", dict(drafter=dflash(), temp=1.0, top_p=0.9, seed=7, adaptive=False)),
    ]


def tiny_cases():
    return [("none", dict(drafter="none")), ("lookup", dict(drafter="lookup")),
            ("wrong", dict(drafter=WrongDrafts(), adaptive=False)),
            ("lookup-sampled", dict(drafter="lookup", temp=1.0, seed=3, adaptive=False))]


def tiny_target():
    """A random llama whose 4 attention heads and 2 KV heads split two ways, the same on
    every rank (same seed), with SmolLM2's tokenizer (its ids fit the vocabulary)."""
    from mlx_lm.utils import load_tokenizer
    from tiny_models import tiny_llama

    from mlxspec.loading import resolve_model_dir

    tokenizer = load_tokenizer(resolve_model_dir(None))
    return tiny_llama(vocab=49152, hidden=64, layers=4, seed=5, sharpness=30.0), tokenizer


def run(mode: str, group=None) -> dict:
    """{case: generated token ids}, on rank 0 (on other ranks: {})."""
    if mode == "pipeline":
        model, tokenizer = mlxspec.load(shard="pipeline", group=group)
        todo = None
    else:
        model, tokenizer = tiny_target()
        if group is not None:
            mlxspec.distributed.split_model(model, "tensor", group)
        todo = tiny_cases()
    leads = group is None or group.rank() == 0
    todo = todo or cases(model, tokenizer, leads)
    results = {}
    for name, options in todo:
        tokens = [r.token for r in mlxspec.stream_generate(model, tokenizer, PROMPT, MAX_TOKENS,
                                                           **options)]
        results[name] = tokens
    # A kept cache across two calls (chat's turns): the second prefills only its new tokens.
    cache = mlxspec.PromptCache()
    first = [r.token for r in mlxspec.stream_generate(model, tokenizer, PROMPT, 8,
                                                      drafter="lookup", prompt_cache=cache)]
    follow_up = PROMPT + tokenizer.decode(first) + "\n# now call it\n"
    results["kept-cache"] = [r.token for r in mlxspec.stream_generate(
        model, tokenizer, follow_up, 12, drafter="lookup", prompt_cache=cache)]
    return results if leads else {}


if __name__ == "__main__":
    group = mx.distributed.init()
    for name, tokens in run(sys.argv[1], group if group.size() > 1 else None).items():
        print("RESULT " + json.dumps({"case": name, "tokens": tokens}), flush=True)
