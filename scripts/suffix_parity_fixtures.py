"""Suffix decoding parity fixtures from Snowflake's Arctic Inference (issue #40).

Runs requests through arctic_inference.suffix_decoding.SuffixDecodingCache (its prompt trees and
global tree of responses, responses added as they are generated, some requests overlapping) and
records every draft it proposes: tests/test_suffix.py replays the same requests through
mlxspec's SuffixDrafter and must propose the same tokens, tree shape and score.

arctic-inference 0.3.0 ships only an sdist whose build needs vLLM's stack; its suffix tree is a
self-contained nanobind extension, built alone here (the package's own sources, unmodified):

    pip download --no-deps arctic-inference==0.3.0 && tar xzf arctic_inference-0.3.0.tar.gz
    python3.11 -m venv /work/venvs/arctic && /work/venvs/arctic/bin/pip install nanobind==2.9.2 numpy
    cd arctic_inference-0.3.0/csrc/suffix_decoding && mkdir build && cd build
    cmake .. -DPython_EXECUTABLE=/work/venvs/arctic/bin/python && make
    SP=/work/venvs/arctic/lib/python3.11/site-packages/arctic_inference
    mkdir -p $SP/suffix_decoding && touch $SP/__init__.py
    cp ../../../arctic_inference/suffix_decoding/{__init__,cache}.py _C*.so $SP/suffix_decoding/
    /work/venvs/arctic/bin/python scripts/suffix_parity_fixtures.py  # from the repo root
"""

import json
import random
from pathlib import Path

from arctic_inference.suffix_decoding import SuffixDecodingCache

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "suffix" / "arctic.json"
DEPTH = 12
SETTINGS = [  # (K, spec factor, min token prob, tree)
    (8, 1.0, 0.1, False), (8, 1.0, 0.1, True), (16, 2.0, 0.0, True), (6, 0.5, 0.3, False),
]


def scenario(seed: int) -> dict:
    """Requests over a 6-token vocabulary whose replies often repeat earlier replies' pieces;
    request i + 1 starts while request i still generates."""
    rnd = random.Random(seed)
    pieces = [[rnd.randrange(6) for _ in range(rnd.randrange(3, 7))] for _ in range(5)]
    requests = []
    for _ in range(4):
        prompt = [rnd.randrange(6) for _ in range(rnd.randrange(2, 10))]
        reply = []
        while len(reply) < 24:
            reply += rnd.choice(pieces) if rnd.random() < 0.7 else [rnd.randrange(6)]
        requests.append({"prompt": prompt, "reply": reply[:24]})
    return {"seed": seed, "requests": requests}


def run(case: dict, setting: tuple) -> list:
    """Every draft of every step: request i's step j appends 2 reply tokens, then asks for a
    draft after them; request i + 1 runs its steps interleaved with request i's second half."""
    k, factor, min_prob, tree = setting
    cache = SuffixDecodingCache(max_tree_depth=DEPTH, max_cached_requests=1000)
    drafts, schedule = [], []
    for i, request in enumerate(case["requests"]):
        steps = [(i, j) for j in range(0, len(request["reply"]), 2)]
        half = len(steps) // 2
        if schedule:  # interleave with the previous request's second half
            tail = schedule[-half:]
            del schedule[-half:]
            schedule += [s for pair in zip(tail, steps) for s in pair] + steps[half:]
        else:
            schedule += steps
    started, lengths = set(), {}
    for i, j in schedule:
        request = case["requests"][i]
        if i not in started:
            cache.start_request(i, request["prompt"])
            started.add(i)
        new = request["reply"][j : j + 2]
        cache.add_active_response(i, new)
        lengths[i] = j + len(new)
        context = request["prompt"] + request["reply"][: lengths[i]]
        draft = cache.speculate(i, context, max_spec_tokens=k, max_spec_factor=factor,
                                min_token_prob=min_prob, use_tree_spec=tree)
        drafts.append({"tokens": list(draft.token_ids), "parents": list(draft.parents),
                       "probs": [round(p, 6) for p in draft.probs],
                       "score": round(draft.score, 6)})
        if lengths[i] >= len(request["reply"]):
            cache.stop_request(i)
    return {"schedule": schedule, "drafts": drafts}


def main() -> None:
    fixtures = {"depth": DEPTH, "cases": []}
    for seed in range(4):
        case = scenario(seed)
        case["runs"] = [dict(setting=list(s), **run(case, s)) for s in SETTINGS]
        fixtures["cases"].append(case)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(fixtures, separators=(",", ":")) + "\n")
    drafts = sum(len(r["drafts"]) for c in fixtures["cases"] for r in c["runs"])
    found = sum(bool(d["tokens"]) for c in fixtures["cases"] for r in c["runs"]
                for d in r["drafts"])
    print(f"{OUT}: {drafts} drafts, {found} non-empty")


if __name__ == "__main__":
    main()
