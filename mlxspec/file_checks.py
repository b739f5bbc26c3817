"""Checks on user-supplied files before a library parses them.

json and MLX's safetensors reader fail with messages that name no file ("Expecting property name
... line 2 column 1", "[load_safetensors] invalid data offsets"); these raise ValueError naming
the file, what is wrong and what to do, so the CLI can print it as one line.
"""

import json
from pathlib import Path
from typing import Any, Iterable

_FIX = "fix or replace the file"


def one_line(err: object, limit: int = 400) -> str:
    """A library's error message as one line of at most `limit` characters, for `Error: ...`."""
    text = " ".join(str(err).split())
    return text if len(text) <= limit else text[:limit] + " ..."


def read_json(path: str | Path) -> Any:
    """The parsed JSON of `path`; ValueError naming the file when it is not JSON text."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{path} is not valid JSON (line {err.lineno} column {err.colno}: {err.msg}): {_FIX}"
        ) from None
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text ({err.reason}): {_FIX}") from None


def read_json_object(path: str | Path) -> dict:
    """read_json for files that must hold one JSON object, such as config.json."""
    data = read_json(path)
    if not isinstance(data, dict):
        raise ValueError(
            f"{path} holds a JSON {type(data).__name__}, not an object ({{...}}): {_FIX}"
        )
    return data


_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2,
                "F16": 2, "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8}


def _safetensors_header(path: Path) -> tuple[dict | None, str | None]:
    """(header, None), or (None, what is wrong with it), checked against itself and the file
    size, without reading tensors."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return None, "shorter than a safetensors header"
        header_len = int.from_bytes(head, "little")
        if header_len > min(size - 8, 100_000_000):
            return None, "header length is larger than the file"
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return None, "header is not valid JSON"
    if not isinstance(header, dict):
        return None, "header is not a JSON object"
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            start, stop = info["data_offsets"]
            count = 1
            for dim in info["shape"]:
                count *= int(dim)
            nbytes = count * _DTYPE_BYTES[info["dtype"]]
        except (TypeError, KeyError, ValueError):
            return None, f"header entry for {name!r} is not a tensor record"
        if stop - start != nbytes:
            return None, f"tensor {name!r} spans {stop - start} bytes but its shape needs {nbytes}"
        end = max(end, stop)
    if 8 + header_len + end != size:
        return None, f"size {size} bytes does not match its header (truncated or corrupted)"
    return header, None


def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape in a safetensors file's header, without reading tensors; ValueError
    for a truncated or corrupted file."""
    header, problem = _safetensors_header(path)
    if problem:
        raise ValueError(
            f"corrupted safetensors file {path}: {problem}; download or convert it again"
        )
    return {name: tuple(info["shape"]) for name, info in header.items() if name != "__metadata__"}


def safetensors_names(path: Path) -> list[str]:
    """The tensor names in a safetensors file's header, without reading tensors."""
    return list(safetensors_shapes(path))


def check_safetensors(files: Iterable[Path]) -> dict[str, tuple[int, ...]]:
    """ValueError for the first truncated or corrupted file, before MLX or torch reads it;
    returns every tensor's shape, from the headers (what configs are checked against)."""
    shapes = {}
    for path in files:
        shapes.update(safetensors_shapes(path))
    return shapes


def safetensors_files(path: Path) -> list[Path]:
    """A checkpoint directory's *.safetensors files (their headers are check_safetensors'
    work); one line when it has none, naming any pickle checkpoint found instead."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        pickled = [p.name for p in Path(path).iterdir() if p.suffix in PICKLE_SUFFIXES]
        hint = f" (found {', '.join(pickled)}: pickle checkpoints are never loaded)" if pickled else ""
        raise FileNotFoundError(f"{path} has no *.safetensors weights{hint}")
    return files


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
