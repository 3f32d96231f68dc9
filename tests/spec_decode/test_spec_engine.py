"""Speculative decoding on kvlab's engine: greedy output is the target's, token for token, under every engine feature;
sampled output follows the target's distribution; blocks are never leaked; metrics carry vLLM's names."""

import math
import random

import pytest
import torch

from conftest import make_tiny_model
from kvlab import LLM, SamplingParams, load_model
from kvlab.baselines.transformers_generate import reference_generate, reference_speculative_generate
from kvlab.engine.llm_engine import LLMEngine
from kvlab.paths import DEFAULT_DRAFT_MODEL_DIR

PROMPTS = ["OTHELLO.\n", "HAMLET.\nTo be, or not to be", "KING LEAR.\nNothing will come of nothing.\n",
           "FIRST CITIZEN.\nSpeak, speak.\n\nFIRST CITIZEN.\nSpeak, speak.\n\nFIRST CITIZEN.\n", "ROMEO.\n"]
MAX_TOKENS = [40, 30, 36, 44, 24]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
DRAFT = {"method": "draft_model", "num_speculative_tokens": 3}


def greedy(n, **kwargs):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kwargs)


@pytest.fixture(scope="module")
def draft():
    model, _ = load_model(DEFAULT_DRAFT_MODEL_DIR)
    return model


@pytest.fixture(scope="module")
def references(embedded):
    model, tokenizer = embedded
    return [reference_generate(model, tokenizer(p)["input_ids"], n) for p, n in zip(PROMPTS, MAX_TOKENS)]


def assert_pool_empty(engine):
    manager = engine.kv_cache_manager
    assert manager.num_free_blocks == engine.num_blocks, \
        f"{engine.num_blocks - manager.num_free_blocks} blocks still held after every request finished"
    assert all(b.ref_cnt == 0 for b in manager.block_pool.blocks)
    if engine.swap_space is not None:
        assert engine.scheduler.num_free_cpu_blocks == engine.scheduler.num_cpu_blocks, "CPU blocks leaked"


ENGINE_CASES = {
    "roomy": dict(block_size=16, num_blocks=64),
    "chunked prefill, budget 8": dict(block_size=4, num_blocks=120, max_num_batched_tokens=8),
    "no prefix caching": dict(block_size=4, num_blocks=120, enable_prefix_caching=False),
    "recompute preemption": dict(block_size=4, num_blocks=32, max_num_batched_tokens=32),
    "swap preemption": dict(block_size=4, num_blocks=32, preemption_mode="swap", max_num_batched_tokens=32),
    "block size 1": dict(block_size=1, num_blocks=160, max_num_seqs=3),
}


@pytest.mark.parametrize("case", ENGINE_CASES, ids=list(ENGINE_CASES))
@pytest.mark.parametrize("spec", [NGRAM, DRAFT], ids=["ngram", "draft_model"])
def test_greedy_speculation_equals_generate(embedded, draft, references, case, spec):
    model, tokenizer = embedded
    spec = dict(spec, model=draft) if spec["method"] == "draft_model" else spec
    llm = LLM(model, tokenizer, speculative_config=spec, **ENGINE_CASES[case])
    outputs = llm.generate(PROMPTS, [greedy(n) for n in MAX_TOKENS])
    for out, ref in zip(outputs, references):
        assert out.outputs[0].token_ids == ref, \
            f"{case}, {spec['method']}: {out.prompt!r} differs from transformers' greedy generate"
    engine = llm.llm_engine
    assert engine.spec_stats.num_drafts > 0, "the run never speculated: the test would prove nothing"
    if "preemption" in case:
        assert engine.scheduler.num_preemptions > 0, f"{case} must preempt to test rollback across preemption"
    assert_pool_empty(engine)


