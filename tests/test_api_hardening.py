"""Issue 37, the API and the CLI's generate/chat/bench: thread safety, bounded num_draft, seeds,
undecodable prompts, broken chat templates, prompt caches bound to their model, bench counts and
refusals before any model loads."""

import subprocess
import sys
from pathlib import Path

import pytest

import mlxspec
from test_cli import assert_clean_error, invoke

TESTS = Path(__file__).parent


def tiny_tokenizer(vocab: int):
    """A word-level tokenizer whose words are t0..t{vocab-1}; t{vocab-1} ends a sequence."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return TokenizerWrapper(PreTrainedTokenizerFast(
        tokenizer_object=words, eos_token=f"t{vocab - 1}", unk_token="t0"))


# ------------------------------------------------------------------------------------- threads


def test_threads_share_a_model_with_correct_output_and_a_clean_exit(tmp_path):
    """N threads x M generations on one model, with a drafter that wraps the target's layers for
    each pass: every output equals the single-thread run's and the process exits with 0, several
    times (before the per-model lock: shape errors, "no Stream in current thread", SIGSEGV or
    SIGABRT at exit)."""
    for run in range(3):
        job = subprocess.run(
            [sys.executable, str(TESTS / "threads_job.py"), str(tmp_path / str(run))],
            capture_output=True, text=True, timeout=300)
        assert job.returncode == 0, \
            f"run {run}: exit {job.returncode}\n{job.stdout}{job.stderr[-2000:]}"


def test_a_second_generation_on_the_same_thread_is_refused_not_a_deadlock():
    from tiny_models import tiny_llama

    model, tokenizer = tiny_llama(vocab=12), tiny_tokenizer(12)
    first = mlxspec.stream_generate(model, tokenizer, [1, 2, 3], 8)
    next(first)
    with pytest.raises(RuntimeError, match="still open in this thread"):
        mlxspec.generate(model, tokenizer, [1, 2, 3], 8)
    first.close()  # releases the model: the next generation runs
    assert mlxspec.generate(model, tokenizer, [1, 2, 3], 8) == \
        mlxspec.generate(model, tokenizer, [1, 2, 3], 8)


def test_an_abandoned_generator_releases_its_model():
    from tiny_models import tiny_llama

    model, tokenizer = tiny_llama(vocab=12), tiny_tokenizer(12)
    first = mlxspec.stream_generate(model, tokenizer, [1, 2, 3], 8)
    next(first)
    del first  # garbage collected: its finally releases the lock
    assert mlxspec.generate(model, tokenizer, [1, 2, 3], 4) is not None


# ----------------------------------------------------------------------------------- num_draft


def test_num_draft_is_capped_by_the_drafters_maximum():
    """-k 100000000 with lookup once took 175 s and 1.5 GB: now every drafter has a finite
    maximum, and num_draft means at most that many."""
    from tiny_models import tiny_llama

    from mlxspec.drafters.lookup import PromptLookupDrafter
    from mlxspec.engine import Drafter, draft_limit

    model, tokenizer = tiny_llama(vocab=12), tiny_tokenizer(12)
    *_, last = mlxspec.stream_generate(model, tokenizer, [1, 2, 3, 1, 2, 3], 8, drafter="lookup",
                                       num_draft=10**8)
    assert last.num_draft == PromptLookupDrafter.max_draft == 64

    class Unbounded(Drafter):
        max_draft = None  # a drafter of someone else's that sets none gets the default

    assert draft_limit(Unbounded(), 10**8) == Drafter.max_draft == 32


def test_tree_budget_has_a_maximum():
    from mlxspec.tree import MAX_TREE_BUDGET, check_tree

    assert check_tree(MAX_TREE_BUDGET, 4) == (MAX_TREE_BUDGET, 4)
    with pytest.raises(ValueError, match="at most"):
        check_tree(10**8, 4)
    result = invoke("generate", "-p", "hi", "--drafter", "dflash", "--tree-budget", "100000000")
    assert result.exit_code == 2 and "--tree-budget" in result.output, result.output


# --------------------------------------------------------------------------------------- seeds


@pytest.mark.parametrize("seed", [-1, 2**64, 99999999999999999999])
def test_seed_out_of_range_refused(seed):
    from mlxspec.sampling import SamplingConfig

    with pytest.raises(ValueError, match="seed"):
        SamplingConfig(seed=seed)
    result = invoke("generate", "-p", "hi", "--seed", str(seed))
    assert result.exit_code == 2 and "--seed" in result.output and "Traceback" not in result.output


def test_largest_seed_accepted():
    from mlxspec.sampling import MAX_SEED, SamplingConfig

    assert SamplingConfig(seed=MAX_SEED).seed == MAX_SEED


# ------------------------------------------------------------------- CLI on a tiny model dir


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm_dir):
    from test_cli import tiny_llama

    return tiny_llama(tmp_path_factory.mktemp("tiny") / "model", smollm_dir, 49152)


def test_undecodable_prompt_refused_in_one_line(tiny_dir):
    assert_clean_error(invoke("generate", "-m", str(tiny_dir), "-p", "-", input=b"caf\xe9 ok\n"),
                   "UTF-8", "0xe9")
    assert_clean_error(invoke("generate", "-m", str(tiny_dir), "-p", "caf\udce9"), "UTF-8", "0xe9")


def test_chat_refuses_an_undecodable_line_and_goes_on(tiny_dir):
    result = invoke("chat", "-m", str(tiny_dir), "-n", "3",
                    input=b"hello\n\xff\xfe\nagain\n/quit\n")
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    assert result.stderr.count("Error: the line is not valid UTF-8") == 1, result.stderr
    assert len([x for x in result.stderr.splitlines() if x.startswith("[3 tokens")]) == 2


@pytest.fixture
def broken_template_dir(tiny_dir, tmp_path):
    import shutil

    folder = tmp_path / "broken"
    shutil.copytree(tiny_dir, folder)
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] / 0 }}")
    return folder


def test_a_template_that_fails_to_render_is_one_line(broken_template_dir):
    assert_clean_error(invoke("generate", "-m", str(broken_template_dir), "-p", "hi", "-n", "2"),
                   "chat_template.jinja", "--no-chat-template")
    chat = invoke("chat", "-m", str(broken_template_dir), "-n", "2", input="hi\n/quit\n")
    assert chat.exit_code == 0 and "Traceback" not in chat.output, chat.output
    assert "chat_template.jinja failed to render" in chat.stderr


# --------------------------------------------------------------------------------- prompt cache


def test_prompt_cache_refuses_another_model_and_stays_intact():
    from tiny_models import tiny_llama

    a, b, tokenizer = tiny_llama(vocab=12, seed=1), tiny_llama(vocab=12, seed=2), tiny_tokenizer(12)
    cache = mlxspec.PromptCache()
    prompt = [1, 2, 3, 4, 5]
    first = mlxspec.generate(a, tokenizer, prompt, 6, prompt_cache=cache)
    held = list(cache.tokens)
    with pytest.raises(ValueError, match="another model"):
        mlxspec.generate(b, tokenizer, prompt, 6, prompt_cache=cache)
    assert cache.tokens == held
    assert mlxspec.generate(a, tokenizer, prompt, 6, prompt_cache=cache) == first


# --------------------------------------------------------------------------------------- bench


@pytest.mark.parametrize("flag", ["--limit", "--max-tokens", "--num-draft", "--mlx-lm-num-draft",
                                  "--llama-cpp-num-draft"])
@pytest.mark.parametrize("value", ["0", "-1"])
def test_bench_counts_must_be_positive(flag, value, monkeypatch):
    monkeypatch.setattr(mlxspec, "load", lambda *a, **k: pytest.fail("loaded a model"))
    result = invoke("bench", flag, value)
    assert result.exit_code == 2 and flag in result.output, result.output


def test_run_benchmark_refuses_a_count_below_one():
    from mlxspec.bench import run_benchmark

    with pytest.raises(ValueError, match="limit must be >= 1"):
        run_benchmark(None, None, drafters={}, suites=["copy"], temps=[0.0], max_tokens=8,
                      limit=0)


# ---------------------------------------------------------------------- refused before loading


@pytest.mark.parametrize("args, flag", [
    (["--drafter", "layerskip", "--exit-layer", "30"], "--exit-layer"),
    (["--drafter", "dflash", "--block-size", "999"], "--block-size"),
])
def test_refused_before_the_model_loads(smollm_dir, monkeypatch, args, flag):
    """The default model's config.json (converted once) and the shipped DFlash checkpoint's
    say what fits, before any weight loads."""
    monkeypatch.setattr(mlxspec, "load", lambda *a, **k: pytest.fail("loaded a model"))
    result = invoke("generate", "-p", "hi", *args)
    assert result.exit_code == 2 and flag in result.output, result.output


def test_api_refuses_an_undecodable_prompt_naming_the_byte():
    from tiny_models import tiny_llama

    with pytest.raises(ValueError, match="not valid UTF-8 text.*0xff"):
        mlxspec.generate(tiny_llama(vocab=12), tiny_tokenizer(12), "t1 t2\udcff", 4)
