"""What a checkpoint directory may make mlxspec do: never run its code, never build a model its
config makes up, never leave a conversion's scratch behind; and each refusal is one line naming
the file and the field, from the CLI and the API alike."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli import api_error, assert_clean_error, invoke, ok, tiny_llama

import mlxspec
from mlxspec.converters import convert
from mlxspec.converters.atomic import atomic_output_dir, temp_dir_in

FIX = "fix the config or use the checkpoint it belongs to"


@pytest.fixture(scope="module")
def target(smollm_dir, tmp_path_factory):
    """A 1-layer random llama (hidden 64, 2 heads) with SmolLM2's tokenizer files."""
    return tiny_llama(tmp_path_factory.mktemp("target") / "target", smollm_dir, vocab_size=49152)


def copy(src: Path, dst: Path, config_change=None) -> Path:
    """A copy of checkpoint `src`, its config.json changed in place by `config_change`."""
    shutil.copytree(src, dst)
    if config_change is not None:
        config = json.loads((dst / "config.json").read_text())
        config_change(config)
        (dst / "config.json").write_text(json.dumps(config))
    return dst


# ---- never run code from a checkpoint -----------------------------------------------------------

PLANTED = """import pathlib
pathlib.Path({marker!r}).write_text("the checkpoint's code ran")
from transformers import PreTrainedTokenizerFast, LlamaConfig, LlamaForCausalLM


class PlantedTokenizer(PreTrainedTokenizerFast):
    pass


class PlantedConfig(LlamaConfig):
    model_type = "planted"


class PlantedModel(LlamaForCausalLM):
    config_class = PlantedConfig
"""


def plant(src: Path, dst: Path, marker: Path, *, tokenizer=True, model_type=None) -> Path:
    """`src` with planted.py, which writes `marker` when imported, wired in through an auto_map:
    the tokenizer's (a class transformers lacks), or config.json's (with `model_type`)."""
    planted = shutil.copytree(src, dst)
    (planted / "planted.py").write_text(PLANTED.format(marker=str(marker)))
    if tokenizer:
        file = planted / "tokenizer_config.json"
        settings = json.loads(file.read_text())
        settings.update(tokenizer_class="PlantedTokenizer",
                        auto_map={"AutoTokenizer": ["planted.PlantedTokenizer", None]})
        file.write_text(json.dumps(settings))
    if model_type is not None:
        file = planted / "config.json"
        settings = json.loads(file.read_text())
        settings.update(model_type=model_type, auto_map={
            "AutoConfig": "planted.PlantedConfig", "AutoModelForCausalLM": "planted.PlantedModel"})
        file.write_text(json.dumps(settings))
    return planted


def test_a_tokenizer_that_needs_its_code_is_refused_and_never_run(target, tmp_path):
    marker = tmp_path / "marker"
    planted = plant(target, tmp_path / "planted", marker)
    needles = (str(planted / "tokenizer_config.json"), "auto_map", "never runs code")
    # A "y" on stdin answered transformers' "run the custom code? [y/N]" prompt.
    chat = assert_clean_error(invoke("chat", "-m", str(planted), input="y\n/quit\n"), *needles)
    assert chat == assert_clean_error(invoke("generate", "-m", str(planted), "-p", "hi"))
    assert chat == api_error(lambda: mlxspec.load(planted), ValueError)
    assert chat == assert_clean_error(invoke("convert", str(planted), "-o", str(tmp_path / "o")))
    assert not (tmp_path / "o").exists()
    assert not marker.exists()


def test_torch_backend_refuses_it_too(target, tmp_path):
    pytest.importorskip("torch")
    marker = tmp_path / "marker"
    planted = plant(target, tmp_path / "planted", marker)
    with pytest.raises(ValueError, match="auto_map"):
        mlxspec.load(planted, backend="torch", device="cpu")
    assert not marker.exists()


def test_a_model_that_needs_its_code_is_refused_naming_config_json(target, tmp_path):
    marker = tmp_path / "marker"
    planted = plant(target, tmp_path / "planted", marker, tokenizer=False, model_type="planted")
    line = assert_clean_error(invoke("generate", "-m", str(planted), "-p", "hi", "-n", "2"),
                              str(planted / "config.json"), "auto_map")
    assert line == api_error(lambda: mlxspec.load(planted), ValueError)
    assert not marker.exists()


