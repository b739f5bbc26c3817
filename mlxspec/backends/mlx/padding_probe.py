"""Whether a model's rows come out of a batch as they do alone, checked once per model before a
batch of it decodes anything (issue #64).

A batch pads rows (a chunked prefill right-pads them, a verify pass rolls each back by its own
amount), and every cache says where each row is; a model whose code does not read that (a
mixer that folds pads into its state, a RoPE at one offset for all rows) gives wrong text
without an error. So two random prompts of different lengths go through a batch and alone:
prefilled in chunks, one verify pass with drafts on one row only (rolled back unevenly), then a
plain pass; each row's logits must match its lone run. A mismatch, or an error, refuses the
model's batches in one line, and its prompts run one at a time instead. The verdict is kept for
the model object.
"""

import random
import weakref

import mlx.core as mx

from ...engine import Draft
from ...sampling import SamplingConfig

# A row's logits may differ from its lone run's by summation order (the batch size changes a
# matmul's blocking): measured up to 2e-5 of the logits' scale in fp32. A model mishandling
# padding was off by 0.1-8 there.
TOLERANCE = 0.02
_VERDICTS: dict[int, str | None] = {}  # by id(model), dropped when the model is collected
GREEDY = SamplingConfig()


def padding_refusal(model, batch_target_class) -> str | None:
    """Why `model`'s rows cannot share a batch exactly (None: they can); probed once."""
    key = id(model)
    if key not in _VERDICTS:
        _VERDICTS[key] = _probe(model, batch_target_class)
        weakref.finalize(model, _VERDICTS.pop, key, None)
    return _VERDICTS[key]


def _probe(model, batch_target_class) -> str | None:
    from .target import MLXTarget, vocab_size

    rnd = random.Random(0)
    vocab = vocab_size(model)
    prompts = [[rnd.randrange(vocab) for _ in range(n)] for n in (11, 3)]
    try:
        batch = batch_target_class(model, check_padding=False)
        tickets = batch.add(prompts)
        order = []
        while batch.joining:  # chunks of 4 tokens per row: right padding, rows ready apart
            order += [t for t, _ in batch.fill(8)]
        rows = [prompts[tickets.index(t)] for t in order]
        alone = [MLXTarget(model, speculative=True) for _ in rows]
        for target, prompt in zip(alone, rows):
            target.prefill(prompt)
        drafting = not batch._has_recurrent or bool(batch._mixers)
        steps = [[[1, 2, 3], []], [[], []]] if drafting else [[[], []]]
        pending = [prompt[-1] for prompt in rows]
        for step, drafts in enumerate(steps):
            passes = batch.launch(pending, [Draft(tokens=d) for d in drafts], [GREEDY] * 2)
            verdicts = passes.verdicts()
            for i, (target, d) in enumerate(zip(alone, drafts)):
                logits, own = _alone(target, pending[i], d)
                worst = _relative(logits, passes.logits[i, : len(d) + 1])
                if worst > TOLERANCE:
                    return (f"{type(model).__module__} gives a row of a batch other logits "
                            f"than the row alone ({worst:.2g} of their scale, step {step + 1}:"
                            f" it mishandles padded or uneven rows), so its prompts run one at "
                            f"a time")
                if (own.accepted, own.next_token) != (verdicts[i].accepted,
                                                      verdicts[i].next_token):
                    return None  # a near-tie parted them: nothing more to compare
                target.settle(own)
            batch.settle(verdicts)
            pending = [v.committed[-1] for v in verdicts]
        return None
    except ValueError:
        raise  # a refusal of mlxspec's own, already one line
    except Exception as err:  # the model's code fails on a batch
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        return (f"{type(model).__module__} fails on a batch of rows ({type(err).__name__}: "
                f"{first}), so its prompts run one at a time")


def _alone(target, pending: int, drafts: list[int]):
    """A lone target's logits of [pending, drafts] through its own launch, and its verdict."""
    seen = {}
    forward = target._forward

    def keep(*args, **kwargs):
        seen["logits"], features = forward(*args, **kwargs)
        return seen["logits"], features

    target._forward = keep
    try:
        verdict = target.launch(pending, Draft(tokens=drafts), GREEDY).verdict()
    finally:
        del target._forward
    return seen["logits"], verdict


def _relative(want, got) -> float:
    return mx.abs(got - want).max().item() / max(1.0, mx.abs(want).max().item())
