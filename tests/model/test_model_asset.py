"""The shipped default model in assets/model loads offline, has the promised shape and writes English."""

import os
import re
from collections import Counter
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoTokenizer, LlamaForCausalLM  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
MODEL_DIR = REPO / "assets" / "model"
CORPUS = REPO / "assets" / "text" / "shakespeare.txt"
WORD = re.compile(r"[a-z']+")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Generation steps are tiny; on a busy 2-core machine a second thread mostly waits."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model():
    m = LlamaForCausalLM.from_pretrained(MODEL_DIR, local_files_only=True)
    return m.eval()


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(MODEL_DIR, local_files_only=True)


@pytest.fixture(scope="module")
def corpus():
    return CORPUS.read_text(encoding="utf-8")


def words(text: str) -> list[str]:
    """Lower-case words, apostrophes kept ("'tis", "o'er") and stray quotes trimmed."""
    return [w.strip("'") for w in WORD.findall(text.lower()) if w.strip("'")]


def test_is_a_small_gqa_llama(model):
    assert isinstance(model, LlamaForCausalLM)
    n_params = sum(p.numel() for p in model.parameters())
    assert 1_000_000 <= n_params <= 5_000_000, n_params
    cfg = model.config
    assert cfg.head_dim == 64
    assert cfg.num_key_value_heads < cfg.num_attention_heads
    assert cfg.num_attention_heads % cfg.num_key_value_heads == 0
    assert (cfg.eos_token_id, cfg.pad_token_id) == (1, 0)


def test_asset_size_is_at_most_15_mb():
    size = sum(f.stat().st_size for f in MODEL_DIR.rglob("*") if f.is_file())
    assert size <= 15 * 1024 * 1024, size


def test_tokenizer_round_trips_the_corpus(tokenizer, corpus):
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    assert tokenizer("ab")["input_ids"] == tokenizer.convert_tokens_to_ids(["a", "b"])  # no BOS/EOS
    passage = corpus[200_000:204_000]
    assert "\n\n" in passage
    ids = tokenizer.encode(passage)
    assert len(ids) == len(passage)
    assert tokenizer.decode(ids) == passage
    odd = "  two  spaces,\n\n\nthree newlines; trailing space \n"
    assert tokenizer.decode(tokenizer.encode(odd)) == odd


def test_greedy_generation(model, tokenizer):
    inputs = tokenizer("OTHELLO.\n", return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=100, do_sample=False)
    again = model.generate(**inputs, max_new_tokens=100, do_sample=False)
    assert torch.equal(out, again)
    assert out.shape[1] > inputs["input_ids"].shape[1]
    # The model card prints this very continuation: weights, tokenizer and card must agree.
    card = (MODEL_DIR / "README.md").read_text(encoding="utf-8")
    documented = re.search(r"Greedy \(`do_sample=False`, 100 new characters\).*?```text\n(.*?)```", card, re.S)
    assert documented, "the model card lost its greedy example"
    assert tokenizer.decode(out[0], skip_special_tokens=True) == documented.group(1).rstrip("\n"), (
        "greedy output differs from the model card's: the shipped weights or tokenizer changed without the card")


def test_the_model_card_states_the_true_parameter_count(model):
    card = (MODEL_DIR / "README.md").read_text(encoding="utf-8")
    stated = re.search(r"\| parameters \| \*\*([\d,]+)\*\* \|", card)
    assert stated, "the model card's architecture table lost its parameter row"
    assert int(stated.group(1).replace(",", "")) == sum(p.numel() for p in model.parameters())


def test_samples_are_recognisable_english(model, tokenizer, corpus):
    top_300 = {w for w, _ in Counter(words(corpus)).most_common(300)}
    # Six rows of ~245 characters: together ~1,500 characters, each inside the
    # 256-position context the model was trained on.
    inputs = tokenizer(["OTHELLO.\n"] * 6, return_tensors="pt")
    prompt_len = inputs["input_ids"].shape[1]
    torch.manual_seed(0)
    out = model.generate(**inputs, do_sample=True, temperature=0.8, top_k=0, max_new_tokens=245)
    # Only the generated part counts: the prompt is a known word.
    sample = "\n".join(tokenizer.decode(row[prompt_len:], skip_special_tokens=True) for row in out)
    sample_words = words(sample)
    share = sum(w in top_300 for w in sample_words) / len(sample_words)
    print(f"\n{len(sample)} sampled characters, {len(sample_words)} words, "
          f"{share:.1%} among the corpus's 300 most frequent words")
    assert len(sample) > 1200
    assert share >= 0.40, sample
