"""Save a random hybrid target sized like a small real one, for `mlxspec bench` on hybrids.

A qwen3_5 text model built from mlx-lm's own class with the shape hybrid_rollback_cost.py times
(hidden 1024, 16 layers, 3 of 4 Gated DeltaNet), SmolLM2's tokenizer and vocabulary (49152), in
a model directory mlxspec loads like any other. Plain random weights write text that never
repeats, so nothing drafts; this one writes text that mostly does, as real models do when they
copy, without training: its head reads the next token off the current one along a random walk
of cycles of CYCLE tokens, and its layers' output projections are scaled by LAYER_SCALE so that
what the attention and Gated DeltaNet layers compute still moves the walk now and then. Every
layer runs at full cost; prompt lookup's acceptance is the walk's, not a trained model's:

    .venv/bin/python benchmarks/hybrid_target.py /tmp/qwen3_5-random
    .venv/bin/mlxspec bench --model /tmp/qwen3_5-random --drafters none,lookup --suite copy \\
        --limit 10 -n 64 --no-mlx-lm --no-llama-cpp --compare lookup/none
"""

import json
import shutil
import sys
from pathlib import Path

import mlxspec  # noqa: F401  (OpenBLAS before mlx.core)
import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import qwen3_5

from hybrid_rollback_cost import CONFIG
from mlxspec.loading import resolve_model_dir


CYCLE, LAYER_SCALE = 24, 0.3


def walk_head(embedding: mx.array, cycle: int, seed: int = 0) -> mx.array:
    """Head rows such that token t's embedding scores highest at its successor on a random
    permutation made of cycles of `cycle` tokens: row j is the embedding of j's predecessor."""
    order = mx.random.permutation(embedding.shape[0], key=mx.random.key(seed)).tolist()
    predecessor = [0] * len(order)
    for i, token in enumerate(order):
        start = i - i % cycle
        nxt = order[min(start + (i - start + 1) % cycle, len(order) - 1)]
        predecessor[nxt] = token
    return embedding[mx.array(predecessor)]


def main(out: Path) -> None:
    tokenizer_dir = resolve_model_dir(None)  # the embedded SmolLM2: its tokenizer files
    config = {**CONFIG, "vocab_size": 49152, "tie_word_embeddings": False,
              "eos_token_id": json.loads((tokenizer_dir / "config.json").read_text())
              .get("eos_token_id")}
    mx.random.seed(0)
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(config))
    text = model.language_model
    text.lm_head.weight = walk_head(text.model.embed_tokens.weight, CYCLE)
    for name, weight in tree_flatten(model.parameters()):
        if name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight")):
            model.update(tree_unflatten([(name, weight * LAYER_SCALE)]))
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, out / f.name)
    print(out)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
