"""Chapter 6: the continuous-batching engine equals transformers' generate under any batch, chunk and preemption."""

import random

import pytest

from conftest import make_tiny_model
from kvlab import LLM, BeamSearchParams, SamplingParams
from kvlab.baselines.transformers_generate import reference_beam_search, reference_generate
from kvlab.engine.llm_engine import LLMEngine

PROMPTS = ["OTHELLO.\n", "HAMLET.\nTo be, or not", "KING LEAR.\nNothing will come of nothing.\n",
           "ROMEO.\n", "JULIET.\nO Romeo, Romeo", "MACBETH.\nIs this a dagger", "PORTIA.\n"]
MAX_TOKENS = [40, 25, 30, 48, 12, 36, 20]


@pytest.fixture(scope="module")
def references(embedded):
    model, tokenizer = embedded
    return [reference_generate(model, tokenizer(p)["input_ids"], n) for p, n in zip(PROMPTS, MAX_TOKENS)]


def greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def assert_pool_empty(engine):
    manager = engine.kv_cache_manager
    assert manager.num_free_blocks == engine.num_blocks, (
        f"{engine.num_blocks - manager.num_free_blocks} blocks still held after every request finished")
    assert all(b.ref_cnt == 0 for b in manager.block_pool.blocks), "a finished engine holds no references"
    if engine.swap_space is not None:
        assert engine.scheduler.num_free_cpu_blocks == engine.scheduler.num_cpu_blocks, "CPU blocks leaked"


def record_schedules(engine) -> list[list[tuple[str, int, int]]]:
    """Keep every step's SchedulerOutput as (request id, first new position, new tokens) per scheduled request."""
    steps = []
    schedule = engine.scheduler.schedule

    def recorded():
        out = schedule()
        # Before the update, num_computed_tokens is where this step's new tokens start.
        requests = engine.requests
        steps.append([(rid, requests[rid].num_computed_tokens, n) for rid, n in out.num_scheduled_tokens.items()])
        return out

    engine.scheduler.schedule = recorded
    return steps


def prompt_chunks(steps, request_id, prompt_len) -> list[tuple[int, int]]:
    """The (start, end) positions of a request's prompt computed in each step, in order (recomputes included)."""
    return [(start, start + n) for step in steps for rid, start, n in step if rid == request_id and start < prompt_len]


