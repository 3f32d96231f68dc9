"""Chapter 3: several sequences decoding on one shuffled block pool equal transformers' generate, each alone."""

import copy
import random

import pytest

from conftest import make_tiny_model
from kvlab.baselines.transformers_generate import reference_generate
from kvlab.core.paging import BlockManager
from kvlab.decoding.paged_generate import PagedGenerator


def _state(manager: BlockManager):
    return (list(manager.free_block_ids), copy.deepcopy(manager.block_tables), dict(manager.num_tokens))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_sequences_joining_at_different_steps_equal_generate_alone(family):
    model = make_tiny_model(family)
    rng = random.Random(1)
    prompts = [[rng.randrange(1, 97) for _ in range(rng.randint(1, 12))] for _ in range(4)]
    lengths = [rng.randint(1, 20) for _ in prompts]
    gen = PagedGenerator(model, num_blocks=40, block_size=4)
    _shuffle_free_list(gen, 1)
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        gen.add_request(p, n, arrival_step=2 * i)
    outputs = gen.run()
    for p, n, out in zip(prompts, lengths, outputs):
        assert out == reference_generate(model, p, n)
    assert gen.block_manager.num_free_blocks == 40, "finished sequences return every block"


def _shuffle_free_list(gen: PagedGenerator, seed: int):
    blocks = list(gen.block_manager.free_block_ids)
    random.Random(seed).shuffle(blocks)
    gen.block_manager.free_block_ids.clear()
    gen.block_manager.free_block_ids.extend(blocks)


def test_embedded_model_on_the_paged_cache_equals_generate(embedded):
    model, tokenizer = embedded
    texts = ["ROMEO:\n", "KING HENRY:\nOnce more unto", "First Citizen:\nWe are accounted poor citizens"]
    lengths = [50, 23, 37]
    gen = PagedGenerator(model, num_blocks=64, block_size=16)
    _shuffle_free_list(gen, 2)
    for i, (t, n) in enumerate(zip(texts, lengths)):
        gen.add_request(tokenizer(t)["input_ids"], n, arrival_step=5 * i)
    for t, n, out in zip(texts, lengths, gen.run()):
        assert out == reference_generate(model, tokenizer(t)["input_ids"], n), t


def test_a_step_that_cannot_get_its_blocks_raises_before_touching_the_pool():
    model = make_tiny_model("llama")
    gen = PagedGenerator(model, num_blocks=3, block_size=2)
    gen.add_request([1, 2, 3, 4, 5], 4)
    gen.add_request([6, 7], 2)
    before = _state(gen.block_manager)
    with pytest.raises(MemoryError, match="needs 4 new blocks"):
        gen.step()
    assert _state(gen.block_manager) == before
