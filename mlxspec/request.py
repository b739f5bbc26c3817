"""One generation's settings, checked once when built: every caller (the API's keywords, the
CLI's flags, a server's request body, bench) builds a `Request`, and everything after it reads
the checked values instead of checking them again."""

from dataclasses import dataclass, field

from .constraint import Constraint, check_constraint
from .sampling import SamplingConfig, is_integer

MAX_LOGPROBS = 20  # OpenAI's most top_logprobs per token
KV_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize packs
KV_GROUP_SIZES = (32, 64, 128)


def check_count(name: str, value, minimum: int = 1) -> None:
    """An integer option (max_tokens, num_draft) of the right type and size, before any work."""
    if not is_integer(value):
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def check_drafter_window(window) -> int | None:
    """--drafter-window: None (the checkpoint's own view), or at least 2 context positions
    (one before the drafted position and its own)."""
    if window is not None and (not is_integer(window) or window < 2):
        raise ValueError(f"the drafter window must be an integer >= 2, got {window!r}")
    return window


def check_kv_settings(kv_bits, kv_group_size) -> None:
    """kv_bits (None: full precision) and kv_group_size each one mlx-lm quantizes with."""
    if kv_bits is not None and (not is_integer(kv_bits) or kv_bits not in KV_BITS):
        raise ValueError(f"kv_bits must be one of {', '.join(map(str, KV_BITS))}, got "
                         f"{kv_bits!r}")
    if not is_integer(kv_group_size) or kv_group_size not in KV_GROUP_SIZES:
        raise ValueError(f"kv_group_size must be one of "
                         f"{', '.join(map(str, KV_GROUP_SIZES))}, got {kv_group_size!r}")


def check_logprobs(logprobs) -> None:
    """`logprobs`: None, or how many likeliest tokens to list (0 to 20)."""
    if logprobs is None:
        return
    if not is_integer(logprobs):
        raise TypeError(f"logprobs must be an integer or None, got {logprobs!r} "
                        f"({type(logprobs).__name__})")
    if not 0 <= logprobs <= MAX_LOGPROBS:
        raise ValueError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {logprobs}")


@dataclass(frozen=True)
class Request:
    """What to generate, apart from the prompt, the drafter and the cache it runs with.

    max_tokens: the most tokens to generate (the end-of-sequence token ends it sooner).
    sampling: temperature and truncations of the target's distribution, and the seed drawn from
        (greedy at temperature 0); the output follows it with any drafter.
    num_draft: the most drafts per step (None: the drafter's own default), capped by what the
        drafter can propose; with `adaptive` the loop drafts fewer while live acceptance says
        the extra verify work would not pay.
    logprobs: n (0 to 20) gives each response the log-probability of its token and the n
        likeliest tokens', computed on the device in the pass that verified the token, at no
        extra sync (None computes nothing). They describe the target's own distribution at that
        position, never a drafter's: after the request's processing (top-p, min-p, top-k, then
        temperature: the q every drafter's output follows) when sampling; when greedy the
        target's raw log-softmax, temperature 1 and no truncation, as OpenAI reports greedy
        requests.
    overlap: False stops queuing the next pass while the current one's tokens are handled (the
        output is the same; `mlxspec bench --overhead` uses it to measure the host's share).
    kv_bits: store the target's attention keys and values quantized to this many bits (mlx-lm's
        QuantizedKVCache, groups of `kv_group_size` along each head) once the prompt is
        prefilled: less memory and reading for long contexts. The output is the target's with
        that cache, drafter or not (a rollback keeps exactly the positions it keeps: each is
        quantized on its own). None keeps them in the model's dtype.
    constraint: what the reply must match (mlxspec.Constraint: a JSON schema, any JSON object,
        a regex, a Lark grammar), compiled before any model work. Every verified position's
        distribution is masked by the grammar's state after the tokens before it, as
        constrained decoding without speculation masks it (per-position masking, not the
        distribution of replies conditioned on the grammar); tokens the grammar forces are
        drafted for free; `logprobs` then describe the masked distribution. None constrains
        nothing.
    """

    max_tokens: int = 256
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    num_draft: int | None = None
    adaptive: bool = True
    logprobs: int | None = None
    overlap: bool = True
    kv_bits: int | None = None
    kv_group_size: int = 64
    constraint: Constraint | None = None

    def __post_init__(self):
        if self.num_draft is not None:
            check_count("num_draft", self.num_draft)
        check_kv_settings(self.kv_bits, self.kv_group_size)
        check_logprobs(self.logprobs)
        check_count("max_tokens", self.max_tokens)
        check_constraint(self.constraint)
