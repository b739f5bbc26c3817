"""Issue 37, training: hyperparameters refused up front, a run that diverges stops naming the
step and keeps its last good checkpoint, bad prompt files and output directories are one line,
and the CLI names its own flags."""

import json
import math

import mlx.core as mx
import pytest
from click.testing import CliRunner
from tiny_models import tiny_llama

import mlxspec
from mlxspec.cli.main import main
from mlxspec.training.medusa_trainer import train_medusa
from mlxspec.training.run import TrainingDiverged
from test_cli import assert_clean_error

PROMPTS = [[1, 2, 3, 4, 5], [7, 7, 7, 3], [5, 9, 11, 5, 9, 11], [3, 8], [20, 21, 22, 23]]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab=32, hidden=32, layers=3, seed=1, sharpness=3.0)


def _train(target, out, **kw):
    options = dict(steps=6, max_new_tokens=8, heldout=1, eval_every=0, save_every=2,
                   progress=False, seed=0, lr=3e-3, warmup=1)
    return train_medusa(target, PROMPTS, out, **{**options, **kw})


def invoke(*args):
    return CliRunner().invoke(main, ["train", *args])


@pytest.mark.parametrize("name, value", [("lr", math.nan), ("lr", 0.0), ("lr", -1e-3),
                                         ("lr", math.inf), ("grad_clip", math.nan),
                                         ("weight_decay", -1.0)])
def test_non_finite_or_non_positive_hyperparameters_refused(target, tmp_path, name, value):
    with pytest.raises(ValueError, match=name):
        _train(target, tmp_path / "run", **{name: value})
    assert not (tmp_path / "run" / "medusa_lm_head.safetensors").exists()


@pytest.mark.parametrize("value", ["nan", "0", "-1", "inf"])
def test_cli_refuses_a_bad_lr_before_loading(tmp_path, monkeypatch, value):
    monkeypatch.setattr(mlxspec.loading, "load", lambda *a, **k: pytest.fail("loaded"))
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    assert_clean_error(invoke("medusa", "--prompts", str(prompts), "--out", str(tmp_path / "o"),
                    "--lr", value), "--lr")


def test_a_diverging_run_stops_naming_the_step_and_keeps_the_last_good_checkpoint(
        target, tmp_path):
    out = tmp_path / "run"
    _train(target, out, steps=4)
    good = (out / "medusa_lm_head.safetensors").read_bytes()
    state = json.loads((out / "train_state/state.json").read_text())
    with pytest.raises(TrainingDiverged, match=r"step \d+.*last good one \(step 4\)"):
        _train(target, out, steps=12, resume=True, lr=1e30)  # blows up within a few steps
    assert (out / "medusa_lm_head.safetensors").read_bytes() == good
    assert json.loads((out / "train_state/state.json").read_text())["step"] == state["step"]
    assert all(mx.isfinite(w).all().item()
               for w in mx.load(str(out / "medusa_lm_head.safetensors")).values())


@pytest.mark.parametrize("content, where", [
    ('{"prompt": "hi"}\nnot json\n', ":2: not JSON"),
    ('{"prompt": "hi"}\n5\n', ":2: expected a JSON string or object, got int"),
    ('[1, 2]\n', ":1: expected a JSON string or object, got list"),
    ('{"prompt": 5}\n', ":1: the prompt and response must be strings"),
    ('{"prompt": "a", "response": ["b"]}\n', ":1: the prompt and response"),
])
def test_bad_prompt_lines_name_the_file_and_line(target, tmp_path, monkeypatch, content, where):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(content)
    with pytest.raises(ValueError, match=f"prompts.jsonl{where}"):
        train_medusa(target, str(prompts), tmp_path / "run", steps=1, progress=False)
    monkeypatch.setattr(mlxspec.loading, "load", lambda *a, **k: pytest.fail("loaded"))
    assert_clean_error(invoke("medusa", "--prompts", str(prompts), "--out", str(tmp_path / "o")),
             f"prompts.jsonl{where}")


def test_a_missing_prompts_file_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(mlxspec.loading, "load", lambda *a, **k: pytest.fail("loaded"))
    assert_clean_error(invoke("medusa", "--prompts", str(tmp_path / "nope.jsonl"), "--out",
                    str(tmp_path / "o")), "nope.jsonl", "not found")


def test_an_unwritable_out_names_the_directory_and_the_fix(target, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(OSError, match="a_file/run.*choose a writable one"):
        _train(target, blocker / "run")


def test_cli_says_resume_flag(tmp_path, monkeypatch):
    out = tmp_path / "run"
    (out / "train_state").mkdir(parents=True)
    (out / "train_state/state.json").write_text("{}")
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    monkeypatch.setattr(mlxspec.loading, "load", lambda *a, **k: pytest.fail("loaded"))
    result = invoke("medusa", "--prompts", str(prompts), "--out", str(out))
    line = assert_clean_error(result, "--resume")
    assert "resume=True" not in line
