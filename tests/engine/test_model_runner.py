"""Chapter 6's model runner: one ragged forward pass gives every request the logits it would get running alone, and
the runner learns everything from the scheduler's output (never from its Request objects)."""

import pytest
import torch

import kvlab.engine.model_runner as model_runner_module
from conftest import make_tiny_model
from kvlab.cache.paged_cache import PagedKVCache
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.engine.model_runner import ModelRunner
from kvlab.engine.request import Request
from kvlab.engine.sampling_params import SamplingParams
from kvlab.engine.scheduler import Scheduler

NUM_BLOCKS, BLOCK_SIZE = 16, 4


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_model("llama")


def alone(model, token_ids) -> torch.Tensor:
    """The logits of the last token when the request's tokens so far run through the model by themselves."""
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0, -1]


@pytest.fixture
def sampled_logits(monkeypatch):
    """The rows of logits the runner hands its sampler, step by step."""
    seen = []
    real = model_runner_module.sample

    def spy(logits, params, generators):
        seen.append(logits.clone())
        return real(logits, params, generators)

    monkeypatch.setattr(model_runner_module, "sample", spy)
    return seen


def test_one_ragged_step_matches_each_request_run_alone(tiny, sampled_logits):
    kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=False)
    cache = PagedKVCache.for_model(tiny, NUM_BLOCKS, BLOCK_SIZE, attention_backend="torch")
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=12)
    runner = ModelRunner(tiny, cache)
    params = SamplingParams(temperature=0, max_tokens=10)
    prompts = {"r0": [5, 17, 42, 8, 23], "r1": [60, 61, 2, 9, 33, 71, 4, 88, 15], "r2": [30, 12, 77]}
    requests = {rid: Request(rid, ids, params, i, None) for i, (rid, ids) in enumerate(prompts.items())}
    for request in requests.values():
        sched.add_request(request)

    # Step 1: r0's whole prompt (5 tokens) and the first 7 of r1's 9, in one pass.
    out = sched.schedule()
    assert list(out.num_scheduled_tokens.items()) == [("r0", 5), ("r1", 7)]
    assert [new.req_id for new in out.scheduled_new_reqs] == ["r0", "r1"], "both are new to the runner: sent in full"
    runner_out = runner.execute_model(out)
    assert runner_out.req_ids == ["r0", "r1"] and runner_out.sampled_token_ids[1] == [], (
        "a chunk that does not finish its prompt samples nothing")
    logits = sampled_logits[-1]
    assert logits.shape == (1, tiny.config.vocab_size), "only the rows that sample get logits: r0's last token"
    torch.testing.assert_close(logits[0], alone(tiny, prompts["r0"]), atol=1e-4, rtol=1e-4,
                               msg="a full prompt's row equals the prompt's last logits run alone")
    assert runner_out.sampled_token_ids[0] == [int(logits[0].argmax())]
    sched.update_from_output(out, runner_out)
    assert requests["r0"].output_token_ids == runner_out.sampled_token_ids[0]
    assert (requests["r0"].num_computed_tokens, requests["r1"].num_computed_tokens) == (5, 7)

    # Step 2: a decode (r0), the rest of a chunked prompt (r1) and a new prompt (r2): a ragged mix.
    out = sched.schedule()
    assert list(out.num_scheduled_tokens.items()) == [("r0", 1), ("r1", 2), ("r2", 3)]
    assert [new.req_id for new in out.scheduled_new_reqs] == ["r2"]
    assert out.scheduled_cached_reqs.req_ids == ["r0", "r1"], "known requests get only what changed"
    runner_out = runner.execute_model(out)
    logits = sampled_logits[-1]
    for row, rid in enumerate(["r0", "r1", "r2"]):
        torch.testing.assert_close(
            logits[row], alone(tiny, requests[rid].all_token_ids), atol=1e-4, rtol=1e-4,
            msg=lambda m, rid=rid: f"{rid}: its row of the ragged pass must equal running it alone\n{m}")
    assert runner.num_forward_passes == 2, "each step is one forward pass, whatever the mix of prefills and decodes"
    sched.update_from_output(out, runner_out)
    for rid in prompts:
        state = runner.requests[rid]
        assert state.token_ids == requests[rid].all_token_ids, f"{rid}: the runner's tokens are the scheduler's"
        assert state.block_ids == kv.get_block_ids(rid), f"{rid}: the runner's table is the KV cache manager's"
        assert state.num_computed_tokens == requests[rid].num_computed_tokens


def test_a_finished_request_is_forgotten_and_an_empty_step_runs_nothing(tiny):
    kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=12)
    runner = ModelRunner(tiny, PagedKVCache.for_model(tiny, NUM_BLOCKS, BLOCK_SIZE, attention_backend="torch"))
    sched.add_request(Request("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=1), 0, None))
    out = sched.schedule()
    sched.update_from_output(out, runner.execute_model(out))
    assert sched.requests["a"].status.finished and not sched.has_unfinished_requests()
    out = sched.schedule()
    assert out.finished_req_ids == {"a"} and not out.num_scheduled_tokens
    runner_out = runner.execute_model(out)
    assert runner_out.req_ids == [] and runner.num_forward_passes == 1, "nothing scheduled: no forward pass"
    assert "a" not in runner.requests, "the runner forgets a request once the scheduler says it finished"
