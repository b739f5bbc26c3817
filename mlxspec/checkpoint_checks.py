"""Checks on a checkpoint's config and tokenizer files before anything is built from them.

Nothing in a checkpoint is executed: its tokenizer and config load with trust_remote_code=False,
and a directory that needs its own Python code is refused up front, naming the file, so that
transformers never asks "run the custom code? [y/N]" on stdin. A config's numbers are checked
against the safetensors headers before a model is allocated, because the loaders build what the
config says (a million layers) before they read a weight, and a NaN or a zero builds a model
that fails later with a message that names no file, or not at all.
"""

import json
import math
import re
from pathlib import Path
from typing import Any

from .file_checks import check_safetensors, one_line, read_json, read_json_object

# Files that are code, never copied into a converted model.
CODE_SUFFIXES = (".py", ".pyc", ".pyo", ".pyd", ".so", ".dylib", ".dll", ".sh", ".ipynb")

# The tokenizer's JSON files that transformers parses with messages naming none of them.
_TOKENIZER_JSON = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.json")


# ---- Code in a checkpoint ----------------------------------------------------------------------


def _auto_map(config: dict) -> dict:
    """The auto_map as {auto class: reference}; the old list form is a tokenizer's."""
    auto_map = config.get("auto_map") or {}
    return auto_map if isinstance(auto_map, dict) else {"AutoTokenizer": auto_map}


def _native_tokenizer(tokenizer_config: dict) -> bool:
    """Whether transformers implements the tokenizer_class the checkpoint names."""
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    name = tokenizer_config.get("tokenizer_class")
    return isinstance(name, str) and tokenizer_class_from_name(name) is not None


# Text-only configs of multimodal families: mlx-lm reads them with the family's class, which
# takes a flat config as its text config.
_TEXT_ONLY_TYPES = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}


def mlx_lm_model_type(model_type: str | None) -> str | None:
    """The model type mlx-lm knows ``model_type`` as (``qwen3_5_text`` -> ``qwen3_5``)."""
    return _TEXT_ONLY_TYPES.get(model_type, model_type)


def _native_model(model_type) -> bool:
    """Whether mlx-lm implements the architecture (then a config's auto_map is never used)."""
    from mlx_lm.utils import _get_classes

    try:
        _get_classes({"model_type": mlx_lm_model_type(model_type)})
    except (ValueError, ImportError):
        return False
    return True


def _implemented(auto_class: str, in_config: bool, tokenizer_config: dict, config: dict) -> bool:
    """Whether what an auto_map entry would load comes without the checkpoint's code: the
    tokenizer from transformers, the model (config.json's entries) from mlx-lm; other entries
    of tokenizer_config.json (processors) are never loaded."""
    if auto_class == "AutoTokenizer":
        return _native_tokenizer(tokenizer_config)
    return not in_config or _native_model(config.get("model_type"))


def check_no_remote_code(path: str | Path) -> None:
    """Refuse, naming the file, a checkpoint whose tokenizer or model would need its own code.

    An auto_map points transformers at .py files in the checkpoint. It is refused where that
    code would be needed: a tokenizer class transformers does not implement, or an architecture
    mlx-lm does not. Elsewhere (DeepSeek-V3 and Nemotron-H list one beside a model type both
    implement) it is never followed, since everything loads with trust_remote_code=False.
    """
    path = Path(path)
    tokenizer_file = path / "tokenizer_config.json"
    tokenizer_config = read_json_object(tokenizer_file) if tokenizer_file.is_file() else {}
    config_file = path / "config.json"
    config = read_json_object(config_file) if config_file.is_file() else {}
    for file, settings in ((tokenizer_file, tokenizer_config), (config_file, config)):
        auto_map = _auto_map(settings)
        needed = [f"{auto_class}: {reference}" for auto_class, reference in auto_map.items()
                  if reference and not _implemented(auto_class, file == config_file,
                                                    tokenizer_config, config)]
        if needed:
            code = ", ".join(needed)
            raise ValueError(
                f"{file} has an auto_map ({one_line(code, 200)}) that only the checkpoint's own "
                "Python code can load, and mlxspec never runs code from a checkpoint: use a "
                "checkpoint whose tokenizer and architecture transformers and mlx-lm implement")


# ---- Tokenizer files ---------------------------------------------------------------------------


