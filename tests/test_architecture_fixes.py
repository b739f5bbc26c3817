"""mlx-lm architectures that crashed or were needlessly refused, on tiny random models built from
mlx-lm's own classes:

- llama4, kimi_vl, baichuan_m1, plamo2, youtu_llm keep their sizes outside `model.args` (a
  `config`, or a text_config ModelArgs): their vocabulary is read off the token embedding.
- Jamba's and Mamba's mixers take (x, cache), no mask: a rollback re-runs each recorded mixer
  call as its own signature takes it (and falcon_h1's and plamo2's, called with their input
  by name, are recorded too); in a batch, rows of such a mixer run to their own lengths.
- falcon_h1 keeps a Mamba state beside keys and values in one CacheList per layer: the state is
  restored and re-run, the keys and values cut (a recurrent state beside a window mlx-lm
  rotates is still refused, by name).
- gpt_bigcode reads its cache's offset as one number for its learned positions: in a batch each
  row gets its own, for each call (mlxspec.backends.mlx.batch_adapters).
- CacheList layers batch (falcon_h1, baichuan_m1, deepseek_v32, longcat_flash): each member is
  held and rolled back per row as its kind is at top level; baichuan_m1's state (its
  attention's last position's) is taken at each row's own last position. What cannot be held
  exactly is refused in one line saying why.
"""

import random

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, CacheList, make_prompt_cache
from test_api_hardening import tiny_tokenizer
from test_rollback_property import PlantedDrafter

import mlxspec
from mlxspec.backends.mlx.batch_target import MLXBatchTarget
from mlxspec.backends.mlx.target import MLXTarget, context_length, vocab_size
from mlxspec.engine import Draft, PlainDecoding, SpecStats, speculative_tokens
from mlxspec.sampling import SamplingConfig

VOCAB = 64
GREEDY = SamplingConfig()
PROMPT = [5, 6, 7, 8, 9] * 3 + [5, 6]  # repetitive: the lookup drafter finds drafts
_DENSE = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)
_MLA = dict(kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, v_head_dim=8,
            qk_nope_head_dim=8)

CONFIGS = {
    "llama4": dict(model_type="llama4", text_config=dict(
        model_type="llama4_text", **_DENSE, attention_bias=False, attention_chunk_size=8,
        head_dim=8, interleave_moe_layer_step=2, intermediate_size_mlp=64,
        num_experts_per_tok=1, num_hidden_layers=4, num_local_experts=2, rms_norm_eps=1e-5,
        rope_scaling=None, rope_theta=10000.0, use_qk_norm=True, vocab_size=VOCAB)),
    "kimi_vl": dict(model_type="kimi_vl", text_config=dict(
        model_type="deepseek_v3", **_MLA, vocab_size=VOCAB, hidden_size=32,
        intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4,
        num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=256)),
    "baichuan_m1": dict(**_DENSE, vocab_size=VOCAB, num_hidden_layers=2, rope_theta=10000.0,
                        sliding_window=8, sliding_window_layers=[], conv_window=2,
                        rms_norm_eps=1e-5),
    "plamo2": dict(**_DENSE, vocab_size=VOCAB, num_hidden_layers=4, hidden_size_per_head=8,
                   attention_window_size=256, mamba_d_state=8, mamba_d_conv=4,
                   mamba_num_heads=4, mamba_step=2, mamba_chunk_size=16),
    "youtu_llm": dict(**{**_DENSE, "num_key_value_heads": 4}, **_MLA, vocab_size=VOCAB,
                      num_hidden_layers=2),
    "jamba": dict(model_type="jamba", **_DENSE, vocab_size=VOCAB, num_hidden_layers=4,
                  attn_layer_offset=1, attn_layer_period=2, expert_layer_offset=1,
                  expert_layer_period=2, mamba_d_conv=4, mamba_d_state=8, mamba_expand=2,
                  num_experts=2, num_experts_per_tok=1, rms_norm_eps=1e-5),
    "mamba": dict(model_type="mamba", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                  state_size=8, num_hidden_layers=2, conv_kernel=4, use_bias=False,
                  use_conv_bias=True, time_step_rank=4),
    "falcon_h1": dict(**_DENSE, vocab_size=VOCAB, head_dim=8, num_hidden_layers=2,
                      mamba_chunk_size=16, mamba_d_conv=4, mamba_d_head=8, mamba_d_ssm=32,
                      mamba_d_state=8, mamba_n_groups=1, mamba_n_heads=4),
    "gpt_bigcode": dict(model_type="gpt_bigcode", n_embd=32, n_layer=2, n_inner=64, n_head=4,
                        n_positions=256, layer_norm_epsilon=1e-5, vocab_size=VOCAB),
    "longcat_flash": dict(model_type="longcat_flash", **_MLA, attention_method="MLA",
                          zero_expert_type="identity", hidden_size=32, ffn_hidden_size=64,
                          moe_topk=2, expert_ffn_hidden_size=16, n_routed_experts=4,
                          zero_expert_num=1, num_layers=2, vocab_size=VOCAB,
                          max_position_embeddings=256, num_attention_heads=4,
                          routed_scaling_factor=1.0, rms_norm_eps=1e-5, rope_theta=10000.0,
                          mla_scale_q_lora=True, mla_scale_kv_lora=True, attention_bias=False),
    "deepseek_v32": dict(**_MLA, vocab_size=VOCAB, hidden_size=32, index_head_dim=16,
                         index_n_heads=2, index_topk=4, intermediate_size=64,
                         moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4,
                         num_experts_per_tok=2, max_position_embeddings=256),
}