@pytest.mark.parametrize("k", [1, 2, 5])
def test_equal_to_transformers_own_speculative_generate(embedded, draft, k):
    model, tokenizer = embedded
    ngram = LLM(model, tokenizer, block_size=8, num_blocks=128,
                speculative_config={"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3,
                                    "prompt_lookup_min": 1})
    drafted = LLM(model, tokenizer, block_size=8, num_blocks=128,
                  speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": k})
    for prompt, n in zip(PROMPTS[:3], MAX_TOKENS):
        ids = tokenizer(prompt)["input_ids"]
        lookup = reference_speculative_generate(model, ids, n, prompt_lookup_num_tokens=k)
        assisted = reference_speculative_generate(model, ids, n, assistant_model=draft)
        assert ngram.generate([ids], greedy(n))[0].outputs[0].token_ids == lookup, \
            f"k={k}: differs from generate(prompt_lookup_num_tokens={k})"
        assert drafted.generate([ids], greedy(n))[0].outputs[0].token_ids == assisted, \
            "differs from generate(assistant_model=draft)"


def calibrated_scales(cache, margin=1.5):
    """Per layer, one K and one V scale above every dynamic scale the run needed: static scales, as vLLM's fp8."""
    storage = cache.storage
    return [(float(storage.k_scales[i].max()) * margin, float(storage.v_scales[i].max()) * margin)
            for i in range(storage.num_layers)]


@pytest.mark.parametrize("spec", [NGRAM, DRAFT], ids=["ngram", "draft_model"])
def test_eight_bit_kv_with_speculation(embedded, spec):
    """With static scales every token is quantised on its own, so speculation changes nothing: equal outputs.

    With kvlab's dynamic per-block scales a rejected draft's K/V may have grown its block's scale before
    they are rolled back, and later tokens are rounded on that scale: a few late tokens can differ, as
    they can when only the chunk size changes. Both run, and leave the pool empty.
    """
    model, tokenizer = embedded
    params = [greedy(n) for n in MAX_TOKENS]
    dynamic = LLM(model, tokenizer, block_size=8, num_blocks=64, kv_cache_dtype="int8", speculative_config=spec)
    first = [o.outputs[0].token_ids for o in dynamic.generate(PROMPTS, params)]
    assert dynamic.llm_engine.spec_stats.num_drafts > 0
    assert_pool_empty(dynamic.llm_engine)
    caches = [dynamic.llm_engine.cache] + ([dynamic.llm_engine.drafter.cache] if spec is DRAFT else [])
    scales = [calibrated_scales(c) for c in caches]

    def run(**engine_args):
        llm = LLM(model, tokenizer, block_size=8, num_blocks=64, kv_cache_dtype="int8", **engine_args)
        engine = llm.llm_engine
        mine = [engine.cache] + ([engine.drafter.cache] if "speculative_config" in engine_args and spec is DRAFT
                                 else [])
        for cache, layers in zip(mine, scales):
            for layer, (k_scale, v_scale) in enumerate(layers):
                cache.storage.set_scales(layer, k_scale, v_scale)
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]

    assert run(speculative_config=spec) == run(), "8-bit speculation with static scales must equal 8-bit decoding"
    plain = LLM(model, tokenizer, block_size=8, num_blocks=64, kv_cache_dtype="int8")
    without = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params)]
    assert all(a[:8] == b[:8] for a, b in zip(first, without)), "dynamic scales may differ late, never at once"


def test_stop_tokens_end_the_output_even_inside_accepted_drafts(embedded, references):
    model, tokenizer = embedded
    ref = references[3]  # the repetitive prompt: n-gram drafts are accepted in runs
    stop = ref[20]
    llm = LLM(model, tokenizer, block_size=4, num_blocks=64, speculative_config=dict(NGRAM, num_speculative_tokens=6))
    out = llm.generate([PROMPTS[3]], greedy(MAX_TOKENS[3], stop_token_ids=[stop]))[0].outputs[0]
    first = ref.index(stop)
    assert out.token_ids == ref[:first + 1] and out.finish_reason == "stop"
    assert_pool_empty(llm.llm_engine)