CONFIGS = {
    # name: engine arguments; the small pools force preemptions
    "roomy": dict(num_blocks=64, max_num_seqs=8, max_num_batched_tokens=256),
    "one at a time": dict(num_blocks=64, max_num_seqs=1, max_num_batched_tokens=256),
    "chunked prefill": dict(num_blocks=64, max_num_seqs=8, max_num_batched_tokens=7),
    "recompute, tiny pool": dict(num_blocks=10, max_num_seqs=8, max_num_batched_tokens=32, block_size=8),
    "swap, tiny pool": dict(num_blocks=10, max_num_seqs=8, max_num_batched_tokens=32, block_size=8,
                            preemption_mode="swap"),
    "swap, no prefix caching": dict(num_blocks=6, max_num_seqs=8, max_num_batched_tokens=16, block_size=16,
                                    preemption_mode="swap", enable_prefix_caching=False),
    "swap space too small": dict(num_blocks=10, max_num_seqs=8, max_num_batched_tokens=32, block_size=8,
                                 preemption_mode="swap", num_cpu_blocks=3),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_equals_generate(embedded, references, name):
    model, tokenizer = embedded
    llm = LLM(model, tokenizer, **CONFIGS[name])
    steps = record_schedules(llm.llm_engine)
    outs = llm.generate(PROMPTS, [greedy(n) for n in MAX_TOKENS])
    assert [o.prompt for o in outs] == PROMPTS, "one output per prompt, in the prompts' order"
    for prompt, out, ref in zip(PROMPTS, outs, references):
        assert out.outputs[0].token_ids == ref, f"{name}: {prompt!r} differs from transformers' generate"
        assert out.outputs[0].text == tokenizer.decode(ref) and out.outputs[0].finish_reason == "length"
    engine = llm.llm_engine
    if "tiny pool" in name or "swap" in name:
        assert engine.scheduler.num_preemptions > 0, f"{name} is meant to force preemptions"
    if name.startswith("swap,"):
        assert engine.swap_space.blocks_swapped_out > 0 and engine.swap_space.blocks_swapped_in > 0
    for entry in engine.history:
        assert entry.batched_tokens <= CONFIGS[name]["max_num_batched_tokens"], "the token budget holds every step"
        running = sum(s == "running" for s in entry.status.values())
        assert running <= CONFIGS[name]["max_num_seqs"]
    if name == "chunked prefill":
        assert any(len(e.prefill) and e.tokens[e.prefill[0]] < 7 or e.batched_tokens == 7 for e in engine.history)
        assert all(sum(n for *_, n in step) <= 7 for step in steps), "no SchedulerOutput holds more than the budget"
        assert engine.scheduler.num_preemptions == 0, "64 blocks are roomy: every prompt is computed once"
        lengths = {rid: len(req.prompt_token_ids) for rid, req in engine.requests.items()}
        assert sum(P > 7 for P in lengths.values()) >= 3, "set-up: several prompts are longer than the budget"
        for rid, P in lengths.items():
            chunks = prompt_chunks(steps, rid, P)
            assert len(chunks) >= -(-P // 7) and (P <= 7 or len(chunks) >= 2), (
                f"{rid}: a prompt of {P} tokens under a budget of 7 is split over several steps, got {chunks}")
            assert all(end - start <= 7 for start, end in chunks), f"{rid}: chunks of at most 7 tokens, got {chunks}"
            assert [start for start, _ in chunks] == [0] + [end for _, end in chunks[:-1]] and chunks[-1][1] == P, (
                f"{rid}: each chunk starts where the one before ended, and the last ends the prompt: {chunks}")
    assert_pool_empty(engine)


def test_one_forward_pass_per_step_mixes_prefill_and_decode(embedded):
    model, tokenizer = embedded
    engine = LLMEngine(model, tokenizer, num_blocks=32, max_num_batched_tokens=64)
    engine.add_request("a", PROMPTS[0], greedy(10))
    engine.step()
    engine.add_request("b", PROMPTS[2], greedy(10))
    before = engine.model_runner.num_forward_passes
    engine.step()
    assert engine.model_runner.num_forward_passes == before + 1, "the whole mixed batch is one forward pass"
    last = engine.history[-1]
    assert last.tokens["a"] == 1 and last.tokens["b"] == len(tokenizer(PROMPTS[2])["input_ids"])
    assert last.prefill == ("b",), "a decodes while b prefills, in the same pass"


def test_long_prompt_is_prefilled_in_chunks(embedded, references):
    model, tokenizer = embedded
    engine = LLMEngine(model, tokenizer, num_blocks=32, max_num_batched_tokens=8)
    steps = record_schedules(engine)
    engine.add_request("long", PROMPTS[2], greedy(MAX_TOKENS[2]))
    outs = []
    first_token_step = None
    while engine.has_unfinished_requests():
        outs += engine.step()
        if outs and first_token_step is None:
            first_token_step = engine.step_count
    chunks = [e.tokens["long"] for e in engine.history if "long" in e.prefill]
    P = len(tokenizer(PROMPTS[2])["input_ids"])
    assert sum(chunks) == P and max(chunks) == 8, f"prompt of {P} tokens in chunks of at most 8, got {chunks}"
    assert outs[-1].outputs[0].token_ids == references[2]
    # What the scheduler handed out, step by step: the prompt split into budget-sized chunks, in order.
    positions = prompt_chunks(steps, "long", P)
    expected = [(start, min(start + 8, P)) for start in range(0, P, 8)]
    assert P > 8 and positions == expected, (
        f"a {P}-token prompt under a budget of 8 runs as chunks of 8 (the last one shorter) in "
        f"{len(expected)} consecutive steps; the scheduler gave {positions}")
    assert all(len(step) == 1 and step[0][2] <= 8 for step in steps), "every SchedulerOutput stays within the budget"
    assert first_token_step == len(expected), "the first token is sampled at the end of the last chunk, not before"


def test_stop_tokens_and_eos(embedded, references):
    model, tokenizer = embedded
    llm = LLM(model, tokenizer, num_blocks=32)
    ref = references[0]
    stop = ref[5]
    first = ref.index(stop)
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop]))[0]
    assert out.outputs[0].token_ids == ref[:first + 1] and out.outputs[0].finish_reason == "stop"
    assert_pool_empty(llm.llm_engine)


def test_seeded_sampling_does_not_depend_on_the_batch(embedded):
    model, tokenizer = embedded
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=20, max_tokens=30, seed=7)
    alone = LLM(model, tokenizer, num_blocks=64).generate(PROMPTS[1], params)[0].outputs[0].token_ids
    crowd = LLM(model, tokenizer, num_blocks=64, max_num_batched_tokens=16).generate(
        PROMPTS, [params if i == 1 else SamplingParams(temperature=1.0, max_tokens=20, seed=i)
                  for i in range(len(PROMPTS))])
    assert crowd[1].outputs[0].token_ids == alone, "a seed fixes a request's samples whatever shares its batch"
    again = LLM(model, tokenizer, num_blocks=64).generate(PROMPTS[1], params)[0].outputs[0].token_ids
    assert again == alone