def load_tokenizer(path: str | Path, eos_token_ids=None):
    """mlx-lm's load_tokenizer without remote code, its errors naming the file at fault.

    Its JSON files are parsed first (transformers' errors name none of them), the chat template
    is compiled as transformers renders it (a syntax error would otherwise surface at the first
    prompt as a traceback), and a tokenizer.json that fails to parse is named.
    """
    from mlx_lm.utils import load_tokenizer as mlx_lm_load_tokenizer

    path = Path(path)
    check_no_remote_code(path)
    for name in _TOKENIZER_JSON:
        if (path / name).is_file():
            read_json(path / name)
    try:
        tokenizer = mlx_lm_load_tokenizer(path, {"trust_remote_code": False},
                                          eos_token_ids=eos_token_ids)
    except json.JSONDecodeError as err:
        if (path / "tokenizer.json").is_file():
            read_json(path / "tokenizer.json")  # raises naming the file
        raise ValueError(f"cannot load the tokenizer in {path}: {one_line(err)}") from None
    except (ValueError, KeyError, TypeError, OSError) as err:
        raise ValueError(f"cannot load the tokenizer in {path}: {one_line(err)}") from None
    check_chat_template(path, tokenizer)
    return tokenizer


def _template_file(path: Path) -> Path:
    """Where the tokenizer's chat template came from, as transformers 5 looks for it."""
    for name in ("chat_template.jinja", "chat_template.json"):
        if (path / name).is_file():
            return path / name
    if (path / "additional_chat_templates").is_dir():
        return path / "additional_chat_templates"
    return path / "tokenizer_config.json"


def check_chat_template(path: Path, tokenizer) -> None:
    """Compile the chat template(s) with transformers' own sandboxed environment, naming the
    file for a syntax error."""
    from jinja2 import TemplateError

    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # a transformers that renamed it: jinja2's parse finds syntax errors
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        _compile_jinja_template = ImmutableSandboxedEnvironment().parse
    templates = getattr(tokenizer, "chat_template", None)
    if isinstance(templates, str):
        templates = {"default": templates}
    for name, template in (templates or {}).items():
        try:
            _compile_jinja_template(template)
        except TemplateError as err:
            where = f"line {err.lineno}: " if getattr(err, "lineno", None) else ""
            which = "" if name == "default" else f" ({name!r})"
            raise ValueError(
                f"{_template_file(Path(path))}: the chat template{which} does not parse "
                f"({where}{one_line(err, 200)}): fix or replace the file") from None


# ---- Config numbers against the weights --------------------------------------------------------

# Counts and sizes that must be positive integers wherever a config (or a section of it) has them.
_POSITIVE_INTS = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "hidden_size", "intermediate_size", "vocab_size", "head_dim",
                  "max_position_embeddings")
# Counts of optional parts: integers, 0 for none.
_COUNTS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")
# Numbers that must be finite and positive (no number may be NaN).
_POSITIVE_NUMBERS = ("rope_theta", "rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon",
                     "norm_eps", "norm_epsilon", "partial_rotary_factor")
# `model.layers.7.` / `layers.0.` / `h.3.` / `blocks.2.`: a numbered layer in a tensor name.
_LAYER = re.compile(r"^(.*?)(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")


def _sections(config: dict, where: str = ""):
    """(dotted prefix, dict) for the config and every dict inside it (text_config, rope
    parameters, transformer_layer_config, ...)."""
    yield where, config
    for key, value in config.items():
        if isinstance(value, dict):
            yield from _sections(value, f"{where}{key}.")


def _numbers(value: Any, where: str):
    """(dotted key, number) for every number anywhere in `value`."""
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from _numbers(inner, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list):
        for i, inner in enumerate(value):
            yield from _numbers(inner, f"{where}[{i}]")
    elif isinstance(value, float):
        yield where, value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _field_problem(key: str, value: Any) -> str | None:
    # Per-layer lists (Gemma 3n's intermediate_size) hold one positive integer per layer.
    values = value if isinstance(value, list) and value else [value]
    if key in _POSITIVE_INTS and not all(_is_int(v) and v > 0 for v in values):
        return f"must be a positive integer, got {value!r}"
    if key in _COUNTS and not (_is_int(value) and value >= 0):
        return f"must be an integer >= 0, got {value!r}"
    if key in _POSITIVE_NUMBERS and not (
            isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0):
        return f"must be a finite positive number, got {value!r}"
    return None


