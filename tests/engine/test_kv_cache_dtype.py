"""Chapters 6 and 8 together: the engine on an 8-bit KV cache, LLM(kv_cache_dtype="int8" | "fp8_e4m3").

Measured on the embedded model (greedy, ignore_eos):

* int8 gives transformers' tokens for all 120 tokens of the four AGREE prompts. Two other prompts part
  at tokens 65 (ROMEO.\\nWhat light) and 105 (OTHELLO.\\nIt is the cause), where the fp32 logits' top two
  differ by 0.014 and 0.0015: a tie int8's rounding (logits move by up to about 0.2) cannot keep.
* fp8 (3 mantissa bits) first differs at tokens 31, 40, 11 and 79 of the AGREE prompts.
* kv_cache_memory = 8 MiB holds 128 float32 blocks of 16 tokens (65,536 bytes each) and 510 int8 or fp8
  blocks (16,448 bytes: 16,384 of values and 64 of scales), 3.98x.
"""

import pytest
import torch
from test_engine import assert_pool_empty, greedy  # Chapter 6's checks, the same for every kv_cache_dtype

import kvlab.kernels  # (on a CPU-only machine this switches Triton to its interpreter)
from conftest import make_tiny_model
from kvlab import LLM, BeamSearchParams, SamplingParams
from kvlab.baselines.transformers_generate import reference_beam_search, reference_generate
from kvlab.cache.kv_storage import block_bytes
from kvlab.cache.paged_cache import PagedKVCache
from kvlab.decoding.beam_search import BeamSearch
from kvlab.engine.llm_engine import LLMEngine

AGREE = ["First Witch.\nWhen shall we three", "HAMLET.\nTo be, or not", "KING LEAR.\nNothing will come",
         "PORTIA.\nThe quality of mercy"]
LONG = 120


@pytest.fixture(scope="module")
def long_references(embedded):
    model, tokenizer = embedded
    return [reference_generate(model, tokenizer(p)["input_ids"], LONG) for p in AGREE]


def _tokens(llm, prompts, n):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(n))]


def test_int8_greedy_equals_the_unquantized_engine_and_generate(embedded, long_references):
    """120 greedy tokens of four prompts in one batch: int8 = the model's-dtype engine = transformers' generate."""
    model, tokenizer = embedded
    unquantized = LLM(model, tokenizer, num_blocks=64)
    int8 = LLM(model, tokenizer, num_blocks=64, kv_cache_dtype="int8")
    assert int8.llm_engine.cache.k_pools[0].dtype == torch.int8 and unquantized.llm_engine.kv_cache_dtype == "auto"
    expected = _tokens(unquantized, AGREE, LONG)
    assert expected == long_references, "set-up: the unquantized engine equals generate"
    got = _tokens(int8, AGREE, LONG)
    for prompt, tokens, ref in zip(AGREE, got, long_references):
        first = next((i for i, (a, b) in enumerate(zip(tokens, ref)) if a != b), None)
        assert first is None and len(tokens) == LONG, f"{prompt!r}: int8 first differs at token {first}"
    assert int8.llm_engine.cache.storage.num_requantized > 0, "scales grew as blocks filled, and the output held"
    assert_pool_empty(int8.llm_engine)


def test_fp8_runs_and_starts_like_the_unquantized_engine(embedded, long_references):
    """fp8 e4m3 (asked for as vLLM's "fp8"): 120 tokens each, the first 8 as generate's, every block back."""
    model, tokenizer = embedded
    llm = LLM(model, tokenizer, num_blocks=64, kv_cache_dtype="fp8")
    assert llm.llm_engine.kv_cache_dtype == "fp8_e4m3" and llm.llm_engine.cache.k_pools[0].dtype == torch.float8_e4m3fn
    got = _tokens(llm, AGREE, LONG)
    assert all(len(t) == LONG for t in got)
    assert all(t[:8] == ref[:8] for t, ref in zip(got, long_references)), "fp8 follows the model for the first tokens"
    assert_pool_empty(llm.llm_engine)


FEATURES = {
    # name: engine arguments; the small pools force preemptions (prefix caching on unless said otherwise)
    "chunked prefill": dict(num_blocks=64, max_num_batched_tokens=7),
    "recompute, tiny pool": dict(num_blocks=10, max_num_seqs=8, max_num_batched_tokens=32, block_size=8),
    "swap, tiny pool": dict(num_blocks=10, max_num_seqs=8, max_num_batched_tokens=32, block_size=8,
                            preemption_mode="swap"),
    "swap, no prefix caching": dict(num_blocks=6, max_num_seqs=8, max_num_batched_tokens=16, preemption_mode="swap",
                                    enable_prefix_caching=False),
}