def test_top_k_one_is_greedy(embedded, references):
    model, tokenizer = embedded
    out = LLM(model, tokenizer, num_blocks=64).generate(
        PROMPTS[0], SamplingParams(temperature=1.5, top_k=1, max_tokens=40, ignore_eos=True, seed=3))[0]
    assert out.outputs[0].token_ids == references[0]


def test_n_completions_share_the_prompt(embedded):
    model, tokenizer = embedded
    llm = LLM(model, tokenizer, num_blocks=64, enable_prefix_caching=True)
    out = llm.generate(PROMPTS[2], SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=1))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3] and all(len(c.token_ids) == 12 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "different seeds per completion"
    assert llm.llm_engine.kv_cache_manager.hits > 0, "completions after the first hit the prompt's cached blocks"
    assert_pool_empty(llm.llm_engine)


def test_beam_search_through_llm(embedded):
    model, tokenizer = embedded
    llm = LLM(model, tokenizer, num_blocks=64)
    out = llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=4, max_tokens=10))[0]
    ref = reference_beam_search(model, tokenizer(PROMPTS[0])["input_ids"], 4, 10)
    assert [c.token_ids for c in out.outputs] == [t for t, _ in ref]
    assert all(abs(c.cumulative_logprob - s) < 1e-4 for c, (_, s) in zip(out.outputs, ref))


def test_abort_frees_everything(embedded):
    model, tokenizer = embedded
    engine = LLMEngine(model, tokenizer, num_blocks=10, block_size=8, max_num_batched_tokens=32, preemption_mode="swap")
    for i, p in enumerate(PROMPTS[:4]):
        engine.add_request(i, p, greedy(30))
    for _ in range(12):
        engine.step()
    states = {rid: r.status.value for rid, r in engine.requests.items()}
    for rid in list(engine.parents):
        if not engine.requests[rid].status.finished:
            out = engine.abort_request(rid)
            assert out.finished and out.outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests(), states
    assert_pool_empty(engine)


BAD_PARAMS = [
    (dict(temperature=-0.5), "temperature must be a finite number >= 0"),
    (dict(max_tokens=0), "max_tokens must be a positive integer"),
    (dict(top_p=0.0), "top_p must be in"),
    (dict(top_k=-3), "top_k must be"),
    (dict(n=0), "n must be a positive integer"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
]


@pytest.mark.parametrize("kwargs,message", BAD_PARAMS)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_bad_requests_leave_the_engine_serving(embedded, references):
    model, tokenizer = embedded
    engine = LLMEngine(model, tokenizer, num_blocks=12, block_size=16, max_model_len=256)
    engine.add_request("good", PROMPTS[0], greedy(MAX_TOKENS[0]))
    engine.step()
    bad = [
        (("empty", ""), "empty prompt"),
        (("empty ids", []), "empty prompt"),
        (("long", "x" * 300), "leaves no room"),
        (("vocab", [5, 9999]), "outside the vocabulary"),
        (("never", "OTHELLO.\n", greedy(240)), "can never fit"),
        (("good", "again"), "already in use"),
        (("params", "hi", {"temperature": 0}), "must be a SamplingParams"),
    ]
    for args, message in bad:
        with pytest.raises(ValueError, match=message):
            engine.add_request(*args)
    for rid, message in [("nobody", "no request 'nobody'")]:
        with pytest.raises(ValueError, match=message):
            engine.abort_request(rid)
    assert list(engine.parents) == ["good"], "a rejected request leaves no trace"
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].outputs[0].token_ids == references[0], "the good request is served as if nothing happened"
    with pytest.raises(ValueError, match="already finished"):
        engine.abort_request("good")
    assert_pool_empty(engine)


