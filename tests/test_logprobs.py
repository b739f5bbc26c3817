"""Log-probabilities of the emitted tokens (stream_generate's `logprobs`): each equals the
target's own distribution at that position, recomputed by one plain forward pass over prompt +
output (the raw log-softmax when greedy, processed_logprobs when sampling), whichever drafter
proposed the token and whether its drafts were accepted or rejected, on MLX and torch; the top
n are that distribution's n best, sorted; asking for them changes no token; bad values are
refused before any compute."""

import math

import mlx.core as mx
import numpy as np
import pytest
from test_tree_verification import SHAPE, VOCAB, PlantedTreeDrafter
from tiny_models import tiny_llama, tiny_qwen3_next

import mlxspec
from mlxspec.drafters import DraftModelDrafter
from mlxspec.drafters.layerskip import LayerSkipDrafter
from mlxspec.engine import Draft, Drafter, PlainDecoding, SpecStats, speculative_tokens
from mlxspec.backends.mlx.target import MLXTarget
from mlxspec.sampling import SamplingConfig
from mlxspec.backends.mlx.sampling import processed_logprobs

GREEDY = SamplingConfig()
SAMPLED = SamplingConfig(temp=0.8, top_p=0.9)
PROMPT = [7, 7, 7]  # greedy: 20 20 18 20 18 10 22 5 18 1 4 16 21 4
LENGTH, TOP = 14, 4


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab=VOCAB, seed=7, sharpness=4.0)


class PlantedChain(Drafter):
    """Proposes `full`'s continuation with its draft position j made wrong: drafts before j are
    accepted (greedy), the one at j rejected."""

    name = "planted-chain"

    def __init__(self, full: list[int], j: int = 2):
        self.full, self.j = full, j

    def propose(self, tokens, k, sampling):
        drafts = list(self.full[len(tokens) : len(tokens) + k])
        drafts += [0] * (k - len(drafts))
        if self.j < len(drafts):
            drafts[self.j] = (drafts[self.j] + 1) % VOCAB
        return Draft(tokens=drafts)


def mlx_reference(model, prompt, out, sampling) -> np.ndarray:
    """The target's distribution for each output token, from one plain forward pass."""
    logits = model(mx.array(prompt + out)[None])[0, len(prompt) - 1 : -1].astype(mx.float32)
    if sampling.greedy:
        return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    return np.array(processed_logprobs(logits, sampling))


def run(target, drafter, sampling, logprobs=TOP, prompt=PROMPT, num_draft=SHAPE.size):
    stats = SpecStats()
    out = list(speculative_tokens(target, drafter, prompt, sampling=sampling, max_tokens=LENGTH,
                                  num_draft=num_draft, stats=stats, logprobs=logprobs))
    return out, stats


def check(steps, reference: np.ndarray, n: int = TOP) -> None:
    """Each step (token, from_draft, logprob, top): logprob is the reference's at the token, top
    the reference's n best (probability-0 tokens left out), best first."""
    tokens = [s[0] for s in steps]
    assert len(reference) == len(tokens)
    got = np.array([s[2] for s in steps])
    np.testing.assert_allclose(got, reference[np.arange(len(tokens)), tokens], atol=1e-4)
    for (_, _, _, top), row in zip(steps, reference):
        ids, values = [i for i, _ in top], np.array([v for _, v in top])
        finite = np.sort(row[np.isfinite(row)])[::-1]
        assert len(top) == min(n, len(finite)) and len(set(ids)) == len(ids)
        assert np.all(np.diff(values) <= 0), "top_logprobs not best first"
        np.testing.assert_allclose(values, finite[: len(top)], atol=1e-4)
        np.testing.assert_allclose(values, row[ids], atol=1e-4)  # the ids hold those values


def greedy_continuation(model, prompt):
    out, _ = run(MLXTarget(model), PlainDecoding(), GREEDY, logprobs=None, prompt=prompt)
    return prompt + [t for t, _ in out]


def mlx_drafters(model, full):
    return {
        "plain": PlainDecoding(),
        "chain": PlantedChain(full),
        "draft model": DraftModelDrafter(model),  # its own p: every sampled draft kept
        "layerskip": LayerSkipDrafter(model, 1),
        "tree": PlantedTreeDrafter(full, 5, 3),  # 2 of the branch's drafts right, the 3rd wrong
    }


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("kind", ["plain", "chain", "draft model", "layerskip", "tree"])
def test_mlx_logprobs_are_the_targets_at_each_emitted_token(target, sampling, kind):
    full = greedy_continuation(target, PROMPT)
    mx.random.seed(0)
    steps, stats = run(MLXTarget(target, speculative=True), mlx_drafters(target, full)[kind],
                       sampling)
    check(steps, mlx_reference(target, PROMPT, [s[0] for s in steps], sampling))
    if kind in ("chain", "tree"):  # drafts both accepted and rejected
        assert 0 < stats.accepted < stats.drafted


def test_a_hybrid_target_rolls_back_and_still_reports_its_own_distribution():
    model = tiny_qwen3_next(vocab=VOCAB, seed=3)
    full = greedy_continuation(model, PROMPT)
    steps, stats = run(MLXTarget(model, speculative=True), PlantedChain(full), GREEDY,
                       num_draft=4)
    assert 0 < stats.accepted < stats.drafted
    check(steps, mlx_reference(model, PROMPT, [s[0] for s in steps], GREEDY))