def test_max_tokens_and_max_model_len_are_never_passed(embedded):
    model, tokenizer = embedded
    llm = LLM(model, tokenizer, block_size=4, num_blocks=80, max_model_len=120,
              speculative_config=dict(NGRAM, num_speculative_tokens=6))
    prompt = tokenizer(PROMPTS[3] * 2)["input_ids"][:100]
    short, long = llm.generate([prompt, prompt], [greedy(7), greedy(60)])
    assert len(short.outputs[0].token_ids) == 7, "drafts must not push past max_tokens"
    assert len(prompt) + len(long.outputs[0].token_ids) == 120 and long.outputs[0].finish_reason == "length"
    assert_pool_empty(llm.llm_engine)


def test_n_completions_and_seeds_stay_reproducible(embedded):
    model, tokenizer = embedded

    def run(extra_prompts):
        llm = LLM(model, tokenizer, block_size=8, num_blocks=160, speculative_config=DRAFT)
        params = SamplingParams(n=3, temperature=0.9, max_tokens=30, seed=11)
        others = [SamplingParams(max_tokens=20)] * len(extra_prompts)
        outs = llm.generate([PROMPTS[1]] + extra_prompts, [params] + others)
        assert llm.llm_engine.spec_stats.num_drafts > 0
        assert_pool_empty(llm.llm_engine)
        return [c.token_ids for c in outs[0].outputs]

    alone, crowded = run([]), run(PROMPTS[2:4])
    assert alone == crowded, "a seeded request's samples must not depend on what else shares its batch"
    assert len({tuple(t) for t in alone}) > 1, "three seeded completions should differ"


def test_metrics_use_vllm_names_and_add_up(embedded):
    model, tokenizer = embedded
    llm = LLM(model, tokenizer, block_size=8, num_blocks=64, speculative_config=dict(NGRAM, num_speculative_tokens=4))
    outputs = llm.generate(PROMPTS, [greedy(n) for n in MAX_TOKENS])
    metrics = {m.name: m.value for m in llm.get_metrics()}
    for name in ["vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos",
                 "vllm:num_preemptions", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
                 "vllm:prompt_tokens", "vllm:generation_tokens"]:
        assert name in metrics, f"{name} is missing from get_metrics()"
    assert metrics["vllm:generation_tokens"] == sum(len(o.outputs[0].token_ids) for o in outputs)
    assert metrics["vllm:prompt_tokens"] == sum(len(o.prompt_token_ids) for o in outputs)
    per_pos = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_pos) == 4 and sum(per_pos) == metrics["vllm:spec_decode_num_accepted_tokens"]
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:])), "a later position is accepted only after earlier ones"
    assert 0 < metrics["vllm:spec_decode_num_accepted_tokens"] <= metrics["vllm:spec_decode_num_draft_tokens"]
    # Every target pass of a decoding request emits accepted drafts plus one: the forward-pass count shows it.
    emitted = metrics["vllm:generation_tokens"]
    assert llm.llm_engine.model_runner.num_forward_passes < max(MAX_TOKENS) + 5 < emitted


def test_bad_speculative_configs_leave_nothing_half_built(embedded, tiny_model_dirs):
    model, tokenizer = embedded
    with pytest.raises(ValueError, match="method must be one of"):
        LLM(model, tokenizer, speculative_config={"method": "medusa", "num_speculative_tokens": 2})
    other_vocab = make_tiny_model("llama")  # 97 tokens against the embedded model's 83
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(model, tokenizer, speculative_config={"method": "draft_model", "model": other_vocab,
                                                  "num_speculative_tokens": 2})
    with pytest.raises(FileNotFoundError):
        LLM(model, tokenizer, speculative_config={"method": "draft_model", "model": "/nonexistent/draft",
                                                  "num_speculative_tokens": 2})


def test_the_draft_pools_share_the_memory_budget(embedded):
    model, tokenizer = embedded
    budget = 2**20
    plain = LLMEngine(model, tokenizer, kv_cache_memory=budget)
    spec = LLMEngine(model, tokenizer, kv_cache_memory=budget, speculative_config=DRAFT)
    assert spec.num_blocks < plain.num_blocks, "the draft's K/V must be paid for from the same budget"
    assert spec.cache.nbytes + spec.drafter.cache.nbytes <= budget


# ----- random traces on tiny random models -----

