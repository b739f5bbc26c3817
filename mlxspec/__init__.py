"""mlxspec: lossless speculative decoding on MLX.

    import mlxspec
    model, tokenizer = mlxspec.load()            # embedded SmolLM2-135M-Instruct
    text = mlxspec.generate(model, tokenizer, "Hello", max_tokens=64, drafter="lookup")

The same loop runs on torch (transformers models; CUDA when available), torch imported only then:

    model, tokenizer = mlxspec.load(backend="torch", device="cuda")
    text = mlxspec.generate(model, tokenizer, "Hello", max_tokens=64, drafter="lookup")
"""

from ._blas import SlowBlasWarning, blas_in_use, preload_openblas

preload_openblas()  # before anything imports mlx.core

from .backends import BACKENDS  # noqa: E402
from .backends.mlx.target import PromptCache  # noqa: E402
from .batch import BatchResponse, batch_generate  # noqa: E402
from .constraint import Constraint  # noqa: E402
from .drafters import load_drafter  # noqa: E402
from .engine import Draft, Drafter, SpecStats, Verdict  # noqa: E402
from .generate import GenerationResponse, generate, stream_generate, stream_request  # noqa: E402
from .loading import load  # noqa: E402
from .request import Request  # noqa: E402
from .sampling import SamplingConfig  # noqa: E402

__version__ = "0.1.0"
__all__ = [
    "BACKENDS",
    "BatchResponse",
    "Constraint",
    "Draft",
    "Drafter",
    "GenerationResponse",
    "PromptCache",
    "Request",
    "SamplingConfig",
    "SlowBlasWarning",
    "SpecStats",
    "Verdict",
    "batch_generate",
    "blas_in_use",
    "generate",
    "load",
    "load_drafter",
    "stream_generate",
    "stream_request",
]
