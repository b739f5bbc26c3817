"""Our MLX path against an independent reference: transformers reading the SAME GGUF file in torch.

Both sides dequantize the Q4_1 weights to fp32, so the logits agree to ~1e-4 (measured: max abs
diff 9.4e-5, mean 1.0e-5, over all 166 positions of a HumanEval prompt, logits up to 47 in
magnitude; the test allows 1e-3) and greedy decoding must give the same tokens. The torch side
is a hand-written greedy loop over the model's forward (no generation config, no sampling
processors), so nothing of ours is shared with it except the token ids it is fed.
"""

import inspect
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the reference needs torch (pip install .[reference])")
transformers = pytest.importorskip(
    "transformers", reason="the reference needs transformers (pip install .[reference])"
)
pytest.importorskip("gguf", reason="transformers reads GGUF through the gguf package")

import mlx.core as mx  # noqa: E402

import mlxspec  # noqa: E402
from mlxspec.generate import encode_prompt  # noqa: E402
from mlxspec.loading import default_gguf_path  # noqa: E402
from mlxspec.prompts import humaneval_prompts, mtbench_prompts  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.reference]

MAX_TOKENS = 64
N_EACH = 3  # prompts from each set (5 took a minute of CI for little more)
# Measured max |logit diff| ~1e-4; 1e-3 leaves a 10x margin and still catches any real bug
# (a wrong rope, a missing norm or a mis-dequantized block moves logits by >> 0.1).
LOGIT_ATOL = 1e-3
SHORT = "What is the capital of France? Answer in one short sentence."


