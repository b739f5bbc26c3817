"""Shared fixtures: the real default model (converted once into the repo's ignored cache)."""

import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("MLXSPEC_CACHE", str(ROOT / ".cache"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a model hub

import mlxspec  # noqa: E402  (loads OpenBLAS before anything imports mlx.core)


@pytest.fixture(scope="session")
def smollm_dir():
    from mlxspec.loading import resolve_model_dir

    return resolve_model_dir(None)


@pytest.fixture(scope="session")
def smollm(smollm_dir):
    return mlxspec.load(smollm_dir)


@pytest.fixture(scope="session")
def smollm_first_layers(smollm_dir, tmp_path_factory):
    """A draft model derived from the target: its first 6 of 30 layers, same tokenizer files.

    No second small model shares SmolLM2's tokenizer offline; this one is honest and cheap.
    """
    import json

    import mlx.core as mx

    keep = 6
    out = tmp_path_factory.mktemp("smollm_first_layers")
    config = json.loads((smollm_dir / "config.json").read_text())
    config["num_hidden_layers"] = keep
    (out / "config.json").write_text(json.dumps(config))
    weights = {}
    for shard in smollm_dir.glob("*.safetensors"):
        for name, w in mx.load(str(shard)).items():
            if ".layers." not in name or int(name.split(".layers.")[1].split(".")[0]) < keep:
                weights[name] = w
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    for f in smollm_dir.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="session")
def smollm_random_dflash(tmp_path_factory):
    """An untrained DFlash drafter in the released format, shaped for SmolLM2 (576 hidden, 30
    target layers, 49152 vocab): enough to prove losslessness, not to accept drafts."""
    from test_dflash import drafter_config, random_weights, save_drafter

    config = drafter_config(
        vocab=49152, hidden=576, target_layers=30, num_hidden_layers=1, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, intermediate_size=1536, block_size=16,
        layer_types=["full_attention"], max_position_embeddings=8192,
        mask_token_id=0, target_layer_ids=[1, 8, 14, 20, 27],
    )
    return save_drafter(tmp_path_factory.mktemp("smollm_dflash"), config, random_weights(config))


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread for a module's tests, then as it was."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_collection_modifyitems(items):
    """A test on the real model is slow: every one that reaches `smollm_dir` (directly or through
    `smollm`, `smollm_first_layers` or a module fixture built on them) is marked so, here, rather
    than by hand in each module. `scripts/test.sh --fast` leaves them out."""
    for item in items:
        if "smollm_dir" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