def test_bad_engine_arguments(embedded):
    model, tokenizer = embedded
    for kwargs, message in [
        (dict(preemption_mode="drop"), "preemption_mode must be"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
        (dict(num_blocks=4, kv_cache_memory=10**6), "not both"),
        (dict(kv_cache_memory=10), "at least one block"),
        (dict(max_model_len=10**6), "beyond the model's context"),
        (dict(block_size=0), "block_size"),
    ]:
        with pytest.raises(ValueError, match=message):
            LLMEngine(model, tokenizer, **kwargs)


def test_memory_budget_sets_the_pool(embedded):
    model, tokenizer = embedded
    engine = LLMEngine(model, tokenizer, block_size=16, kv_cache_memory=1 << 20)
    per_token = 2 * 4 * 2 * 64 * 4  # K and V x 4 layers x 2 KV heads x head_dim 64 x fp32
    assert engine.num_blocks == (1 << 20) // (16 * per_token) == 16


# ----- fuzz: random traces on a tiny model, requests joining mid-run, random aborts -----

@pytest.fixture(scope="module")
def tiny():
    return make_tiny_model("llama")


@pytest.fixture(scope="module")
def tiny_refs():
    return {}


def _tiny_ref(tiny, cache, prompt, n):
    key = (tuple(prompt), n)
    if key not in cache:
        cache[key] = reference_generate(tiny, prompt, n)
    return cache[key]


@pytest.mark.parametrize("seed", range(int(__import__("os").environ.get("KVLAB_FUZZ_SEEDS", "30"))))
def test_fuzz_random_traces(tiny, tiny_refs, seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8, 16])
    num_requests = rng.randint(3, 9)
    # Shared prefixes sometimes, so prefix caching has something to hit.
    stem = [rng.randrange(1, 97) for _ in range(rng.randint(0, 12))]
    requests = []
    for i in range(num_requests):
        prompt = stem[:rng.randint(0, len(stem))] + [rng.randrange(1, 97) for _ in range(rng.randint(1, 20))]
        requests.append((f"r{i}", prompt, rng.randint(1, 24), rng.randint(0, 15)))  # id, prompt, max_tokens, arrival
    longest = max(len(p) + n for _, p, n, _ in requests)
    min_blocks = -(-longest // block_size)
    kwargs = dict(block_size=block_size, num_blocks=rng.randint(min_blocks, 3 * min_blocks),
                  max_num_seqs=rng.randint(1, 6), max_num_batched_tokens=rng.randint(1, 40),
                  enable_prefix_caching=rng.random() < 0.6, preemption_mode=rng.choice(["recompute", "swap"]))
    if kwargs["preemption_mode"] == "swap":
        kwargs["num_cpu_blocks"] = rng.randint(0, 2 * min_blocks)
    engine = LLMEngine(tiny, None, **kwargs)
    to_abort = {rid for rid, *_ in requests if rng.random() < 0.15}
    finished: dict[str, list] = {}
    step = 0
    while step < 2000:
        for rid, prompt, n, arrival in requests:
            if arrival == step:
                engine.add_request(rid, prompt, greedy(n))
        if step > 15 and not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finished, f"{out.request_id} finished twice ({kwargs})"
                finished[out.request_id] = out.outputs[0]
        for rid in to_abort:
            if rid in engine.parents and rng.random() < 0.2 and not engine.requests[rid].status.finished:
                finished[rid] = engine.abort_request(rid).outputs[0]
        step += 1
    assert set(finished) == {rid for rid, *_ in requests}, \
        f"lost requests {set(engine.parents) - set(finished)} ({kwargs})"
    for rid, prompt, n, _ in requests:
        got = finished[rid]
        ref = _tiny_ref(tiny, tiny_refs, prompt, n)
        if got.finish_reason == "abort":
            assert got.token_ids == ref[:len(got.token_ids)], f"{rid}: tokens before the abort must be right ({kwargs})"
        else:
            assert got.token_ids == ref, f"{rid} differs from generate with {kwargs}"
    assert_pool_empty(engine)


def test_recompute_counts_only_lost_tokens(embedded):
    model, tokenizer = embedded
    engine = LLMEngine(model, tokenizer, block_size=8, num_blocks=10, max_num_seqs=8, max_num_batched_tokens=32,
                       enable_prefix_caching=False)
    for i, (p, n) in enumerate(zip(PROMPTS, MAX_TOKENS)):
        engine.add_request(i, p, greedy(n))
    while engine.has_unfinished_requests():
        engine.step()
    useful = sum(len(tokenizer(p)["input_ids"]) + n - 1 for p, n in zip(PROMPTS, MAX_TOKENS))
    assert engine.scheduler.num_preemptions > 0
    assert engine.num_tokens_computed == useful + engine.scheduler.num_recomputed_tokens, (
        "every token position runs once, plus once more for each one a recompute preemption threw away")


def test_default_pool_is_capped(embedded, monkeypatch):
    import kvlab.engine.kv_cache_utils

    model, tokenizer = embedded
    engine = LLMEngine(model, tokenizer, max_num_seqs=4)
    assert engine.num_blocks == 4 * 256 // 16, "four full contexts of the small model fit under the cap"
    monkeypatch.setattr(kvlab.engine.kv_cache_utils, "DEFAULT_POOL_BYTES", 1 << 20)
    big = LLMEngine(model, tokenizer, max_num_seqs=1000)
    assert big.num_blocks * big.block_bytes <= 1 << 20 and big.num_blocks == 16