def tiny(name: str, seed: int = 0, sharpness: float = 4.0, **over):
    """A seeded random mlx-lm model of `name`, its output layer scaled by `sharpness` (the
    tied embedding where there is no LM head) so greedy decoding has clear winners."""
    import importlib

    module = importlib.import_module(f"mlx_lm.models.{name}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict({**CONFIGS[name], **over}))
    heads = [m for path, m in model.named_modules() if path.endswith("lm_head")]
    if heads:
        heads[0].weight = heads[0].weight * sharpness
    else:
        from mlxspec.backends.mlx.target_parts import input_embedding

        embedding = input_embedding(model)
        embedding.weight = embedding.weight * sharpness
    if name == "baichuan_m1":  # its convolutions are built as zeros: its state would go unread
        for layer in model.model.layers:
            attention = layer.self_attn
            attention.conv_k, attention.conv_v = (mx.random.normal(a.shape) * 0.7
                                                  for a in (attention.conv_k, attention.conv_v))
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer(VOCAB)


def final(model, tokenizer, prompt, drafter, n=24):
    """The tokens and the last response of a greedy generation."""
    responses = list(mlxspec.stream_generate(model, tokenizer, prompt, n, drafter=drafter))
    return [r.token for r in responses], responses[-1]


# ----------------------------------------------------------------------------- sizes (issue 1)


@pytest.mark.parametrize("name", ["llama4", "kimi_vl", "baichuan_m1", "plamo2", "youtu_llm",
                                  "gpt_bigcode", "mamba"])
def test_sizes_are_read_wherever_the_model_keeps_them(name, tokenizer):
    model = tiny(name)
    assert vocab_size(model) == VOCAB
    if name not in ("baichuan_m1", "mamba"):  # their configs name no context length
        assert context_length(model) == 256  # gpt_bigcode's: its learned positions' n_positions
    with pytest.raises(ValueError, match=f"outside the model's vocabulary of {VOCAB} tokens"):
        mlxspec.generate(model, tokenizer, [1, VOCAB], 4)


# ------------------------------------------------------------------ lossless generation (all)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_lookup_is_lossless_where_it_crashed_or_was_refused(name, tokenizer):
    """Greedy output with the lookup drafter is plain decoding's, drafts verified and some of
    them rejected (rolled back)."""
    plain, _ = final(tiny(name), tokenizer, PROMPT, None)
    spec, last = final(tiny(name), tokenizer, PROMPT, "lookup")
    assert spec == plain
    assert last.drafted > 0


# --------------------------------------------------------- rollback equals a fresh prefill


def step_as_alone(batch, singles, tokens, drafts, step) -> None:
    """One batched pass with these drafts: each row's verdict is its lone target's; every row
    then keeps what it committed (tokens extended in place)."""
    verdicts = batch.launch([t[-1] for t in tokens], drafts, [GREEDY] * len(tokens)).verdicts()
    for single, t, d, v in zip(singles, tokens, drafts, verdicts):
        ref = single.launch(t[-1], d, GREEDY).verdict()
        assert (v.accepted, v.next_token) == (ref.accepted, ref.next_token), step
        single.settle(ref)
        t += v.committed
    batch.settle(verdicts)


def layer_arrays(cache) -> list:
    """A layer's arrays, a CacheList's members' in order: keys and values up to its offset,
    or a recurrent state's arrays."""
    if isinstance(cache, CacheList):
        return [a for member in cache.caches for a in layer_arrays(member)]
    if isinstance(cache, ArraysCache):
        return list(cache.cache)
    return [cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]]


