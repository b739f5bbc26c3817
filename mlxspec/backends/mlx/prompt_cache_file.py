"""Prompt caches saved to and loaded from safetensors files, so an agent's long system prompt is
prefilled once across processes and server restarts (mlx-lm's `cache_prompt`, made safe to load).

A file holds the tokens the cache holds, each layer's cache state and, where kept, the target
features of those tokens and the layers they come from (a DFlash or EAGLE-3 row reading those
layers can start from it). Its header names the model
it was made for (sizes and an embedding checksum), the cache class of each layer and a SHA-256 of
every array, so another model's file, a truncated one or one whose bytes changed is refused in
one line before any compute. Cache classes come from an allow-list of mlx-lm's: nothing named in
a file is looked up or run beyond those.
"""

import hashlib
import json
import os
from pathlib import Path

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from ...file_checks import _safetensors_header
from .target_parts import embedding_checksum, target_sizes
from .window_cache import WindowKVCache, make_cache

FORMAT = "mlxspec.prompt_cache"
VERSION = "1"
# The per-layer caches a target's cache (window_cache.make_cache) may hold: mlx-lm's, and a
# sliding window's WindowKVCache; their state is arrays and numbers only.
CLASSES = {name: getattr(mlx_cache, name) for name in (
    "KVCache", "RotatingKVCache", "ArraysCache", "QuantizedKVCache", "ChunkedKVCache")}
CLASSES["WindowKVCache"] = WindowKVCache


def model_key(model) -> str:
    """What a file must match: the target's sizes and its embedding checksum."""
    return json.dumps({"sizes": repr(target_sizes(model)),
                       "embedding": repr(embedding_checksum(model))}, sort_keys=True)


def save(kept, path: str | Path, model) -> None:
    """Write `kept` (a PromptCache) to `path` whole or not at all (a temporary file renamed)."""
    if kept.cache is None or not kept.tokens:
        raise ValueError("the prompt cache holds nothing yet: generate with it first")
    kept.check_model(model)
    arrays = {"tokens": mx.array(kept.tokens, dtype=mx.int32)}
    layers = []
    for i, layer in enumerate(kept.cache):
        name = type(layer).__name__
        if name not in CLASSES:
            raise ValueError(f"a {name} cannot be saved to a prompt cache file")
        layers.append({"class": name, "state": _encode(_state(layer), f"layer.{i}", arrays)})
    metadata = {"format": FORMAT, "version": VERSION, "model": model_key(model),
                "layers": json.dumps(layers)}
    if kept.features is not None:
        arrays["features"] = kept.features
        metadata["feature_layers"] = json.dumps(list(kept.feature_layers))
    mx.eval(list(arrays.values()))
    metadata["sha256"] = _digest(arrays)
    path = Path(path)
    partial = path.with_name(f".{path.name}.partial.safetensors")  # MLX adds the suffix
    try:
        mx.save_safetensors(str(partial), arrays, metadata)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def check_file(path: str | Path) -> dict:
    """The file's header metadata, checked as far as it can be without the model or arrays:
    one-line ValueErrors for a missing, truncated, corrupted or foreign file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no prompt cache file {path}")
    header, problem = _safetensors_header(path)
    if problem:
        raise ValueError(f"{path} is not a usable prompt cache file: {problem}")
    metadata = header.get("__metadata__") or {}
    if metadata.get("format") != FORMAT:
        raise ValueError(f"{path} is not an mlxspec prompt cache file (made by mlxspec's "
                         "--prompt-cache-file or PromptCache.save)")
    if metadata.get("version") != VERSION:
        raise ValueError(f"{path} is a prompt cache file of version {metadata.get('version')}; "
                         f"this mlxspec reads version {VERSION}")
    return metadata


def load(kept, path: str | Path, model) -> None:
    """Fill `kept` (an empty PromptCache) from `path`, refusing another model's file or one
    whose bytes changed, before it holds any of it."""
    path = Path(path)
    metadata = check_file(path)
    if metadata.get("model") != model_key(model):
        raise ValueError(f"{path} holds the prompt cache of another model (other sizes or "
                         "weights); make it again with this one")
    try:
        layers = json.loads(metadata["layers"])
        classes = [layer["class"] for layer in layers]
        feature_layers = tuple(int(i) for i in json.loads(metadata.get("feature_layers", "[]")))
    except (KeyError, TypeError, ValueError):  # json's JSONDecodeError is a ValueError
        raise ValueError(f"{path}: its header's layer list is damaged; make it again") from None
    expected = [type(c).__name__ for c in make_cache(model)]
    if classes != expected:
        raise ValueError(f"{path} holds a cache of {len(classes)} layers that this model's "
                         f"cache ({len(expected)} layers) does not match; make it again")
    arrays = mx.load(str(path))
    if _digest(arrays) != metadata.get("sha256"):
        raise ValueError(f"{path} is corrupted (its arrays do not match their checksum); make "
                         "it again")
    caches = []
    for i, layer in enumerate(layers):
        state = _decode(layer["state"], arrays)
        caches.append(CLASSES[layer["class"]].from_state(state))
    kept.check_model(model)
    kept.cache = caches
    kept.tokens = arrays["tokens"].tolist()
    # Features without the layers they come from (a file of an earlier mlxspec) are left out.
    kept.features = arrays.get("features") if feature_layers else None
    kept.feature_layers = feature_layers
    held = kept._held()
    if held is not None and held != len(kept.tokens):
        kept.cache, kept.tokens, kept.features = None, [], None
        raise ValueError(f"{path} is inconsistent: its caches hold {held} positions for "
                         f"{len(kept.tokens)} tokens; make it again")


def _state(layer):
    """A layer's state, a plain KVCache's cut to the positions it holds (its buffer grows in
    steps of 256)."""
    if type(layer) is mlx_cache.KVCache and layer.keys is not None:
        n = layer.offset
        return layer.keys[..., :n, :], layer.values[..., :n, :], n
    return layer.state


def _encode(value, name: str, arrays: dict):
    """Arrays go to `arrays` under `name`; numbers, strings and None stay in the JSON."""
    if isinstance(value, mx.array):
        arrays[name] = value
        return {"array": name}
    if isinstance(value, (list, tuple)):
        return {"list": [_encode(v, f"{name}.{i}", arrays) for i, v in enumerate(value)]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    raise ValueError(f"a cache state holds a {type(value).__name__}, which a file cannot")


def _decode(node, arrays: dict):
    if not isinstance(node, dict) or len(node) != 1:
        raise ValueError("a prompt cache file's layer state is damaged; make it again")
    (kind, value), = node.items()
    if kind == "array":
        if value not in arrays:
            raise ValueError(f"a prompt cache file lacks its array {value!r}; make it again")
        return arrays[value]
    if kind == "list":
        return [_decode(v, arrays) for v in value]
    if kind == "value" and (value is None or isinstance(value, (bool, int, float, str))):
        return value
    raise ValueError("a prompt cache file's layer state is damaged; make it again")


def _digest(arrays: dict) -> str:
    """SHA-256 over every array's name, dtype, shape and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(arrays):
        a = arrays[name]
        digest.update(f"{name}:{a.dtype}:{tuple(a.shape)};".encode())
        raw = mx.contiguous(a.astype(mx.uint8) if a.dtype == mx.bool_ else a).view(mx.uint8)
        digest.update(memoryview(raw))
    return digest.hexdigest()