def perturbed_copy(model, scale: float, seed: int):
    """The model with noise on every weight: a draft that agrees with it often, not always."""
    draft = make_tiny_model("llama")
    draft.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.std().clamp_min(1e-3))
    return draft


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_model("llama")


@pytest.mark.parametrize("seed", range(12))
def test_fuzz_speculative_traces(tiny, seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8])
    stem = [rng.randrange(1, 97) for _ in range(rng.randint(0, 10))]
    requests = []
    for i in range(rng.randint(3, 7)):
        # Repeats inside prompts give the n-gram proposer matches to find.
        body = [rng.randrange(1, 97) for _ in range(rng.randint(1, 8))]
        prompt = stem[:rng.randint(0, len(stem))] + body * rng.randint(1, 3)
        requests.append((f"r{i}", prompt, rng.randint(1, 20), rng.randint(0, 10)))
    longest = max(len(p) + n for _, p, n, _ in requests)
    min_blocks = -(-longest // block_size)
    k = rng.randint(1, 5)
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": rng.randint(1, 3),
            "prompt_lookup_min": 1}
    if rng.random() < 0.5:
        spec = {"method": "draft_model", "num_speculative_tokens": k,
                "model": perturbed_copy(tiny, rng.choice([0.0, 0.3, 1.0]), seed)}
    kwargs = dict(block_size=block_size, num_blocks=rng.randint(min_blocks, 3 * min_blocks),
                  max_num_seqs=rng.randint(1, 5), max_num_batched_tokens=rng.randint(1, 32),
                  enable_prefix_caching=rng.random() < 0.6, preemption_mode=rng.choice(["recompute", "swap"]))
    if kwargs["preemption_mode"] == "swap":
        kwargs["num_cpu_blocks"] = rng.randint(0, 2 * min_blocks)
    engine = LLMEngine(tiny, None, speculative_config=spec, **kwargs)
    to_abort = {rid for rid, *_ in requests if rng.random() < 0.15}
    finished = {}
    for step in range(3000):
        for rid, prompt, n, arrival in requests:
            if arrival == step:
                engine.add_request(rid, prompt, greedy(n))
        if step > 10 and not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finished, f"{out.request_id} finished twice ({kwargs}, {spec})"
                finished[out.request_id] = out.outputs[0]
        for rid in to_abort:
            if rid in engine.parents and rng.random() < 0.2 and not engine.requests[rid].status.finished:
                finished[rid] = engine.abort_request(rid).outputs[0]
        manager = engine.kv_cache_manager
        assert all(manager.num_draft_tokens(r) == 0 for r in manager.block_tables), "drafts left unverified"
        refs = {}
        for table in manager.block_tables.values():
            for b in table:
                refs[b] = refs.get(b, 0) + 1
        assert all(b.ref_cnt == refs.get(b.block_id, 0) for b in manager.block_pool.blocks), "ref counts drifted"
    assert set(finished) == {rid for rid, *_ in requests}, f"lost requests ({kwargs}, {spec})"
    for rid, prompt, n, _ in requests:
        got, ref = finished[rid], reference_generate(tiny, prompt, n)
        if got.finish_reason == "abort":
            assert got.token_ids == ref[:len(got.token_ids)], f"{rid}: wrong tokens before the abort ({kwargs})"
        else:
            assert got.token_ids == ref, f"{rid} differs from generate with {kwargs}, {spec['method']} k={k}"
    assert_pool_empty(engine)


# ----- the distribution -----

def small_vocab_model(seed: int):
    import transformers

    config = transformers.LlamaConfig(vocab_size=6, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                      max_position_embeddings=32, pad_token_id=0, eos_token_id=None, bos_token_id=None)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # sharper logits than the random init's, so draft and target really differ
        model.lm_head.weight.mul_(8.0)
    return model