# Recurrent layers re-run alone (their recorded mixer calls), or the whole model (baichuan_m1:
# its convolution state is updated inside attention), or no recurrent layer at all (CacheLists
# of keys and values only).
REPLAYED = {"jamba", "mamba", "falcon_h1", "plamo2"}


@pytest.mark.parametrize("name", ["jamba", "mamba", "falcon_h1", "plamo2", "baichuan_m1",
                                  "longcat_flash", "deepseek_v32"])
def test_caches_after_rollback_equal_a_fresh_prefill(name):
    model = tiny(name)
    prompt, n = [1, 2, 3, 4, 5, 1, 2, 3], 14
    plain = [t for t, _ in speculative_tokens(MLXTarget(model), PlainDecoding(), prompt,
                                              sampling=GREEDY, max_tokens=n, num_draft=1,
                                              stats=SpecStats())]
    for j in (0, 2):
        target = MLXTarget(model, speculative=True)
        replays, trim = [], target.trim

        def spy(k, trim=trim, target=target):
            if k > 0:  # what the rollback re-runs: None means the whole model
                replays.append(target._last_pass[2] if target._last_pass else "no state")
            trim(k)

        target.trim = spy
        stats = SpecStats()
        drafter = PlantedDrafter(prompt + plain, j, VOCAB)
        out = [t for t, _ in speculative_tokens(target, drafter, prompt,
                                                sampling=GREEDY, max_tokens=n, num_draft=3,
                                                stats=stats)]
        assert out == plain and stats.drafted > stats.accepted
        assert replays, "no draft was ever rejected"
        if target._recurrent:
            assert all((r is not None) == (name in REPLAYED) for r in replays)
        committed = prompt + out
        fresh = make_prompt_cache(model)
        model(mx.array(committed[:-1])[None], cache=fresh)
        mx.eval([c.state for c in target.cache])
        for ours, theirs in zip(target.cache, fresh):
            assert type(ours) is type(theirs)
            for a, b in zip(layer_arrays(ours), layer_arrays(theirs), strict=True):
                assert a.shape == b.shape and mx.allclose(a, b, atol=1e-4).item()


def test_falcon_h1_rolls_back_its_mamba_states_by_replay_and_cuts_its_keys():
    """falcon_h1's layers each hold CacheList(ArraysCache, KVCache): its Mamba mixers (called
    with `input_states=`) are recorded, one per state, so a rollback never runs the model."""
    model = tiny("falcon_h1")
    target = MLXTarget(model, speculative=True)
    assert len(target._recurrent) == len(target.cache) == 2
    assert all(isinstance(c, CacheList) for c in target.cache)
    target.prefill(PROMPT)
    before = target.cache[0][1].offset
    target.launch(PROMPT[-1], Draft(tokens=[1, 2, 3]), GREEDY).verdict()
    assert target.cache[0][1].offset == before + 4
    assert target._last_pass[2] is not None and len(target._last_pass[2]) == 2  # no whole rerun
    target.trim(2)
    assert all(c[1].offset == before + 2 for c in target.cache)
    fresh = make_prompt_cache(model)
    model(mx.array(PROMPT[:-1] + [PROMPT[-1], 1])[None], cache=fresh)
    for ours, theirs in zip(target.cache, fresh):
        for a, b in zip(layer_arrays(ours), layer_arrays(theirs), strict=True):
            assert mx.allclose(a, b, atol=1e-4).item()