def _layer_counts(shapes: dict[str, tuple]) -> dict[str, int]:
    """How many numbered layers the weights hold under each prefix (`model`, `mtp`, ...)."""
    found: dict[str, set] = {}
    for name in shapes:
        match = _LAYER.match(name)
        if match:
            found.setdefault(match.group(1), set()).add(int(match.group(2)))
    return {prefix: len(ids) for prefix, ids in found.items()}


def _text_section(config: dict) -> dict:
    """{field name, as the message names it: value} for the language model's settings."""
    for key in ("text_config", "transformer_layer_config"):
        if isinstance(config.get(key), dict):
            return {**config, **{f"{key}.{k}": v for k, v in config[key].items()}}
    return config


def _embedding(shapes: dict[str, tuple]) -> tuple[tuple, bool] | None:
    """(shape, quantized) of the one token embedding outside any layer, else None."""
    names = [n for n in shapes if n.endswith("embed_tokens.weight")
             and not _LAYER.match(n) and not n.startswith("mtp")]
    if len(names) != 1:
        return None
    return shapes[names[0]], names[0][: -len("weight")] + "scales" in shapes


def check_config(config: dict, where: str | Path, shapes: dict[str, tuple] | None = None) -> None:
    """Refuse a config whose numbers cannot describe a model, or not the weights' one.

    No number may be NaN; counts and sizes are positive integers, eps and rope theta finite
    and positive; attention heads a multiple of key/value heads. With `shapes` (the safetensors
    headers, read without reading tensors): no more layers than the weights hold, and the
    vocabulary and hidden size of the token embedding. ValueError naming `where` and the field.
    """
    def refuse(field: str, problem: str):
        raise ValueError(f"{where}: {field} {problem}; fix the config or use the checkpoint it "
                         "belongs to")

    for field, value in _numbers(config, ""):
        if math.isnan(value):  # infinity can mean "no limit" (Nemotron-H's time_step_limit)
            refuse(field, "is NaN, not a number")
    for prefix, section in _sections(config):
        for key, value in section.items():
            problem = _field_problem(key, value) if value is not None else None
            if problem:
                refuse(prefix + key, problem)
        heads, kv_heads = section.get("num_attention_heads"), section.get("num_key_value_heads")
        if isinstance(heads, int) and isinstance(kv_heads, int) and heads % kv_heads:
            refuse(prefix + "num_attention_heads",
                   f"{heads} is not a multiple of num_key_value_heads {kv_heads}")
    if shapes:
        _check_against_weights(_text_section(config), shapes, refuse)


def _check_against_weights(text: dict, shapes: dict[str, tuple], refuse) -> None:
    def setting(key):  # (name, value): a text section's own setting, else the top level's
        name = next((k for k in text if k.endswith("." + key)), key)
        return name, text.get(name)

    held = max(_layer_counts(shapes).values(), default=None)
    name, layers = setting("num_hidden_layers")
    if held is not None and _is_int(layers) and layers > held:
        refuse(name, f"is {layers}, but the weights hold only {held}")
    embedding = _embedding(shapes)
    if embedding is None or len(embedding[0]) != 2:
        return
    (rows, cols), quantized = embedding
    (vocab_name, vocab), (hidden_name, hidden) = setting("vocab_size"), setting("hidden_size")
    if _is_int(vocab) and vocab != rows:
        refuse(vocab_name, f"is {vocab}, but the token embedding has {rows} rows")
    if _is_int(hidden) and not quantized and hidden != cols:
        refuse(hidden_name, f"is {hidden}, but the token embedding is {cols} wide")


def check_checkpoint_config(config_path: Path, parse=None):
    """A drafter checkpoint's config.json, checked (check_config), then read by `parse` (its
    own refusals, clearer than a count mismatch, come first), then checked against the headers
    of the safetensors beside it; returns what `parse` returns (default: the dict). A corrupted
    file is left to the weight reader, which refuses it before anything is built."""
    config = read_json_object(config_path)
    check_config(config, config_path)
    parsed = parse(config) if parse is not None else config
    try:
        shapes = check_safetensors(sorted(config_path.parent.glob("*.safetensors")))
    except ValueError:
        shapes = None
    check_config(config, config_path, shapes)
    return parsed