@pytest.mark.parametrize("name", list(FEATURES))
def test_int8_under_chunking_and_preemption_equals_generate(embedded, long_references, name):
    """The four prompts, 40 tokens, through chunked prefill, prefix-cache hits, preemption by recompute and by swap."""
    model, tokenizer = embedded
    llm = LLM(model, tokenizer, kv_cache_dtype="int8", **FEATURES[name])
    got = _tokens(llm, AGREE, 40)
    assert got == [ref[:40] for ref in long_references], f"{name}: int8 differs from generate"
    engine = llm.llm_engine
    if "tiny pool" in name or "swap" in name:
        assert engine.scheduler.num_preemptions > 0, f"{name} is meant to force preemptions"
    if "recompute" in name:
        assert engine.kv_cache_manager.preempted_hits > 0, "recomputed requests hit their own cached int8 blocks"
    if "swap" in name:
        assert engine.swap_space.blocks_swapped_out > 0 and engine.swap_space.blocks_swapped_in > 0
        assert len(engine.swap_space.blocks) == 4 * engine.cache.num_layers, "K, V and both scales go to the CPU pool"
    assert_pool_empty(engine)


def test_int8_n_completions_share_the_prompt(embedded):
    """n = 4 seeded samples of one prompt: the children share its cached int8 blocks and give them all back."""
    model, tokenizer = embedded
    llm = LLM(model, tokenizer, num_blocks=64, kv_cache_dtype="int8")
    out = llm.generate(AGREE[1], SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=1))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3] and all(len(c.token_ids) == 12 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "different seeds per completion"
    assert llm.llm_engine.kv_cache_manager.hits > 0, "completions after the first hit the prompt's cached blocks"
    assert_pool_empty(llm.llm_engine)


def test_int8_beam_search_builds_an_int8_cache_and_copies_scales(embedded, monkeypatch):
    """LLM.beam_search on an int8 LLM: an int8 pool, transformers' beams, copy-on-write copies, every block back."""
    model, tokenizer = embedded
    llm = LLM(model, tokenizer, num_blocks=64, kv_cache_dtype="int8")
    built = []
    for_model = PagedKVCache.for_model.__func__

    def spy(cls, *args, **kwargs):
        built.append(for_model(cls, *args, **kwargs))
        return built[-1]

    monkeypatch.setattr(PagedKVCache, "for_model", classmethod(spy))
    prompt = "OTHELLO.\n"
    out = llm.beam_search([prompt], BeamSearchParams(beam_width=4, max_tokens=10))[0]
    assert [c.kv_cache_dtype for c in built] == ["int8"], "beam search builds its pool in the engine's kv_cache_dtype"
    ref = reference_beam_search(model, tokenizer(prompt)["input_ids"], 4, 10)
    assert [c.token_ids for c in out.outputs] == [t for t, _ in ref]
    # Measured 0.003 between int8's and transformers' scores (sums of 10 log-probabilities).
    assert all(abs(c.cumulative_logprob - s) < 0.02 for c, (_, s) in zip(out.outputs, ref))

    search = BeamSearch(model, tokenizer(prompt)["input_ids"], 4, 10, kv_cache_dtype="int8")
    while not search.done:
        search.step()
    assert [t for t, _ in search.results()] == [t for t, _ in ref]
    assert search.counters["copies"] > 0, "set-up: the search copied partly filled blocks (with their scales)"
    assert search.manager.num_used_blocks == 0, "a finished search holds no blocks"


# ----- the Triton decode kernel on 8-bit pools, in the interpreter on CPU -----

TINY_PROMPTS = [[5, 9, 13, 2, 7], [11, 3], [4, 4, 8, 15, 16, 23, 42, 1, 6]]


def _tiny_run(model, kv_cache_dtype, attention_backend):
    """Three greedy requests of 8 tokens on a pool of 7 blocks of 4: one swap preemption on the way."""
    engine = LLMEngine(model, None, block_size=4, num_blocks=7, max_num_seqs=4, max_num_batched_tokens=16,
                       preemption_mode="swap", attention_backend=attention_backend, kv_cache_dtype=kv_cache_dtype)
    for i, prompt in enumerate(TINY_PROMPTS):
        engine.add_request(i, prompt, greedy(8))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert engine.scheduler.num_preemptions > 0 and engine.swap_space.blocks_swapped_in > 0, "set-up: a swap happened"
    assert_pool_empty(engine)
    return [done[str(i)] for i in range(len(TINY_PROMPTS))], engine


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_the_triton_kernel_decodes_8_bit_pools_like_the_torch_path(kv_cache_dtype):
    """Same tokens from the kernel (raw 8-bit pools + k_scale / v_scale) as from batched torch; int8 also = generate.

    On a GPU machine the kernels are compiled, so the model and pools go to CUDA (and the swap crosses PCIe).
    """
    model = make_tiny_model("llama").to("cpu" if kvlab.kernels.RUNS_IN_INTERPRETER else "cuda")
    torch_tokens, _ = _tiny_run(model, kv_cache_dtype, "torch")
    triton_tokens, engine = _tiny_run(model, kv_cache_dtype, "triton")
    assert engine.cache.attention_backend == "triton" and engine.cache.k_pools[0].element_size() == 1
    assert triton_tokens == torch_tokens
    if kv_cache_dtype == "int8":
        assert triton_tokens == [reference_generate(model, p, 8) for p in TINY_PROMPTS]


# ----- the pool size and bad names -----

def test_the_same_bytes_hold_proportionally_more_8_bit_blocks(embedded):
    """kv_cache_memory fixed: about 4x the float32 blocks and about 2x the float16 blocks, less the scales."""
    model, tokenizer = embedded
    budget = 8 << 20
    engines = {dt: LLMEngine(model, tokenizer, kv_cache_memory=budget, kv_cache_dtype=dt)
               for dt in ("auto", "int8", "fp8")}
    assert {dt: e.num_blocks for dt, e in engines.items()} == {"auto": 128, "int8": 510, "fp8": 510}
    for dt, e in engines.items():
        stored = {"auto": "float32", "int8": "int8", "fp8": "fp8_e4m3"}[dt]
        assert e.block_bytes == block_bytes(model.config, stored, 16), "one formula sizes the pool"
        assert e.cache.nbytes == e.num_blocks * e.block_bytes <= budget, "the pool the engine built obeys it"
    assert engines["int8"].num_blocks / engines["auto"].num_blocks == pytest.approx(65536 / 16448, rel=0.01)

    half = make_tiny_model("llama").to(torch.float16)  # 2 layers, 2 KV heads, head dim 16
    fp16, int8 = (LLMEngine(half, None, kv_cache_memory=1 << 20, kv_cache_dtype=dt) for dt in ("auto", "int8"))
    assert fp16.cache.k_pools[0].dtype == torch.float16 and fp16.block_bytes == 16 * 2 * 2 * 2 * 16 * 2 == 4096
    assert int8.block_bytes == 2 * 2 * 2 * (16 * 16 + 4) == 2080
    assert (fp16.num_blocks, int8.num_blocks) == (256, 504) and 1.9 < int8.num_blocks / fp16.num_blocks < 2


@pytest.mark.parametrize("bad", ["float16", "int4", "fp8_e5m2", "INT8", None])
def test_a_bad_kv_cache_dtype_raises_before_anything_is_allocated(embedded, monkeypatch, bad):
    """A ValueError listing the choices, before a pool, a block manager or (for LLM) a model is made."""
    import kvlab.cache.kv_storage
    import kvlab.engine.llm_engine
    import kvlab.model.loader

    model, tokenizer = embedded

    def forbidden(*args, **kwargs):
        raise AssertionError("something was allocated before kv_cache_dtype was checked")

    monkeypatch.setattr(kvlab.cache.kv_storage.KVStorage, "__init__", forbidden)
    monkeypatch.setattr(kvlab.engine.llm_engine, "KVCacheManager", forbidden)
    monkeypatch.setattr(kvlab.model.loader, "load_model", forbidden)
    for make in (lambda: LLMEngine(model, tokenizer, kv_cache_dtype=bad),
                 lambda: LLM(model, tokenizer, kv_cache_dtype=bad),
                 lambda: LLM(kv_cache_dtype=bad)):
        with pytest.raises(ValueError, match=r"unsupported kv_cache_dtype .*one of auto, int8, fp8, fp8_e4m3"):
            make()
