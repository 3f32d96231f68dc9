"""Chapter 6's model runner: one ragged forward pass gives every request the logits it would get running alone."""

import pytest
import torch

from conftest import make_tiny_model
from kvlab.cache.batched_attention import BatchedPagedKVCache
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


def after_the_pass(sched_out, logits):
    """The engine's bookkeeping after a pass: tokens computed, and each finished prompt takes its argmax."""
    for row, s in enumerate(sched_out.scheduled):
        s.request.num_computed_tokens += s.num_new_tokens
        if s.request.num_computed_tokens == s.request.num_tokens:
            s.request.output_token_ids.append(int(logits[row].argmax()))


def test_one_ragged_step_matches_each_request_run_alone(tiny):
    kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=False)
    cache = BatchedPagedKVCache.for_model(tiny, NUM_BLOCKS, BLOCK_SIZE, decode_backend="torch")
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=12)
    runner = ModelRunner(tiny, cache)
    params = SamplingParams(temperature=0, max_tokens=10)
    prompts = {"r0": [5, 17, 42, 8, 23], "r1": [60, 61, 2, 9, 33, 71, 4, 88, 15], "r2": [30, 12, 77]}
    requests = {rid: Request(rid, ids, params, i, None) for i, (rid, ids) in enumerate(prompts.items())}
    for request in requests.values():
        sched.add(request)

    # Step 1: r0's whole prompt (5 tokens) and the first 7 of r1's 9, in one pass.
    out = sched.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("r0", 5), ("r1", 7)]
    logits = runner.execute(out, kv.block_tables)
    assert logits.shape == (2, tiny.config.vocab_size), "one row of logits per scheduled request: its last new token"
    torch.testing.assert_close(logits[0], alone(tiny, prompts["r0"]), atol=1e-4, rtol=1e-4,
                               msg="a full prompt's row equals the prompt's last logits run alone")
    torch.testing.assert_close(logits[1], alone(tiny, prompts["r1"][:7]), atol=1e-4, rtol=1e-4,
                               msg="a chunk's row is the logits of the chunk's last token, with only the tokens so far")
    after_the_pass(out, logits)

    # Step 2: a decode (r0), the rest of a chunked prompt (r1) and a new prompt (r2): a ragged mix.
    out = sched.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("r0", 1), ("r1", 2), ("r2", 3)]
    logits = runner.execute(out, kv.block_tables)
    for row, rid in enumerate(["r0", "r1", "r2"]):
        request = requests[rid]
        torch.testing.assert_close(
            logits[row], alone(tiny, request.all_token_ids), atol=1e-4, rtol=1e-4,
            msg=lambda m, rid=rid: f"{rid}: its row of the ragged pass must equal running it alone\n{m}")
    assert runner.num_forward_passes == 2, "each step is one forward pass, whatever the mix of prefills and decodes"