def test_a_recurrent_state_beside_a_window_rolls_back_past_the_window(tokenizer):
    """baichuan_m1's windowed layers keep a convolution state beside their window (a CacheList;
    mlx-lm's RotatingKVCache, which cannot be cut back past its size, becomes a WindowKVCache):
    with lookup, a prompt many windows long decodes as mlx-lm does, drafting; a CacheList
    beside a window mlx-lm still rotates is refused in one line, naming the kind."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import RotatingKVCache

    model = tiny("baichuan_m1", sliding_window_layers=[0], sliding_window=4)
    prompt = PROMPT * 4
    want = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=16)]
    out = list(mlxspec.stream_generate(model, tokenizer, prompt, 16, drafter="lookup"))
    assert [r.token for r in out] == want and out[-1].drafted > 0
    rotating = make_prompt_cache(model)
    for c in rotating:
        if isinstance(c, CacheList):
            c.caches = [RotatingKVCache(4, keep=1) if isinstance(m, RotatingKVCache) else m
                        for m in c.caches]
    with pytest.raises(ValueError) as err:
        MLXTarget(model, speculative=True, cache=rotating)
    message = str(err.value)
    assert "CacheList(ArraysCache, RotatingKVCache)" in message and "\n" not in message


# -------------------------------------------------------------------------------------- batches


PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [3, 4, 3, 4, 3, 4, 3],
           [10, 11, 12, 13] * 4 + [10, 11], [20]]


# Batches of CacheList layers: a Mamba state beside keys and values (falcon_h1), a last
# position's projections beside keys and values or a sliding window (baichuan_m1, its layer 0
# windowed), an indexer's keys beside the attention's (deepseek_v32), two attentions' keys
# (longcat_flash).
CACHE_LISTS = {"falcon_h1": {}, "baichuan_m1": dict(sliding_window_layers=[0], sliding_window=4),
               "deepseek_v32": {}, "longcat_flash": {}}


@pytest.mark.parametrize("name", ["gpt_bigcode", "jamba", "mamba", "plamo2", *CACHE_LISTS])
@pytest.mark.parametrize("drafter", [None, "lookup"])
def test_batch_rows_equal_each_alone(name, drafter, tokenizer):
    """Prompts of different lengths (a right-padded prefill, ragged passes): each row's output
    is its prompt's alone. gpt_bigcode's rows need their own learned positions; Jamba's and
    Mamba's mixers stop each row at its own length in the prefill and the rollback; a
    CacheList's members are rolled back each as its kind is (baichuan_m1's state: each row's
    last kept position's)."""
    model = tiny(name, **CACHE_LISTS.get(name, {}))
    batch = mlxspec.batch_generate(model, tokenizer, PROMPTS, 16, drafter=drafter)
    for prompt, row in zip(PROMPTS, batch.token_ids):
        alone, _ = final(model, tokenizer, prompt, None, 16)
        assert row == alone[: len(row)]
    if drafter:
        assert sum(s.drafted for s in batch.stats) > 0


@pytest.mark.parametrize("name", ["jamba", "gpt_bigcode", *CACHE_LISTS])
def test_batch_rollback_leaves_each_row_as_a_fresh_prefill(name):
    """Random spoiled drafts on rows at different lengths: each verdict is the single path's,
    and each row's caches end as a fresh prefill of what it committed."""
    model = tiny(name)
    rnd = random.Random(0)
    prompts = [[rnd.randrange(VOCAB) for _ in range(n)] for n in (5, 11, 1)]
    batch = MLXBatchTarget(model, prefill_step_size=4)  # chunks where a row has no tokens left
    tickets = batch.add(prompts)
    while batch.joining:
        batch.fill()
    assert len(tickets) == batch.rows == 3
    singles = [MLXTarget(model, speculative=True) for _ in prompts]
    tokens = [list(p) for p in prompts]
    for single, prompt in zip(singles, prompts):
        single.prefill(prompt)
    for step in range(6):
        drafts = []
        for t in tokens:
            k = rnd.choice([0, 2, 4])
            drafts.append(Draft(tokens=[rnd.randrange(VOCAB) for _ in range(k)]))
        step_as_alone(batch, singles, tokens, drafts, step)
    for row, t in enumerate(tokens):
        fresh = MLXTarget(model)
        fresh.prefill(t)
        caches, held, _ = batch.row_cache(row)
        assert held in (None, len(t) - 1)
        for got, want in zip(caches, fresh.cache, strict=True):
            for a, b in zip(layer_arrays(got), layer_arrays(want), strict=True):
                assert a.shape == b.shape and mx.allclose(a, b, atol=1e-4).item()


def test_row_positions_are_per_row_for_one_call_only():
    """gpt_bigcode's position embedding sees each row's own offset inside the call, and is its
    own module again after it; a model that reads per-row offsets gets its cache unchanged."""
    from mlx_lm.models.cache import BatchKVCache

    from mlxspec.backends.mlx.batch_adapters import rows_at_their_positions

    model = tiny("gpt_bigcode")
    cache = [BatchKVCache([0, 0]) for _ in model.transformer.h]
    cache[0].offset = mx.array([0, 4])
    wpe = model.transformer.wpe
    with rows_at_their_positions(model, cache) as seen:
        assert seen[0].offset == 0 and seen[1:] == cache[1:]
        ids = mx.arange(3)
        want = mx.stack([wpe(mx.arange(3)), wpe(mx.arange(4, 7))])
        assert mx.array_equal(model.transformer.wpe(ids), want)
    assert model.transformer.wpe is wpe
    with rows_at_their_positions(tiny("jamba"), cache) as seen:
        assert seen is cache