def chi_square_p_value(counts, probs) -> float:
    expected = probs * counts.sum()
    stat = float(((counts - expected) ** 2 / expected).sum())
    dof = len(probs) - 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def speculated_p_values(method, use_draft_probs=True):
    """Chi-square p-values of tokens 2 and 3 (both from verifications) against the target's exact laws."""
    target, draft_model = small_vocab_model(1), small_vocab_model(2)
    prompt = [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]  # every token occurs: an n-gram match always exists

    def probs(ids):
        return torch.softmax(target(torch.tensor([ids])).logits[0, -1].double(), -1)

    with torch.no_grad():  # the exact laws of tokens 2 and 3, by enumerating what comes before them
        p1 = probs(prompt)
        law2, law3 = torch.zeros(6, dtype=torch.float64), torch.zeros(6, dtype=torch.float64)
        for t1 in range(6):
            p2 = probs(prompt + [t1])
            law2 += p1[t1] * p2
            for t2 in range(6):
                law3 += p1[t1] * p2[t2] * probs(prompt + [t1, t2])
    spec = {"method": "draft_model", "model": draft_model, "num_speculative_tokens": 2,
            "use_draft_probs": use_draft_probs} if method == "draft_model" \
        else {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    engine = LLMEngine(target, None, block_size=4, num_blocks=2000, max_num_seqs=512, max_num_batched_tokens=4096,
                       enable_prefix_caching=False, speculative_config=spec)
    draws = 3000
    for i in range(draws):
        engine.add_request(i, prompt, SamplingParams(temperature=1.0, max_tokens=4, seed=i))
    counts2, counts3 = torch.zeros(6, dtype=torch.float64), torch.zeros(6, dtype=torch.float64)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                counts2[out.outputs[0].token_ids[1]] += 1
                counts3[out.outputs[0].token_ids[2]] += 1
    stats = engine.spec_stats
    assert stats.num_drafts >= draws * 0.9, "tokens 2 and 3 must come out of verifications"
    assert stats.num_accepted_tokens_per_pos[1] > 0, "the second draft position must be accepted sometimes"
    return [(name, chi_square_p_value(counts, law), counts, law * draws)
            for name, counts, law in (("2", counts2, law2), ("3", counts3, law3))], stats


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_speculated_positions_follow_the_target_distribution(method):
    """Tokens 2 and 3 of each request come out of verifications; over many seeds their law must be the target's."""
    results, stats = speculated_p_values(method)
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, "the test needs accepted and rejected drafts"
    for name, p, counts, expected in results:
        assert p > 1e-3, (f"token {name} does not follow the target's law: counts {counts.tolist()} "
                          f"vs expected {expected.tolist()}, p = {p:.2g}")


def test_one_hot_verification_of_sampled_drafts_keeps_the_law_and_accepts_less():
    """use_draft_probs=False verifies as vLLM V1 (draft_probs=None): still the target's law, fewer drafts kept.

    A draft x ~ q is kept with probability p(x) instead of min(1, p(x) / q(x)); over x that is sum q p against
    sum min(p, q), never more.
    """
    results, one_hot = speculated_p_values("draft_model", use_draft_probs=False)
    for name, p, counts, expected in results:
        assert p > 1e-3, (f"one-hot verification: token {name} does not follow the target's law: counts "
                          f"{counts.tolist()} vs expected {expected.tolist()}, p = {p:.2g}")
    _, with_q = speculated_p_values("draft_model")
    assert one_hot.num_accepted_tokens < with_q.num_accepted_tokens, (
        f"one-hot kept {one_hot.num_accepted_tokens} drafts, q-based {with_q.num_accepted_tokens}: "
        "verifying with q should keep more of the same kind of drafts")


def test_a_sampler_that_keeps_drafts_would_be_caught(monkeypatch):
    """The test has power: an engine that accepts every draft token gives counts far from the target's law."""
    import kvlab.engine.model_runner as model_runner

    def keep_drafts(draft_token_ids, target_probs, draft_probs=None, generator=None):
        bonus = int(torch.multinomial(target_probs[-1].double(), 1, generator=generator))
        return [int(t) for t in draft_token_ids] + [bonus]

    monkeypatch.setattr(model_runner, "rejection_sample", keep_drafts)
    results, _ = speculated_p_values("draft_model")
    assert min(p for _, p, _, _ in results) < 1e-6, "the chi-square test cannot tell a broken sampler apart"