def test_top_logprobs_leave_out_what_the_processing_removes(target):
    """top_k=3 leaves 3 tokens of nonzero probability: top_logprobs lists only those."""
    sampling = SamplingConfig(temp=1.0, top_k=3)
    mx.random.seed(0)
    steps, _ = run(MLXTarget(target, speculative=True), PlainDecoding(), sampling, logprobs=6)
    assert all(len(top) == 3 and all(math.isfinite(v) for _, v in top) for *_, top in steps)
    check(steps, mlx_reference(target, PROMPT, [s[0] for s in steps], sampling), n=6)


def test_without_logprobs_a_pass_scores_nothing(target, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("scored without being asked")

    monkeypatch.setattr("mlxspec.backends.mlx.target.committed_scores", refuse)
    full = greedy_continuation(target, PROMPT)
    steps, _ = run(MLXTarget(target, speculative=True), PlantedChain(full), GREEDY, logprobs=None)
    assert [len(step) for step in steps] == [2] * LENGTH  # (token, from_draft), as before


def test_zero_top_logprobs_gives_the_token_alone(target):
    steps, _ = run(MLXTarget(target), PlainDecoding(), GREEDY, logprobs=0)
    assert all(top == [] for *_, top in steps)
    check(steps, mlx_reference(target, PROMPT, [s[0] for s in steps], GREEDY), n=0)


# ---- the API -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer(smollm_dir):
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(smollm_dir)


# A fixed K: the adaptive one follows timings, and other drafts draw other numbers.
@pytest.mark.parametrize("options", [dict(drafter="lookup", num_draft=4),
                                     dict(temp=0.8, top_p=0.9, seed=7),
                                     dict(temp=0.8, seed=7, drafter="lookup", num_draft=4,
                                          adaptive=False)])
def test_asking_for_logprobs_changes_no_token(target, tokenizer, options):
    plain = list(mlxspec.stream_generate(target, tokenizer, PROMPT, LENGTH, **options))
    scored = list(mlxspec.stream_generate(target, tokenizer, PROMPT, LENGTH, logprobs=2,
                                          **options))
    assert [r.token for r in scored] == [r.token for r in plain]
    assert all(r.logprob is None and r.top_logprobs == [] for r in plain)
    sampling = SamplingConfig(temp=options.get("temp", 0.0), top_p=options.get("top_p", 1.0))
    steps = [(r.token, r.from_draft, r.logprob, r.top_logprobs) for r in scored]
    check(steps, mlx_reference(target, PROMPT, [r.token for r in scored], sampling), n=2)


def test_the_stopping_eos_response_scores_the_eos_outside_the_output(target, smollm_dir):
    """The last response on EOS carries the EOS token and its logprob, but generation_tokens
    does not count it: that is how a caller tells it from the output."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from mlx_lm.utils import load_tokenizer

    plain = greedy_continuation(target, PROMPT)[len(PROMPT) :]
    stop_at = 5
    eos = plain[stop_at]
    assert eos not in plain[:stop_at]
    tokenizer = TokenizerWrapper(load_tokenizer(smollm_dir)._tokenizer, eos_token_ids={eos})
    responses = list(mlxspec.stream_generate(target, tokenizer, PROMPT, LENGTH, logprobs=1,
                                             drafter="lookup"))
    last = responses[-1]
    assert last.finish_reason == "stop" and last.token == eos
    assert last.generation_tokens == stop_at == len(responses) - 1
    reference = mlx_reference(target, PROMPT, plain[: stop_at + 1], GREEDY)
    check([(r.token, r.from_draft, r.logprob, r.top_logprobs) for r in responses], reference,
          n=1)


@pytest.mark.parametrize("bad, error, message", [
    (-1, ValueError, "logprobs must be between 0 and 20, got -1"),
    (21, ValueError, "logprobs must be between 0 and 20, got 21"),
    (2.0, TypeError, "logprobs must be an integer or None, got 2.0"),
    (True, TypeError, "logprobs must be an integer or None, got True"),
    ("3", TypeError, "logprobs must be an integer or None, got '3'"),
])
def test_bad_logprobs_are_refused_before_any_compute(target, tokenizer, monkeypatch, bad, error,
                                                     message):
    def refuse(*args, **kwargs):
        raise AssertionError("the target ran before the request was checked")

    monkeypatch.setattr(MLXTarget, "_forward", refuse)
    with pytest.raises(error, match=message):
        mlxspec.generate(target, tokenizer, PROMPT, max_tokens=4, logprobs=bad)


# ---- torch -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def twin(target, tmp_path_factory, one_torch_thread):
    pytest.importorskip("transformers", reason="the torch backend needs transformers")
    from test_torch_backend import torch_twin

    return torch_twin(target, tmp_path_factory.mktemp("logprobs_twin"))


def torch_reference(model, prompt, out, sampling) -> np.ndarray:
    import torch

    from mlxspec.backends.torch.sampling import processed_logprobs as torch_processed

    with torch.inference_mode():
        ids = torch.tensor([prompt + out], device=model.device)
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        dist = torch.log_softmax(logits, -1) if sampling.greedy else torch_processed(logits,
                                                                                      sampling)
    return dist.cpu().numpy()


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("kind", ["plain", "chain", "tree"])
def test_torch_logprobs_are_the_targets_at_each_emitted_token(target, twin, sampling, kind):
    import torch

    from mlxspec.backends.torch import TorchTarget

    full = greedy_continuation(target, PROMPT)  # the twin's too (test_torch_trees)
    torch.manual_seed(0)
    steps, stats = run(TorchTarget(twin, speculative=True), mlx_drafters(target, full)[kind],
                       sampling)
    check(steps, torch_reference(twin, PROMPT, [s[0] for s in steps], sampling))
    if kind != "plain":  # drafts both accepted and rejected, the tree verified as a tree
        assert 0 < stats.accepted < stats.drafted and stats.chain_fallback_steps == 0
