"""llama.cpp (through llama-cpp-python) as a benchmark peer: plain decoding and its prompt-lookup
decoding on the same GGUF file, fed the same prompt token ids as our engine.

llama.cpp runs the GGUF's quantised weights with its own kernels, so its absolute tok/s are not
comparable to ours (we dequantise); what the benchmark compares is each engine's lookup speedup over
its own plain decoding.
"""

import os
import time


def llama_cpp_missing() -> str | None:
    """Why the llama.cpp peer cannot run here, or None when it can."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return "llama-cpp-python is not installed (pip install llama-cpp-python)"
    return None


class LlamaCppPeer:
    """One llama.cpp context over a GGUF; `lookup_tokens` > 0 turns on its prompt-lookup drafts.

    `n_ctx` is sized to the benchmark, not the model: with drafts llama-cpp-python keeps logits for
    every context position (n_ctx x vocab floats: 20 GB at Qwen's 32k x 152k)."""

    def __init__(self, gguf_path: str, n_ctx: int, lookup_tokens: int = 0,
                 threads: int | None = None):
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        if not os.path.isfile(gguf_path):
            raise FileNotFoundError(f"llama.cpp peer: no GGUF file at {gguf_path}")
        threads = threads or os.cpu_count() or 1
        draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup_tokens) if lookup_tokens else None
        self.llm = Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_threads=threads,
                         n_threads_batch=threads, draft_model=draft, verbose=False)
        self.eos = self.llm.token_eos()
        self.passes = 0
        evaluate = self.llm.eval

        def counted_eval(tokens):
            # One call per target pass: the prompt, then [last token + drafts] per step.
            self.passes += 1
            return evaluate(tokens)

        self.llm.eval = counted_eval

    def run(self, prompt_tokens: list[int], max_tokens: int, temp: float, seed: int, result,
            stop_ids=()):
        """Generate up to `max_tokens`, stopping at llama.cpp's EOS or any of `stop_ids` (our
        tokenizer's, so both engines stop alike), and add timings and passes to `result`."""
        stop = {self.eos, *stop_ids}
        self.llm.reset()
        self.llm.set_seed(seed)
        # Pure sampling at temp > 0 (llama.cpp's default top-k/top-p/min-p off), greedy at 0.
        tokens = self.llm.generate(prompt_tokens, temp=temp, top_k=0, top_p=1.0, min_p=0.0,
                                   repeat_penalty=1.0, reset=False)
        self.passes = 0
        start = time.perf_counter()
        first = None
        n = 0
        for token in tokens:
            n += 1
            if first is None:
                first = time.perf_counter()
            if token in stop or n >= max_tokens:
                break
        end = time.perf_counter()
        tokens.close()
        result.add_timing(n, start, first, end)
        # As with mlx-lm, the prompt's pass yields the first token: n = passes + accepted drafts.
        result.target_passes += self.passes
        result.accepted += n - self.passes
