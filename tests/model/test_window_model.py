"""The shipped hybrid sibling in assets/model_window: a Qwen2 whose layers 2-3 see only the last 32 characters.

It loads offline by name, its config windows the layers the course says, kvlab's hybrid pool decodes it exactly as
transformers does for generations longer than the window (chunked prefill, prefix caching and preemption on), its
windowed groups keep only the blocks the window reaches, and what it writes looks like a play.
"""

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import Qwen2ForCausalLM  # noqa: E402

from kvlab.core.kv_cache_interface import SlidingWindowSpec  # noqa: E402
from kvlab.decoding.hybrid_generate import HybridGenerator, hybrid_groups  # noqa: E402
from kvlab.model.loader import load_model  # noqa: E402
from kvlab.paths import ASSETS_DIR, SHIPPED_MODELS, WINDOW_MODEL_DIR  # noqa: E402

WINDOW = 32       # keys a windowed layer sees, the query's own included
BLOCK_SIZE = 8
NEW_TOKENS = 100  # well past the window: the windowed layers must forget the prompt's start
# A speech and a longer version of it: the second reuses the first's cached blocks in every group.
SHARED = "MACBETH.\nIs this a dagger which I see before me,\n"
PROMPTS = ["OTHELLO.\n", SHARED, SHARED + "The handle toward my hand? Come, let me clutch thee.\n"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Decode steps are tiny; on a busy 2-core machine a second thread mostly waits."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def loaded():
    return load_model("window", device="cpu")


@pytest.fixture(scope="module")
def model(loaded):
    return loaded[0]


@pytest.fixture(scope="module")
def tokenizer(loaded):
    return loaded[1]


def reference(model, prompt_ids: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt_ids):].tolist()


def test_loads_by_name_from_the_shipped_folder(model):
    assert SHIPPED_MODELS["window"] == WINDOW_MODEL_DIR and WINDOW_MODEL_DIR.name == "model_window"
    assert isinstance(model, Qwen2ForCausalLM), f"load_model('window') gave a {type(model).__name__}"
    assert model.config.name_or_path == str(WINDOW_MODEL_DIR)


def test_tokenizer_is_the_character_level_one(tokenizer):
    from transformers import AutoTokenizer

    default = AutoTokenizer.from_pretrained(SHIPPED_MODELS["default"])
    text = "OTHELLO.\nI am not what I am.\n"
    ids = tokenizer(text)["input_ids"]
    # transformers' AutoTokenizer would hand a Qwen2 folder a byte-level Qwen2Tokenizer; load_model must not.
    assert ids == default(text)["input_ids"] and len(ids) == len(text), \
        f"expected one id per character, as the default model's tokenizer gives; got {ids}"
    assert tokenizer.decode(ids) == text


def test_an_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="'default', 'window', 'draft'"):
        load_model("windowed")


def test_layers_2_and_3_see_a_window_of_32(model):
    cfg = model.config
    assert cfg.layer_types == ["full_attention", "full_attention", "sliding_attention", "sliding_attention"], \
        f"layers from max_window_layers={cfg.max_window_layers} on should be windowed, got {cfg.layer_types}"
    assert cfg.sliding_window == WINDOW, f"the window is {cfg.sliding_window} keys, expected {WINDOW}"
    assert cfg.max_position_embeddings == 256 > WINDOW, "the window must bind inside the trained context"
    windowed = sorted(layer for g in hybrid_groups(model, BLOCK_SIZE)
                      if isinstance(g.kv_cache_spec, SlidingWindowSpec) for layer in g.layer_ids)
    assert windowed == [2, 3], f"kvlab's KV-cache groups window layers {windowed}, the config layers 2-3"


def test_hybrid_pool_equals_transformers_generate(model, tokenizer):
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    # A request of ~150 tokens holds ~19 full-attention blocks of 8 but only 5 windowed ones: 36 blocks fit one
    # request or two, not all three, so the newest is preempted and recomputed.
    gen = HybridGenerator(model, num_blocks=36, block_size=BLOCK_SIZE, max_num_batched_tokens=16)
    outs = gen.generate(prompts, NEW_TOKENS)
    for text, prompt, out in zip(PROMPTS, prompts, outs):
        expected = reference(model, prompt, NEW_TOKENS)
        assert out == expected, (
            f"prompt {text!r}: kvlab's hybrid pool wrote {tokenizer.decode(out)!r}, "
            f"transformers {tokenizer.decode(expected)!r}")
    assert gen.coordinator.hits > 0, "set-up: the shared speech must hit the prefix cache"
    assert gen.num_preemptions > 0, "set-up: the pool must be small enough to preempt"
    assert gen.coordinator.num_free_blocks == gen.coordinator.num_blocks, "every block back at the end"


