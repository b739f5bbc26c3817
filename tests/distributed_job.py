"""Run on every rank by tests/test_distributed.py under `mlx.launch` (and in-process, with no
group, for the single-process reference): the same generations, rank 0 printing each one's
tokens as a `RESULT {json}` line.

    python tests/distributed_job.py pipeline|tensor|hybrid
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
            ("lookup-sampled", dict(drafter="lookup", temp=1.0, seed=3, adaptive=False)),
            ("lookup-logprobs", dict(drafter="lookup", logprobs=2, adaptive=False))]


def tiny_target(mode: str):
    """The same random model on every rank (same seed), with SmolLM2's tokenizer (its ids fit
    the vocabulary): for "tensor" a llama whose 4 attention heads and 2 KV heads split two
    ways, for "hybrid" a Qwen3-Next (Gated DeltaNet layers 0-2, attention at 3: rank 1 runs
    recurrent layers only, whose caches count no positions; rank 0 one of each)."""
    from mlx_lm.utils import load_tokenizer
    from tiny_models import tiny_llama, tiny_qwen3_next

    from mlxspec.loading import resolve_model_dir

    tokenizer = load_tokenizer(resolve_model_dir(None))
    if mode == "hybrid":
        return tiny_qwen3_next(vocab=49152, seed=5, full_attention_interval=4), tokenizer
    return tiny_llama(vocab=49152, hidden=64, layers=4, seed=5, sharpness=30.0), tokenizer


def run(mode: str, group=None) -> dict:
    """{case: generated token ids}, on rank 0 (on other ranks: {})."""
    if mode == "pipeline":
        model, tokenizer = mlxspec.load(shard="pipeline", group=group)
        todo = None
    else:
        model, tokenizer = tiny_target(mode)
        if group is not None:
            mlxspec.distributed.split_model(model, "pipeline" if mode == "hybrid" else mode,
                                            group)
        todo = tiny_cases()
    leads = group is None or group.rank() == 0
    todo = todo or cases(model, tokenizer, leads)
    results = {}
    for name, options in todo:
        responses = list(mlxspec.stream_generate(model, tokenizer, PROMPT, MAX_TOKENS, **options))
        results[name] = [r.token for r in responses]
        if options.get("logprobs"):  # rank 0 scored each token, as one process does
            results[name + "-scored"] = [r.logprob is not None and len(r.top_logprobs) == 2
                                         for r in responses]
    # A kept cache across two calls (chat's turns): the second prefills only its new tokens.
    # Token ids, so the second prompt extends all the cache holds (a recurrent one too).
    cache = mlxspec.PromptCache()
    prompt = tokenizer.encode(PROMPT)
    first = [r.token for r in mlxspec.stream_generate(model, tokenizer, prompt, 8,
                                                      drafter="lookup", prompt_cache=cache)]
    follow_up = prompt + first + tokenizer.encode("\n# now call it\n", add_special_tokens=False)
    results["kept-cache"] = [r.token for r in mlxspec.stream_generate(
        model, tokenizer, follow_up, 12, drafter="lookup", prompt_cache=cache)]
    if mode != "tensor":  # each rank holds a slice of every layer's heads there
        results["kept-cache-state"] = state_sums(model, cache)
    return results if leads else {}


def state_sums(model, cache) -> list[float]:
    """Per layer, the sum of every array the kept cache holds, gathered from the rank that
    runs it: a rank whose state went wrong shows here even where the tokens do not."""
    from mlx.utils import tree_flatten

    from mlxspec.backends.mlx.hidden_states import decoder_layers

    stage = mlxspec.distributed.stage_of(model)
    sums = [0.0] * len(decoder_layers(model))
    own, start = cache.cache, 0
    if stage is not None:
        start = stage.start
        if not stage.leads:
            own = next(reversed(stage.follower.caches.values()))
    for i, c in enumerate(own, start=start):
        arrays = [a for _, a in tree_flatten(c.state) if isinstance(a, mx.array)]
        sums[i] = sum(mx.sum(a.astype(mx.float32)).item() for a in arrays)
    if stage is not None:
        sums = mx.distributed.all_sum(mx.array(sums), group=stage.group).tolist()
    return sums


if __name__ == "__main__":
    group = mx.distributed.init()
    for name, tokens in run(sys.argv[1], group if group.size() > 1 else None).items():
        print("RESULT " + json.dumps({"case": name, "tokens": tokens}), flush=True)
