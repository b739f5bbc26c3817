"""Requests the API refuses before any compute, with a message that names the problem.

A tiny random target with SmolLM2's vocabulary size and tokenizer, so ids just past the vocabulary
are the real model's; the torch twin of these checks is in test_torch_backend.
"""

import math
import os
import subprocess
import sys

import mlx.core as mx
import pytest
from mlx_lm.models import llama

import mlxspec
from mlxspec.generate import format_stats
from mlxspec.backends.mlx.target import MLXTarget
from mlxspec.sampling import SamplingConfig

VOCAB = 49152


@pytest.fixture(scope="module")
def tiny(smollm_dir):
    from mlx_lm.utils import load_tokenizer

    mx.random.seed(0)
    args = llama.ModelArgs(model_type="llama", hidden_size=16, num_hidden_layers=1,
                           intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                           rms_norm_eps=1e-5, vocab_size=VOCAB, max_position_embeddings=512,
                           tie_word_embeddings=True)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model, load_tokenizer(smollm_dir)


@pytest.fixture
def no_compute(monkeypatch):
    """Any forward pass of a target fails the test: refusals must come first."""
    def refuse(*args, **kwargs):
        raise AssertionError("the target ran before the request was checked")

    monkeypatch.setattr(MLXTarget, "_forward", refuse)


@pytest.mark.parametrize("bad_id", [999999, -1, VOCAB])
def test_out_of_vocabulary_ids_refused(tiny, no_compute, bad_id):
    model, tokenizer = tiny
    with pytest.raises(ValueError, match=f"token id {bad_id} is outside the model's vocabulary "
                                         f"of {VOCAB} tokens"):
        mlxspec.generate(model, tokenizer, [1, bad_id], max_tokens=4)


def test_largest_id_accepted(tiny):
    model, tokenizer = tiny
    last = list(mlxspec.stream_generate(model, tokenizer, [1, VOCAB - 1], 2))[-1]
    assert last.generation_tokens == 2


OUT_OF_VOCAB = r"""
import sys
import mlx.core as mx
import mlxspec
from mlx_lm.models import llama
from mlx_lm.utils import load_tokenizer
args = llama.ModelArgs(model_type="llama", hidden_size=16, num_hidden_layers=1,
                       intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                       rms_norm_eps=1e-5, vocab_size=49152, max_position_embeddings=512)
try:
    mlxspec.generate(llama.Model(args), load_tokenizer(sys.argv[1]), [1, 999999], max_tokens=4)
except ValueError as err:
    print("REFUSED", err)
"""


