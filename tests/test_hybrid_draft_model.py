"""Hybrid draft models: a Qwen3.5 or Qwen3-Next draft model (Gated DeltaNet layers, whose
ArraysCache holds a recurrent state, beside attention layers) drafting for a hybrid or a plain
target. They used to be refused ("draft model cache ArraysCache cannot roll back").

Each step feeds the draft model the tokens it has not seen, then its drafts one at a time; after
verification only a prefix of the drafts is kept, so its attention caches are cut and its recurrent
states put back to those recorded at the kept length (mlxspec.rollback). Checked here: output is
plain decoding's (greedy token for token with drafts rejected at every position, sampled by chi
squared), and after every rollback the draft model's caches equal caches built from scratch on the
tokens they hold.
"""

import json
import re
import shutil

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache
from test_hybrid import PROMPT as TEXT_PROMPT
from test_hybrid import generate
from test_hybrid import hybrid_dir  # noqa: F401  (a fixture: a tiny Qwen3-Next target directory)
from test_rollback_property import KS, N, expected_stats, mlx_reference
from test_sampling_exactness import PROMPT as PROMPT_EXACT
from test_sampling_exactness import SAMPLING, chi_squared_pvalue, exact_distribution, sample_counts
from test_sampling_exactness import VOCAB as VOCAB_EXACT
from tiny_models import tiny_llama, tiny_qwen3_5, tiny_qwen3_next

from mlxspec.drafters import DraftModelDrafter, LookupFirstDrafter
from mlxspec.engine import Drafter, SpecStats, Verdict, speculative_tokens
from mlxspec.backends.mlx.target import MLXTarget, cache_offset
from mlxspec.sampling import SamplingConfig

VOCAB = 40
GREEDY = SamplingConfig()
HYBRID_DRAFTS = [tiny_qwen3_next, tiny_qwen3_5]
STAT_FIELDS = ("target_passes", "drafted", "accepted", "generated", "drafted_per_position",
               "accepted_per_position")


def cache_arrays(cache) -> list:
    """Every array a cache's layers hold: keys and values up to their offset, recurrent states."""
    arrays = []
    for c in cache:
        if hasattr(c, "offset"):
            arrays += [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]
        else:
            arrays += list(c.cache)
    return arrays


def assert_same_caches(ours, theirs) -> None:
    assert cache_offset(ours) == cache_offset(theirs)
    for a, b in zip(cache_arrays(ours), cache_arrays(theirs), strict=True):
        assert a.shape == b.shape and mx.allclose(a, b, atol=1e-4).item()


class CheckedDrafter(DraftModelDrafter):
    """A draft-model drafter that, after every rewind, compares its caches with caches built from
    scratch on the tokens it holds, and counts the rewinds that put recurrent states back."""

    def __init__(self, model):
        super().__init__(model)
        self.rollbacks = 0

    def _rewind_to(self, tokens):
        held = len(self._seen)
        keep = super()._rewind_to(tokens)
        self.rollbacks += 0 < keep < held
        if keep:
            scratch = make_prompt_cache(self.model)
            self.model(mx.array(self._seen)[None], cache=scratch)
            assert_same_caches(self.cache, scratch)
        return keep


class PlantedDraftModel:
    """The target's own weights as a draft model (with a cache of its own), its prediction made
    wrong at every token index t with (t - prompt length) % (j + 1) == j: each step then drafts j
    right tokens and a wrong one (all K right for j >= K), as test_rollback_property's
    PlantedDrafter, but through a draft model whose caches must roll back for its next drafts
    to be right."""

    def __init__(self, model, prompt_length: int, j: int):
        self.model, self.prompt_length, self.j = model, prompt_length, j

    def make_cache(self):
        return make_prompt_cache(self.model)

    def __call__(self, inputs, cache):
        logits = self.model(inputs, cache=cache)
        predicted = cache_offset(cache)  # the index of the token the last position predicts
        if (predicted - self.prompt_length) % (self.j + 1) == self.j:
            logits = mx.roll(logits, 1, axis=-1)  # its argmax is the next token id: wrong
        return logits