@pytest.fixture(scope="module")
def torch_model():
    # One intra-op thread: batch-1 decoding of a 135M model gains nothing from a second one, and on
    # a busy 2-core machine two OpenMP threads stall each other (measured under load: 0.07 s per
    # decode step with 1 thread, 0.3-0.5 s with 2).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    gguf = default_gguf_path()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
    except ImportError as err:  # e.g. accelerate missing
        torch.set_num_threads(threads)
        pytest.skip(f"transformers cannot load the GGUF here: {err}")
    yield model.eval()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def prompt_ids(smollm):
    _, tokenizer = smollm
    # Plus one short question, so that at least one reply ends on EOS within MAX_TOKENS.
    texts = mtbench_prompts(limit=N_EACH) + humaneval_prompts(limit=N_EACH) + [SHORT]
    return [
        encode_prompt(
            tokenizer,
            tokenizer.apply_chat_template(
                [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False
            ),
        )
        for t in texts
    ]


def torch_logits(model, ids):
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def mlx_logits(model, ids):
    return np.array(model(mx.array([ids])).astype(mx.float32))[0]


def torch_greedy(model, ids, max_tokens, eos):
    """Plain greedy loop with the model's own KV cache; returns tokens (stopping after the first
    EOS) and the logits each token was chosen from."""
    # transformers 5.2x renamed past_key_values to cache (argument and output field).
    params = inspect.signature(model.forward).parameters
    cache_arg = "cache" if "cache" in params else "past_key_values"
    tokens, step_logits = [], []
    with torch.inference_mode():
        out = model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
        for _ in range(max_tokens):
            logits = out.logits[0, -1].float()
            token = int(torch.argmax(logits))
            tokens.append(token)
            step_logits.append(logits.numpy().copy())
            if token in eos:
                break
            cache = getattr(out, cache_arg)
            out = model(torch.tensor([[token]]), use_cache=True, **{cache_arg: cache})
    return tokens, step_logits


def mlx_greedy(model, tokenizer, ids, max_tokens):
    """Our path; the last response carries the EOS token when generation stopped on one."""
    return [r.token for r in mlxspec.stream_generate(model, tokenizer, ids, max_tokens)]


def top2_margin(logits):
    top = np.sort(logits)[-2:]
    return float(top[1] - top[0])


def test_forward_logits_match_reference(smollm, torch_model, prompt_ids):
    model, _ = smollm
    # The longest prompt (a HumanEval stub): every position's logits, not just the last one.
    ids = max(prompt_ids, key=len)
    ours, ref = mlx_logits(model, ids), torch_logits(torch_model, ids)
    assert ours.shape == ref.shape == (len(ids), model.args.vocab_size)
    diff = np.abs(ours - ref)
    print(f"\n{len(ids)} positions: max |logit diff| {diff.max():.2e}, mean {diff.mean():.2e}, "
          f"max |logit| {np.abs(ref).max():.1f}")
    assert diff.max() < LOGIT_ATOL, f"max |logit diff| {diff.max():.3e} >= {LOGIT_ATOL}"
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


@pytest.fixture(scope="module")
def ours(smollm, prompt_ids):
    """Our greedy continuations, up to and including the first EOS."""
    model, tokenizer = smollm
    start = time.perf_counter()
    outputs = [mlx_greedy(model, tokenizer, ids, MAX_TOKENS) for ids in prompt_ids]
    print(f"\nMLX: {sum(map(len, outputs))} tokens in {time.perf_counter() - start:.1f} s")
    return outputs


def first_divergence(i, ours, ref_rows, model, ids):
    """Compare our tokens with the reference's argmax rows (row j predicts token j).

    Returns (tokens that agree, None) or (position, reason). A genuine near-tie (the two candidates
    within the logit tolerance of each other in the reference) is reported as such.
    """
    for j, token in enumerate(ours):
        ref_token = int(np.argmax(ref_rows[j]))
        if ref_token != token:
            margin = top2_margin(ref_rows[j])
            our_margin = top2_margin(mlx_logits(model, ids + ours[:j])[-1])
            tie = margin < LOGIT_ATOL and token in np.argsort(ref_rows[j])[-2:]
            return j, (f"prompt {i}: token {j} differs (ours {token}, reference {ref_token}); "
                       f"top-2 margin: reference {margin:.2e}, ours {our_margin:.2e}"
                       + (" [near-tie]" if tie else ""))
    return len(ours), None


def test_greedy_tokens_match_reference(smollm, torch_model, prompt_ids, ours):
    """Teacher-forced: one torch pass over prompt + our continuation gives the reference's greedy
    choice at every step. All of them equal to our tokens (and EOS, if any, only at the end) is
    exactly "torch's own greedy decoding produces our sequence", at one pass per prompt."""
    model, tokenizer = smollm
    eos = set(tokenizer.eos_token_ids)
    compared, ended_on_eos, ties, failures = 0, 0, [], []
    start = time.perf_counter()
    for i, (ids, tokens) in enumerate(zip(prompt_ids, ours)):
        assert all(t not in eos for t in tokens[:-1]), f"prompt {i}: generation went past an EOS"
        assert tokens[-1] in eos or len(tokens) == MAX_TOKENS, f"prompt {i}: stopped early"
        with torch.inference_mode():
            rows = torch_model(torch.tensor([ids + tokens[:-1]]), logits_to_keep=len(tokens))
        rows = rows.logits[0].float().numpy()
        agree, problem = first_divergence(i, tokens, rows, model, ids)
        compared += agree
        ended_on_eos += problem is None and tokens[-1] in eos
        if problem:
            (ties if problem.endswith("[near-tie]") else failures).append(problem)
    print(f"\n{compared} greedy tokens identical over {len(prompt_ids)} prompts, "
          f"{ended_on_eos} ended on EOS; near-ties: {ties}; "
          f"torch {time.perf_counter() - start:.1f} s")
    assert not failures, "\n".join(failures)
    assert ended_on_eos >= 1, "no reply reached EOS: the EOS comparison went untested"
    assert len(ties) <= 1, f"too many near-ties to be chance: {ties}"
    assert compared >= len(prompt_ids) * MAX_TOKENS // 2, "too few tokens compared to prove much"


@pytest.mark.parametrize("which", [0, -1], ids=["mtbench", "short-eos"])
def test_torch_free_running_greedy_matches(smollm, torch_model, prompt_ids, ours, which):
    """The reference decoding on its own (its KV cache, token by token) gives our tokens too."""
    model, tokenizer = smollm
    ids = prompt_ids[which]
    ref, ref_logits = torch_greedy(torch_model, ids, MAX_TOKENS, set(tokenizer.eos_token_ids))
    if ref != ours[which]:
        agree, problem = first_divergence(which, ours[which], ref_logits, model, ids)
        pytest.fail(problem or f"lengths differ: ours {len(ours[which])}, reference {len(ref)}")