def test_convert_writes_no_code_and_an_unused_auto_map_never_runs(target, tmp_path):
    """config.json's auto_map beside an architecture mlx-lm implements (DeepSeek-V3 and
    Nemotron-H ship one) is never followed: the model converts and loads, its code does not
    run, and the output holds no .py."""
    marker = tmp_path / "marker"
    planted = plant(target, tmp_path / "planted", marker, tokenizer=False, model_type="llama")
    out = tmp_path / "out"
    ok(invoke("convert", str(planted), "-o", str(out)))
    assert not list(out.rglob("*.py"))
    mlxspec.load(out)
    mlxspec.load(planted)
    assert not marker.exists()


def test_a_converted_directory_never_holds_code(tmp_path):
    """A tokenizer's save_pretrained copies its custom .py files; the atomic writer drops
    code files before the output appears."""
    with atomic_output_dir(tmp_path / "out") as scratch:
        (scratch / "config.json").write_text("{}")
        (scratch / "tokenization_planted.py").write_text("raise SystemExit")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json"]


# ---- config numbers against the weights -------------------------------------------------------

TARGET_CONFIGS = {
    "layers-beyond-the-weights": ("num_hidden_layers", 1_000_000,
                                  "num_hidden_layers is 1000000, but the weights hold only 1"),
    "negative-layers": ("num_hidden_layers", -3,
                        "num_hidden_layers must be a positive integer, got -3"),
    "no-heads": ("num_attention_heads", 0, "num_attention_heads must be a positive integer, got 0"),
    "nan-rope": ("rope_theta", math.nan, "rope_theta is NaN, not a number"),
    "zero-eps": ("rms_norm_eps", 0, "rms_norm_eps must be a finite positive number, got 0"),
    "infinite-rope": ("rope_theta", math.inf,
                      "rope_theta must be a finite positive number, got inf"),
    "heads-not-a-multiple": ("num_key_value_heads", 3,
                             "num_attention_heads 2 is not a multiple of num_key_value_heads 3"),
    "vocab": ("vocab_size", 100, "vocab_size is 100, but the token embedding has 49152 rows"),
    "hidden": ("hidden_size", 32, "hidden_size is 32, but the token embedding is 64 wide"),
}


@pytest.mark.parametrize("key,value,problem", TARGET_CONFIGS.values(), ids=TARGET_CONFIGS)
def test_target_config_is_checked_against_the_weights(target, tmp_path, key, value, problem):
    bad = copy(target, tmp_path / "bad", lambda c: c.update({key: value}))
    line = assert_clean_error(invoke("generate", "-m", str(bad), "-p", "hi", "-n", "2"))
    assert line == f"Error: {bad / 'config.json'}: {problem}; {FIX}"
    assert line == api_error(lambda: mlxspec.load(bad), ValueError)
    assert line == assert_clean_error(invoke("convert", str(bad), "-o", str(tmp_path / "out")))


def test_nested_text_config_is_checked(target, tmp_path):
    bad = copy(target, tmp_path / "bad",
               lambda c: c.update(rope_parameters={"rope_type": "default", "rope_theta": -1.0}))
    with pytest.raises(ValueError, match=r"rope_parameters\.rope_theta must be a finite positive"):
        mlxspec.load(bad)


@pytest.fixture(scope="module")
def dflash(tmp_path_factory):
    """A random 1-layer DFlash drafter that fits `target`."""
    from test_dflash import drafter_config, random_weights, save_drafter

    config = drafter_config(vocab=49152, hidden=64, target_layers=1, num_hidden_layers=1,
                            layer_types=["full_attention"], target_layer_ids=[0], mask_token_id=0)
    return save_drafter(tmp_path_factory.mktemp("dflash") / "dflash", config,
                        random_weights(config))


DFLASH_CONFIGS = {
    "no-heads": (lambda c: c.update(num_attention_heads=0),
                 "num_attention_heads must be a positive integer, got 0"),
    "layers-beyond-the-weights": (
        lambda c: c.update(num_hidden_layers=1_000_000, layer_types=None),
        "num_hidden_layers is 1000000, but the weights hold only 1"),
    "nan-rope": (lambda c: c.update(rope_theta=math.nan),
                 "rope_theta is NaN, not a number"),
}