def run(model, drafter, prompt, k, max_tokens=N, sampling=GREEDY):
    stats = SpecStats()
    out = [t for t, _ in speculative_tokens(MLXTarget(model, speculative=True), drafter, prompt,
                                            sampling=sampling, max_tokens=max_tokens,
                                            num_draft=k, stats=stats)]
    return out, stats


@pytest.mark.parametrize("build", HYBRID_DRAFTS)
@pytest.mark.parametrize("prompt", [[1, 2, 3, 4, 5, 1, 2, 3], [3]])
def test_drafts_rejected_at_every_position_roll_the_draft_model_back(build, prompt):
    """A hybrid target drafted for by a hybrid draft model with its weights, made wrong at draft
    position j, for every j: the output is plain greedy decoding, and every step keeps exactly j
    drafts, which holds only if the draft model's states were rolled back to the last kept
    token (a state left after a rejected draft would draft something else)."""
    model = build(vocab=VOCAB, seed=3)
    reference = mlx_reference(model, prompt, lambda: make_prompt_cache(model))
    for k in KS:
        for j in range(k + 1):
            drafter = CheckedDrafter(PlantedDraftModel(model, len(prompt), j))
            out, stats = run(model, drafter, prompt, k)
            assert out == reference, (k, j)
            want = expected_stats(len(prompt), k, j, None)
            for field in STAT_FIELDS:
                assert getattr(stats, field) == getattr(want, field), (k, j, field)
            if j < k - 1:  # drafts fed to the draft model were rejected
                assert drafter.rollbacks > 0, (k, j)


@pytest.mark.parametrize("draft_build", HYBRID_DRAFTS)
@pytest.mark.parametrize("target_build", [tiny_llama, tiny_qwen3_next, tiny_qwen3_5])
def test_greedy_identity_with_a_hybrid_draft_model(target_build, draft_build):
    """A hybrid draft model of other random weights, for a plain and for hybrid targets of the
    same vocabulary, alone and behind prompt lookup (draft+lookup: the model drafts some steps
    only, and rolls back to a length several steps old): most drafts are rejected, the output
    is plain decoding's."""
    target = target_build(vocab=VOCAB, seed=1)
    model_drafter = CheckedDrafter(draft_build(vocab=VOCAB, seed=2))
    for drafter in (model_drafter, LookupFirstDrafter(model_drafter)):
        for prompt in ([1, 2, 3, 4, 5, 1, 2, 3], [7, 7, 7]):
            plain = mlx_reference(target, prompt, lambda: make_prompt_cache(target))
            out, stats = run(target, drafter, prompt, k=4)
            assert out == plain
            assert stats.accepted < stats.drafted
    assert model_drafter.rollbacks > 0


@pytest.mark.parametrize("build", HYBRID_DRAFTS)
def test_a_hybrid_draft_model_with_the_targets_weights_is_always_accepted(build):
    model = build(vocab=VOCAB, seed=4)
    k = 4
    out, stats = run(model, DraftModelDrafter(model), [1, 2, 3], k=k, max_tokens=20)
    assert out == run(model, Drafter(), [1, 2, 3], k=k, max_tokens=20)[0]
    assert stats.acceptance_per_position == [1.0] * k
    assert stats.tau == k + 1


def test_a_rewind_between_recorded_lengths_feeds_again_from_the_step_start():
    """Asked to continue tokens that share less with what the cache holds than any length whose
    states it recorded during drafting (not the loop's pattern: a caller's own), the draft model
    goes back to the states from before that step's feed, or to an empty cache, and feeds the
    rest again; its caches then equal a fresh prefill's."""
    drafter = CheckedDrafter(tiny_qwen3_5(vocab=VOCAB, seed=5))
    prompt = [1, 2, 3, 4, 5]
    drafter.begin(prompt)
    first = drafter.propose(prompt, 3, GREEDY).tokens.tolist()
    tokens = prompt + first + [9]
    drafter.commit(tokens, Verdict(first, accepted=3, next_token=9))
    second = drafter.propose(tokens, 3, GREEDY).tokens.tolist()  # fed from length 7 on
    drafter.commit(tokens + second + [9], Verdict(second, accepted=3, next_token=9))
    assert drafter._rewind_to(tokens[:8] + [11]) == 7  # the second step's start
    assert drafter._rewind_to(prompt[:3] + [11]) == 0  # before every recorded length: afresh