def _windows_forgot(cache) -> bool:
    from mlxspec.backends.mlx.window_cache import WindowKVCache
    from mlxspec.rollback import leaves

    return any(isinstance(c, WindowKVCache) and c.start > 0
               for layer in cache for c in leaves(layer))


@pytest.mark.parametrize("name", ["falcon_h1", "baichuan_m1"])
def test_a_batch_row_continues_a_kept_cache_of_cache_lists(name):
    """Kept prompt caches whose layers are CacheLists (falcon_h1's Mamba state beside keys and
    values; baichuan_m1's state beside a window that has forgotten positions) start rows of a
    batch beside a fresh row: each verdict is a lone target's, the kept caches are left as
    they were, and each row comes back out as one sequence's CacheLists."""
    model = tiny(name, **CACHE_LISTS[name])
    rnd = random.Random(1)
    prompts = [[rnd.randrange(VOCAB) for _ in range(n)] for n in (30, 9, 6)]
    kept = [MLXTarget(model, prefill_step_size=4) for _ in range(2)]
    kept[0].prefill(prompts[0][:28])  # 27 positions: baichuan's window forgot some
    kept[1].prefill(prompts[1][:4])
    if name == "baichuan_m1":
        assert _windows_forgot(kept[0].cache)
    before = [[mx.array(a) for c in k.cache for a in layer_arrays(c)] for k in kept]
    batch = MLXBatchTarget(model)
    tickets = batch.add(prompts, [(kept[0].cache, 27), (kept[1].cache, 3), None])
    order = []
    while batch.joining:
        order += [t for t, _ in batch.fill(4)]
    rows = [prompts[tickets.index(t)] for t in order]
    singles = [MLXTarget(model, speculative=True) for _ in rows]
    tokens = [list(p) for p in rows]
    for single, prompt in zip(singles, rows):
        single.prefill(prompt)
    for step in range(5):
        drafts = [Draft(tokens=[rnd.randrange(VOCAB) for _ in range(rnd.choice([0, 2, 3]))])
                  for _ in rows]
        step_as_alone(batch, singles, tokens, drafts, step)
    for k, was in zip(kept, before):
        now = [a for c in k.cache for a in layer_arrays(c)]
        assert all(mx.array_equal(a, b).item() for a, b in zip(was, now, strict=True))
    for row, single in enumerate(singles):
        caches, held, _ = batch.row_cache(row)
        assert held is None  # every layer a CacheList: none counts positions at top level
        for got, want in zip(caches, single.cache, strict=True):
            assert isinstance(got, CacheList)
            assert [type(c) for c in got.caches] == [type(c) for c in want.caches]
    longest = batch.row_cache(order.index(tickets[0]))[0]
    assert _windows_forgot(longest) == (name == "baichuan_m1")


def test_a_kept_row_records_its_cache_lists_states_at_the_end_of_its_prompt():
    """falcon_h1 capturing features: a row added as kept records the Mamba states of its
    CacheLists at the end of its prompt, as a lone prefill leaves them."""
    model = tiny("falcon_h1")
    prompts = [[5, 3, 9, 1, 7, 2], [8, 4, 6, 2, 1]]
    batch = MLXBatchTarget(model, capture_layers=(0, 1))
    tickets = batch.add(prompts, kept=[False, True])
    order = []
    while batch.joining:
        order += [ticket for ticket, _ in batch.fill(3)]
    lone = MLXTarget(model, capture_layers=(0, 1))
    lone.prefill(prompts[1])
    got = batch.row_cache(order.index(tickets[1]))[2]
    assert len(got) == len(lone.prompt_state) == 2
    for row_states, lone_states in zip(got, lone.prompt_state):
        for g, w in zip(row_states, lone_states, strict=True):
            assert mx.allclose(g, w, atol=1e-4).item()


def test_batches_refuse_what_cannot_be_cut_back_per_row_saying_why():
    """minimax_m3_vl's sparse attention (key blocks cut by cache slot) is refused in one line,
    naming the cause."""
    import copy
    import importlib

    from architectures import CONFIGS as ALL

    sparse = copy.deepcopy(ALL["minimax_m3_vl"])
    sparse["text_config"].update(index_n_heads=2, index_head_dim=8, index_block_size=4,
                                 index_topk_blocks=2)
    module = importlib.import_module("mlx_lm.models.minimax_m3_vl")
    with pytest.raises(ValueError) as err:
        MLXBatchTarget(module.Model(module.ModelArgs.from_dict(sparse)))
    message = str(err.value)
    assert "by cache slot" in message and "\n" not in message