@pytest.mark.parametrize("change,problem", DFLASH_CONFIGS.values(), ids=DFLASH_CONFIGS)
def test_dflash_config_is_checked(target, dflash, tmp_path, change, problem):
    bad = copy(dflash, tmp_path / "bad", change)
    line = assert_clean_error(invoke("generate", "-m", str(target), "-p", "hi", "-n", "2",
                                     "--drafter", "dflash", "--drafter-model", str(bad)))
    assert line == f"Error: {bad / 'config.json'}: {problem}; {FIX}"
    model, tokenizer = mlxspec.load(target)
    assert line == api_error(
        lambda: mlxspec.load_drafter("dflash", bad, model=model, tokenizer=tokenizer), ValueError)
    assert line == assert_clean_error(invoke("convert", str(bad), "-o", str(tmp_path / "out")))


EAGLE3_CONFIGS = {
    "no-heads": ("num_attention_heads", 0,
                 "transformer_layer_config.num_attention_heads must be a positive integer, got 0"),
    "nan-eps": ("rms_norm_eps", math.nan,
                "transformer_layer_config.rms_norm_eps is NaN, not a number"),
}


@pytest.mark.parametrize("key,value,problem", EAGLE3_CONFIGS.values(), ids=EAGLE3_CONFIGS)
def test_eagle3_config_is_checked(tmp_path, key, value, problem):
    from test_eagle3 import make_drafter_dir
    from tiny_models import tiny_llama as tiny_model

    model = tiny_model(vocab=12, hidden=32, layers=4)
    drafter = make_drafter_dir(tmp_path / "eagle3", vocab=12, draft_ids=list(range(12)))
    bad = copy(drafter, tmp_path / "bad", lambda c: c["transformer_layer_config"].update(
        {key: value}))
    with pytest.raises(ValueError) as err:
        mlxspec.load_drafter("eagle3", bad, model=model, tokenizer=None)
    assert str(err.value) == f"{bad / 'config.json'}: {problem}; {FIX}"


# ---- Medusa heads --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def medusa(tmp_path_factory):
    from test_medusa import write_heads
    from tiny_models import tiny_llama as tiny_model

    model = tiny_model(vocab=16, hidden=32, layers=2)
    heads = write_heads(tmp_path_factory.mktemp("medusa") / "heads", hidden=32, vocab=16,
                        projection=model.lm_head.weight)
    return model, heads


def test_truncated_medusa_heads_are_called_corrupted(medusa, tmp_path):
    model, heads = medusa
    bad = copy(heads, tmp_path / "bad")
    weights = bad / "medusa_lm_head.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError) as err:
        mlxspec.load_drafter("medusa", bad, model=model, tokenizer=None)
    assert str(err.value).startswith(f"corrupted safetensors file {weights}: ")
    assert str(err.value).endswith("; download or convert it again")


def test_medusa_counts_beyond_the_file_are_refused(medusa, tmp_path):
    model, heads = medusa
    bad = copy(heads, tmp_path / "bad", lambda c: c.update(medusa_num_heads=10**9))
    with pytest.raises(ValueError) as err:
        mlxspec.load_drafter("medusa", bad, model=model, tokenizer=None)
    assert str(err.value) == (f"{bad / 'config.json'}: medusa_num_heads is 1000000000, but "
                              f"{bad / 'medusa_lm_head.safetensors'} holds 3; {FIX}")


# ---- tokenizer files --------------------------------------------------------------------------

TOKENIZER_FILES = {
    "bad-tokenizer-config": (
        "tokenizer_config.json", '{"tokenizer_class": "PreTrainedTokenizerFast",}',
        " is not valid JSON (line 1 column 47: Expecting property name enclosed in double quotes)"
        ": fix or replace the file"),
    "truncated-tokenizer-json": (
        "tokenizer.json", None, " is not valid JSON (line "),
    "broken-chat-template": (
        "chat_template.jinja", "{% for message in %}{{ message }}{% endfor %}",
        ": the chat template does not parse (line 1: Expected an expression, got 'end of "
        "statement block'): fix or replace the file"),
}