@pytest.mark.slow  # χ²: thousands of sampled generations
def test_sampled_output_with_a_hybrid_draft_model_follows_the_targets_distribution():
    """A hybrid draft model (sharpened, so that its drafts are accepted often but not always)
    for test_sampling_exactness's target: the samples follow the target's distribution exactly.
    (The target's side of a hybrid pair is that module's hybrid test; a llama target keeps this
    one cheap.)"""
    target = tiny_llama(vocab=VOCAB_EXACT, seed=11, sharpness=2.5)
    draft_model = tiny_qwen3_next(vocab=VOCAB_EXACT, seed=15, num_hidden_layers=2)
    draft_model.lm_head.weight = draft_model.lm_head.weight * 2
    drafter = DraftModelDrafter(draft_model)
    probs = exact_distribution(target, SAMPLING)
    mx.random.seed(0)
    _, stats = run(target, drafter, PROMPT_EXACT, k=3, max_tokens=40, sampling=SAMPLING)
    assert 0 < stats.accepted < stats.drafted  # drafts both accepted and rejected
    pvalue = chi_squared_pvalue(sample_counts(target, drafter, SAMPLING), probs)
    assert pvalue > 0.001, f"p = {pvalue:.2g}"


def save_model_dir(model, config: dict, out, tokenizer_dir):
    """A model directory as mlxspec loads it: config.json, safetensors, the tokenizer's files."""
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out


def test_cli_hybrid_draft_models_for_a_hybrid_target(hybrid_dir, tmp_path):  # noqa: F811
    """`mlxspec generate --drafter draft --draft-model DIR` with a Qwen3.5 draft model of random
    weights (drafts rejected) and with the Qwen3-Next target's own checkpoint (drafts accepted):
    the output is plain decoding's."""
    qwen3_5 = tiny_qwen3_5(vocab=49152, seed=6)
    random_draft = save_model_dir(qwen3_5, vars(qwen3_5.args), tmp_path / "qwen3_5", hybrid_dir)
    plain = generate("--model", str(hybrid_dir), "-p", TEXT_PROMPT)
    for draft_dir, accepting in ((random_draft, False), (hybrid_dir, True)):
        spec = generate("--model", str(hybrid_dir), "-p", TEXT_PROMPT, "--drafter", "draft",
                        "--draft-model", str(draft_dir), "--fixed-k", "--verbose")
        assert spec.stdout == plain.stdout
        drafted = int(re.search(r"drafted: (\d+)", spec.stderr)[1])
        accepted = int(re.search(r"accepted: (\d+)", spec.stderr)[1])
        assert drafted > 0 and (accepted > 0 if accepting else accepted < drafted), spec.stderr


@pytest.mark.reference
def test_cli_a_qwen3_5_checkpoint_in_the_published_layout_drafts(tmp_path):
    """The same with both checkpoints as transformers writes them (Qwen3.5 with its vision tower,
    `model.language_model.*`, unsanitized convolutions), read directly by --model and
    --draft-model: a Qwen3-Next target drafted for by a Qwen3.5."""
    pytest.importorskip("torch", reason="transformers writes the checkpoints")
    pytest.importorskip("transformers", reason="transformers writes the checkpoints")
    import torch
    from test_convert_hf import _save_tokenizer
    from test_convert_hybrid import _qwen3_5, _qwen3_next, _randomize

    paths = {}
    for name, build in (("qwen3_next", lambda: _qwen3_next(experts=0)), ("qwen3_5", _qwen3_5)):
        torch.manual_seed(0)
        paths[name] = tmp_path / name
        model = build()
        _randomize(model, seed=len(paths))  # far from uniform: text that varies
        model.save_pretrained(str(paths[name]))
        _save_tokenizer(paths[name])
    target = ("--model", str(paths["qwen3_next"]), "-p", "the cat the cat in the hat the cat")
    plain = generate(*target)
    spec = generate(*target, "--drafter", "draft", "--draft-model", str(paths["qwen3_5"]),
                    "--fixed-k", "--verbose")
    assert spec.stdout == plain.stdout
    assert int(re.search(r"drafted: (\d+)", spec.stderr)[1]) > 0, spec.stderr