def test_the_engine_serves_it_by_name_with_the_hybrid_manager(model, tokenizer):
    from kvlab import LLM, SamplingParams
    from kvlab.core.hybrid_kv_cache_manager import HybridKVCacheManager

    llm = LLM("window", block_size=BLOCK_SIZE, num_blocks=36, max_num_batched_tokens=16, max_num_seqs=4)
    assert isinstance(llm.llm_engine.kv_cache_manager, HybridKVCacheManager)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    for text, out in zip(PROMPTS, outs):
        expected = reference(model, tokenizer(text)["input_ids"], NEW_TOKENS)
        assert list(out.outputs[0].token_ids) == expected, (
            f"prompt {text!r}: LLM('window') wrote {out.outputs[0].text!r}, transformers "
            f"{tokenizer.decode(expected)!r}")
        assert out.outputs[0].text == tokenizer.decode(expected)
    assert llm.llm_engine.kv_cache_manager.hits > 0 and llm.llm_engine.scheduler.num_preemptions > 0


def test_windowed_groups_hold_only_what_the_window_reaches(model, tokenizer):
    gen = HybridGenerator(model, num_blocks=64, block_size=BLOCK_SIZE, max_num_batched_tokens=16)
    live = {}  # group kind -> after every step, (num_computed, table indices of the blocks still held)
    original = gen.coordinator.remove_skipped_blocks

    def after_step(rid, num_computed):
        freed = original(rid, num_computed)
        for manager in gen.coordinator.managers:
            kind = "window" if isinstance(manager.kv_cache_spec, SlidingWindowSpec) else "full"
            held = [i for i, b in enumerate(manager.req_to_blocks[rid]) if b is not gen.coordinator.null_block]
            live.setdefault(kind, []).append((num_computed, held))
        return freed

    gen.coordinator.remove_skipped_blocks = after_step
    prompt = tokenizer(PROMPTS[2])["input_ids"]
    gen.generate([prompt], NEW_TOKENS)
    # The next query sits at num_computed and reads keys num_computed - WINDOW + 1 .. num_computed: a block whose
    # last token comes before that is one no query will read again.
    for num_computed, held in live["window"]:
        oldest_read = num_computed - WINDOW + 1
        stale = [i for i in held if (i + 1) * BLOCK_SIZE - 1 < oldest_read]
        assert not stale, (f"after {num_computed} tokens the windowed group still holds blocks {stale} of "
                           f"{BLOCK_SIZE} tokens, wholly before position {oldest_read}, the oldest its window reads")
    bound = math.ceil((WINDOW - 1) / BLOCK_SIZE) + 1  # the window's keys, plus the block being written
    assert max(len(held) for _, held in live["window"]) <= bound
    # The last sampled token is never fed back, so the request ends with one token fewer computed.
    last_computed, last_full = live["full"][-1]
    assert last_computed == len(prompt) + NEW_TOKENS - 1 and len(last_full) == math.ceil(last_computed / BLOCK_SIZE), \
        "set-up: the full-attention group keeps every block, the windowed one only the last few"


def test_the_window_is_what_it_learned(model, tokenizer):
    """Its layers 2-3 were trained through the window: lifting it changes the logits past 32 and hurts the loss."""
    from transformers import Qwen2Config

    # Four 256-character pieces of the validation split (the corpus's last 10 %), one character per token.
    text = (ASSETS_DIR / "text" / "shakespeare.txt").read_text(encoding="utf-8")
    ids = torch.tensor([tokenizer(text[-256 * (k + 1):-256 * k])["input_ids"] for k in range(1, 5)])
    settings = {**model.config.to_dict(), "use_sliding_window": False}
    settings.pop("layer_types")  # rebuilt from use_sliding_window: every layer full
    unwindowed = Qwen2ForCausalLM(Qwen2Config(**settings))
    unwindowed.load_state_dict(model.state_dict())
    unwindowed.eval()
    with torch.no_grad():
        windowed_out = model(input_ids=ids, labels=ids)
        full_out = unwindowed(input_ids=ids, labels=ids)
    assert torch.allclose(windowed_out.logits[:, :WINDOW], full_out.logits[:, :WINDOW], atol=1e-4), \
        "within the first 32 positions the window hides nothing: the logits must agree"
    assert not torch.allclose(windowed_out.logits[:, WINDOW:], full_out.logits[:, WINDOW:], atol=1e-2), \
        "past 32 positions the window must change what layers 2-3 see"
    assert windowed_out.loss < full_out.loss, (
        f"loss {windowed_out.loss:.3f} with the window, {full_out.loss:.3f} without: a model trained through the "
        f"window should do worse when its layers 2-3 suddenly see keys they never saw in training")


def test_writes_a_play(model, tokenizer):
    """After a speech and a blank line the next speaker's name follows, in capitals, then words."""
    prompt = tokenizer("MACBETH.\nIs this a dagger which I see before me?\n\n")["input_ids"]
    gen = HybridGenerator(model, num_blocks=64, block_size=BLOCK_SIZE, max_num_batched_tokens=16)
    text = tokenizer.decode(gen.generate([prompt], NEW_TOKENS)[0])
    speaker = text.split("\n", 1)[0]
    assert speaker.endswith(".") and speaker[:-1].replace(" ", "").isalpha() and speaker.isupper(), \
        f"expected a speaker's name in capitals and a full stop, as the plays set them, got {speaker!r} in {text!r}"
    plain = sum(c.isalpha() or c in " \n" for c in text)
    assert plain >= 0.9 * len(text) and text.count(" ") >= 5, f"expected mostly words and spaces, got {text!r}"
    assert len(set(text)) >= 15, f"expected varied characters, not a loop on a few: {text!r}"
