"""Recurrent mixers that fold a batch row's padding into its state, and the rollback a batch of
such a model takes where their calls cannot be replayed one by one.

mlx-lm's recurrent_gemma (its RecurrentBlock: a convolution and an RG-LRU scan), rwkv7 (its time
mixing's token shift and WKV state, its channel mixing's token shift) and bailing_moe_linear
(its LinearAttention's GLA scan) run every column of a pass into their states and keep the
pass's last column, whatever each row's length: a right-padded row (a prefill chunk, a verify
pass's shorter drafts) ends with its pads in its state. They are listed in
hidden_states._IGNORE_LENGTHS (or take no mask), so in a pass whose states were `prepare`d with
each row's length they run row by row to it (hidden_states.rows_to_their_lengths).

A rollback replays the recorded calls where they account for each state once (state_rollback);
where they do not (rwkv7's time and channel mixing share one layer's cache; a pass whose
recurrent_gemma blocks ran as batch_adapters.fresh_states runs them), it puts the states back to
before the pass and runs the model again over each row's kept positions (rerun_kept), as a lone
sequence of such a model does.

A recurrent block may also start a sequence from no state otherwise than from zeros: mlx-lm's
recurrent_gemma scales its RG-LRU's first input by 1 where it has no state and by sqrt(1 - a^2)
after a state of zeros, which is what a batch holds for a row that has run nothing yet (merged
with rows that have). In a call where some row's caches hold no position, its blocks run row by
row, such a row from no state (batch_adapters.fresh_states, a per-call adapter).
"""

import mlx.core as mx

from ...rollback import recurrent_layers
from .batch_adapters import rows_at_their_positions
from .hidden_states import rows_to_their_lengths

def rerun_kept(model, cache: list, inputs: mx.array, keeps: list[int], mixers: list,
               drop) -> None:
    """Run the pass `inputs` (rows, S) again over row i's first keeps[i] positions: every
    recurrent state already put back to before the pass, and each attention row holding
    keeps[i] of its positions (dropped here, written again, then cut to keeps[i]) by
    `drop(cache, counts)`. Lazy: computed with the next pass."""
    width = inputs.shape[1]
    for c in cache:
        drop(c, keeps)
    states = recurrent_layers(cache)
    for s in states:
        s.prepare(lengths=keeps)
    with rows_to_their_lengths(mixers), rows_at_their_positions(model, cache) as view:
        model(inputs, cache=view)
    for s in states:
        s.finalize()
    for c in cache:
        drop(c, [width - k for k in keeps])