@pytest.mark.parametrize("name,text,problem", TOKENIZER_FILES.values(), ids=TOKENIZER_FILES)
def test_tokenizer_file_errors_name_the_file(target, tmp_path, name, text, problem):
    bad = copy(target, tmp_path / "bad")
    if text is None:  # cut off mid-file, as an interrupted download leaves it
        text = (target / name).read_text()[:1000]
    (bad / name).write_text(text)
    line = assert_clean_error(invoke("generate", "-m", str(bad), "-p", "hi", "-n", "2"))
    assert line.startswith(f"Error: {bad / name}{problem}")
    assert line == api_error(lambda: mlxspec.load(bad), ValueError)


# ---- convert's quantization options ------------------------------------------------------------

QUANTIZATION = {
    "bits-7": (["--q-bits", "7"], dict(q_bits=7),
               "q_bits (--q-bits) must be one of 1, 2, 3, 4, 5, 6, 8 (MLX affine quantization), "
               "got 7"),
    "group-0": (["--q-group-size", "0"], dict(q_group_size=0),
                "q_group_size (--q-group-size) must be one of 32, 64, 128 (MLX affine "
                "quantization), got 0"),
    "group-16": (["--q-group-size", "16"], dict(q_group_size=16),
                 "q_group_size (--q-group-size) must be one of 32, 64, 128 (MLX affine "
                 "quantization), got 16"),
}


@pytest.mark.parametrize("flags,options,problem", QUANTIZATION.values(), ids=QUANTIZATION)
def test_unsupported_quantization_is_refused_before_converting(target, tmp_path, monkeypatch,
                                                               flags, options, problem):
    import mlxspec.converters.hf as hf

    def no_conversion(*args, **kwargs):
        raise AssertionError("the conversion started")

    monkeypatch.setattr(hf, "load_checkpoint", no_conversion)
    out = tmp_path / "out"
    line = assert_clean_error(invoke("convert", str(target), "-o", str(out), "-q", *flags))
    assert line == f"Error: {problem}"
    assert line == api_error(lambda: convert(target, out, quantize=True, **options), ValueError)
    with pytest.raises(TypeError, match="q_bits"):
        convert(target, out, quantize=True, q_bits="4")
    assert not out.exists() and not list(tmp_path.glob(".out.*"))


# ---- a killed conversion's leftovers -----------------------------------------------------------

KILLED_WRITER = """
import os, sys
from pathlib import Path
from mlxspec.converters.atomic import atomic_output_dir, temp_dir_in
where = Path(sys.argv[1])
temp_dir_in(where, ".write-test-", "")
with atomic_output_dir(where / "out") as tmp:
    (tmp / "model.safetensors").write_bytes(b"half")
    os._exit(9)  # killed mid-write: nothing runs after this
"""


LIVE_WRITER = """
import sys
from pathlib import Path
from mlxspec.converters.atomic import atomic_output_dir
with atomic_output_dir(Path(sys.argv[1]) / "live") as tmp:
    print(tmp.name, flush=True)
    sys.stdin.read()  # still writing until the test closes stdin
"""


def test_a_killed_conversions_scratch_is_removed_by_the_next(target, tmp_path):
    live = subprocess.Popen([sys.executable, "-c", LIVE_WRITER, str(tmp_path)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        live_scratch = tmp_path / live.stdout.readline().strip()
        subprocess.run([sys.executable, "-c", KILLED_WRITER, str(tmp_path)], check=False)
        dead = [p for p in tmp_path.iterdir() if p != live_scratch]
        assert len(dead) == 2 and any(".out.partial-" in p.name for p in dead), dead
        ok(invoke("convert", str(target), "-o", str(tmp_path / "out")))
        assert sorted(tmp_path.iterdir()) == sorted([live_scratch, tmp_path / "out"])
    finally:
        live.communicate("")
    assert live.returncode == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["live", "out"]


def test_the_model_caches_write_test_dirs_of_dead_processes_are_removed(tmp_path):
    subprocess.run([sys.executable, "-c", KILLED_WRITER, str(tmp_path)], check=False)
    write_test = [p for p in tmp_path.iterdir() if p.name.startswith(".write-test-")]
    assert write_test and str(os.getpid()) not in write_test[0].name
    made = temp_dir_in(tmp_path, ".write-test-", "")
    assert sorted(tmp_path.iterdir()) == [made]