def test_far_out_of_vocabulary_id_does_not_kill_the_process(smollm_dir):
    """999999 used to read past the embedding table and end the process with SIGSEGV."""
    out = subprocess.run([sys.executable, "-c", OUT_OF_VOCAB, str(smollm_dir)],
                         capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert "REFUSED prompt token id 999999" in out.stdout


@pytest.mark.parametrize("prompt, words", [
    ([1, 2.0], "prompt token ids must be integers, got 2.0"),
    ([1, "2"], "prompt token ids must be integers, got '2'"),
    ([1, True], "prompt token ids must be integers, got True"),
])
def test_non_integer_ids_refused(tiny, no_compute, prompt, words):
    model, tokenizer = tiny
    with pytest.raises(TypeError, match=words):
        mlxspec.generate(model, tokenizer, prompt, max_tokens=4)


@pytest.mark.parametrize("options, error, words", [
    ({"max_tokens": 3.0}, TypeError, "max_tokens must be an integer, got 3.0"),
    ({"max_tokens": "8"}, TypeError, "max_tokens must be an integer, got '8'"),
    ({"max_tokens": 0}, ValueError, "max_tokens must be >= 1, got 0"),
    ({"num_draft": 2.5, "drafter": "lookup"}, TypeError, "num_draft must be an integer"),
    ({"num_draft": 0, "drafter": "lookup"}, ValueError, "num_draft must be >= 1"),
    ({"temp": math.nan}, ValueError, "temp must be a finite number, got nan"),
    ({"temp": math.inf, "top_p": 0.9}, ValueError, "temp must be a finite number, got inf"),
    ({"temp": 1.0, "top_p": math.nan}, ValueError, "top_p must be a finite number"),
    ({"temp": 1.0, "min_p": math.inf}, ValueError, "min_p must be a finite number"),
    ({"temp": -1.0}, ValueError, "temp must be >= 0"),
    ({"temp": 1.0, "top_k": 2.5}, TypeError, "top_k must be an integer"),
    ({"seed": 1.5}, TypeError, "seed must be an integer"),
])
def test_bad_options_refused(tiny, no_compute, options, error, words):
    model, tokenizer = tiny
    options = {"max_tokens": 4, **options}
    with pytest.raises(error, match=words):
        mlxspec.generate(model, tokenizer, [1, 2, 3], **options)


def test_numpy_numbers_accepted():
    np = pytest.importorskip("numpy")
    config = SamplingConfig(temp=np.float32(0.5), top_k=np.int64(3), seed=np.int64(1))
    assert config.top_k == 3 and not config.greedy


def test_effective_drafts_per_step_reported(tiny, tmp_path):
    """--num-draft 1000 with a 4-token DFlash block drafts at most 3 a step, and says so."""
    from test_dflash import drafter_config, random_weights, save_drafter

    model, tokenizer = tiny
    config = drafter_config(vocab=VOCAB, hidden=16, target_layers=1, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                            intermediate_size=32, block_size=4, layer_types=["full_attention"],
                            mask_token_id=0, target_layer_ids=[0])
    path = save_drafter(tmp_path, config, random_weights(config))
    drafter = mlxspec.load_drafter("dflash", path, model=model, tokenizer=tokenizer)
    last = list(mlxspec.stream_generate(model, tokenizer, [1, 2, 3], 6, drafter=drafter,
                                        num_draft=1000, adaptive=False))[-1]
    assert last.num_draft == 3
    assert max(len(last.drafted_per_position), 1) <= 3
    assert "up to 3 drafts per step" in format_stats(last)
    plain = list(mlxspec.stream_generate(model, tokenizer, [1, 2, 3], 2))[-1]
    assert plain.num_draft == 0


def test_an_adaptive_k_may_draft_past_the_fixed_default(tiny):
    """A draft model's fixed default is 4 drafts a step; an adaptive K with no num_draft may try
    up to 12 (its best K can be 8: the Qwen2.5-Coder pair), and an asked num_draft is kept."""
    from mlxspec.drafters import DraftModelDrafter, LookupFirstDrafter
    from mlxspec.engine import requested_drafts

    model, tokenizer = tiny
    drafter = DraftModelDrafter(model)
    assert requested_drafts(drafter, None, adaptive=False) == 4
    assert requested_drafts(drafter, None, adaptive=True) == 12
    assert requested_drafts(drafter, 6, adaptive=True) == 6
    assert requested_drafts(LookupFirstDrafter(drafter), None, adaptive=True) == 12
    runs = {adaptive: list(mlxspec.stream_generate(model, tokenizer, [1, 2, 3], 4,
                                                   drafter=DraftModelDrafter(model),
                                                   adaptive=adaptive))[-1]
            for adaptive in (False, True)}
    assert (runs[False].num_draft, runs[True].num_draft) == (4, 12)


class NoTokenising:
    """A tokenizer whose vocabulary may be read but which must not render or tokenise."""

    def __init__(self, inner):
        self.inner = inner

    def get_vocab(self):
        return self.inner.get_vocab()

    def __getattr__(self, name):
        raise AssertionError(f"the request was tokenised ({name}) before it was refused")


@pytest.mark.parametrize("chat", [True, False])
def test_text_surely_over_the_window_is_refused_before_tokenising(tiny, chat):
    """A 3.8 MB message took seconds of CPU to tokenise before its length was refused."""
    from mlxspec.server.requests import APIError, parse_request

    _, tokenizer = tiny
    text = "a" * 2_000_000  # >= 2e6 / (longest token's bytes) tokens: over 8192 for SmolLM2's
    body = {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}
    with pytest.raises(APIError) as refused:
        parse_request(body, chat=chat, tokenizer=NoTokenising(tokenizer), context_length=8192,
                      drafters=("none",))
    assert refused.value.code == "context_length_exceeded"
    assert refused.value.param == ("messages" if chat else "prompt")


def test_a_request_may_fix_its_k(tiny):
    """The server's `adaptive` field: false drafts num_draft every step (a fixed K, so a
    request's passes depend on its drafts alone), true or left out keeps the adaptive K."""
    from mlxspec.server.requests import parse_request

    _, tokenizer = tiny

    def adaptive(**extra):
        body = {"prompt": "hi", "max_tokens": 2, "num_draft": 3, **extra}
        return parse_request(body, chat=False, tokenizer=tokenizer, context_length=8192,
                             drafters=("none",)).generation.adaptive

    assert adaptive() is True and adaptive(adaptive=True) is True
    assert adaptive(adaptive=False) is False
