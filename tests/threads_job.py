"""Run by test_api_hardening.py in a subprocess (an abort kills the process): N threads x M
generations on one tiny model with a feature-reading drafter (the layers it captures are wrapped
per pass); each output must equal the single-thread run's. Argument: a directory for the drafter."""
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # tests/
import importlib  # noqa: E402

generate_module = importlib.import_module("mlxspec.generate")  # mlxspec.generate is the function
from test_dflash import make_drafter_dir  # noqa: E402
from tiny_models import tiny_llama  # noqa: E402
from test_api_hardening import tiny_tokenizer  # noqa: E402
from mlxspec.drafters.dflash import load_dflash_drafter  # noqa: E402

if "--unlocked" in sys.argv:  # to show the test fails without the lock
    generate_module.stream_request = generate_module.stream_request.__wrapped__
THREADS, GENERATIONS = 4, 4
model = tiny_llama(vocab=12, hidden=32, layers=4, seed=1, sharpness=3.0)
tokenizer = tiny_tokenizer(12)
drafter_dir = make_drafter_dir(Path(sys.argv[1]), seed=3)
prompts = [[1, 2, 3, 4, 1, 2, i % 10] for i in range(THREADS)]


def run(prompt):
    drafter = load_dflash_drafter(drafter_dir, model=model)
    return generate_module.generate(model, tokenizer, prompt, 24, drafter=drafter, num_draft=4)


expected = [run(p) for p in prompts]
got, errors = {}, []


def work(t):
    try:
        for m in range(GENERATIONS):
            got[t, m] = run(prompts[(t + m) % THREADS])
    except Exception as err:  # noqa: BLE001  reported by the parent
        errors.append(f"{type(err).__name__}: {err}")


threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
for t in threads:
    t.start()
for t in threads:
    t.join()
wrong = [k for k, v in got.items() if v != expected[(k[0] + k[1]) % THREADS]]
print("errors:", errors[:1], "wrong:", len(wrong), "of", len(got))
sys.exit(1 if errors or wrong or len(got) != THREADS * GENERATIONS else 0)
