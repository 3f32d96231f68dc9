"""The incremental detokenizer: a few tokens decoded per step, and the pieces always add up to the whole decode.

Three kinds of tokenizer, as a course's models bring them: the embedded character-level one, a byte-level
BPE (GPT-2's scheme: a token may hold part of a multi-byte character) and a sentencepiece-style BPE with
Metaspace and byte fallback (Llama's scheme: a leading "▁" is a space, except at the very start). The last
two are trained here on a slice of the shipped text plus accented letters, CJK and emoji.
"""

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from kvlab.engine.detokenizer import REPLACEMENT, IncrementalDetokenizer, TextDecoder
from kvlab.paths import REPO_ROOT

MULTI_BYTE = ("café naïve über São Paulo señor 東京 北京 こんにちは 世界 안녕하세요 "
              "🙂 🚀 👍🏽 ∑ ≤ € £ — “quoted” ").split(" ")
SPECIALS = ["<s>", "</s>", "<|endoftext|>"]


def training_text() -> list[str]:
    text = (REPO_ROOT / "assets" / "text" / "shakespeare.txt").read_text(encoding="utf-8")[:60_000]
    lines = [line for line in text.splitlines() if line.strip()]
    rng = random.Random(0)
    return lines + [" ".join(rng.choices(MULTI_BYTE, k=8)) for _ in range(300)]


def byte_level_bpe(clean_up: bool = False) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(training_text(), trainers.BpeTrainer(
        vocab_size=600, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   clean_up_tokenization_spaces=clean_up)


def sentencepiece_bpe() -> PreTrainedTokenizerFast:
    """Llama 2's layout: Metaspace pre-tokenizer, byte fallback for what the vocabulary lacks, strip one space."""
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator(training_text()[:400], trainers.BpeTrainer(
        vocab_size=700, special_tokens=SPECIALS[:2] + bytes_, show_progress=False, limit_alphabet=60))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def metaspace_decoder() -> PreTrainedTokenizerFast:
    """The newer sentencepiece layout: the Metaspace decoder itself drops the first token's leading space."""
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Sequence([decoders.ByteFallback(),
                                     decoders.Metaspace(replacement="▁", prepend_scheme="always")])
    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator(training_text()[:400], trainers.BpeTrainer(
        vocab_size=700, special_tokens=SPECIALS[:2] + bytes_, show_progress=False, limit_alphabet=60))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def tokenizers(embedded):
    return {"character-level (embedded)": embedded[1], "byte-level BPE": byte_level_bpe(),
            "sentencepiece BPE, byte fallback": sentencepiece_bpe(), "Metaspace decoder": metaspace_decoder()}


def stream(tok, ids, rng=None):
    """An IncrementalDetokenizer's pieces for ids fed 1-3 at a time (one at a time without rng), then finish()."""
    detok, pieces, i = IncrementalDetokenizer(tok), [], 0
    while i < len(ids):
        k = 1 if rng is None else rng.choice([1, 1, 1, 2, 3])
        pieces.append(detok.step(ids[i:i + k]))
        i += k
    pieces.append(detok.finish())
    assert detok.text == "".join(pieces), "text is what step() and finish() returned, in order"
    return pieces


NAMES = ["character-level (embedded)", "byte-level BPE", "sentencepiece BPE, byte fallback", "Metaspace decoder"]


@pytest.mark.parametrize("name", NAMES)
def test_random_token_sequences_add_up_to_the_whole_decode(tokenizers, name):
    tok = tokenizers[name]
    rng = random.Random(7)
    specials = tok.all_special_ids
    for trial in range(150):
        # Any id, special tokens and byte tokens included: halves of characters, invalid UTF-8, a special token
        # in the middle; every sequence must still come out exactly as the tokenizer decodes it whole.
        ids = [rng.choice(specials) if rng.random() < 0.05 else rng.randrange(len(tok))
               for _ in range(rng.randrange(1, 40))]
        got = "".join(stream(tok, ids, rng))
        assert got == tok.decode(ids), (
            f"{name}: the pieces of {ids} add up to {got!r}, but decoding them whole gives {tok.decode(ids)!r}")


@pytest.mark.parametrize("name", NAMES)
def test_real_text_with_multi_byte_characters_streams_without_replacement_characters(tokenizers, name):
    tok = tokenizers[name]
    text = "Thou art 東京's naïve señor 🙂, “quoth he” — 👍🏽 こんにちは, good my lord."
    ids = tok(text, add_special_tokens=False)["input_ids"]
    pieces = stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids), f"{name}: the pieces must add up to the whole decode"
    assert not any(REPLACEMENT in p for p in pieces), (
        f"{name}: a character split over several tokens is held back until its last byte arrives, never shown as "
        f"U+FFFD first; pieces {pieces}")


@pytest.mark.parametrize("name", ["byte-level BPE", "sentencepiece BPE, byte fallback"])
def test_a_character_split_over_byte_tokens_appears_with_its_last_byte(tokenizers, name):
    tok = tokenizers[name]
    char = "🚀"  # 4 bytes in UTF-8: one token per byte in either scheme
    if name == "byte-level BPE":  # GPT-2's byte alphabet: each byte is one printable character, and a token
        pieces = pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str(char)[0][0]
    else:  # sentencepiece's byte fallback: <0xF0> <0x9F> ...
        pieces = [f"<0x{b:02X}>" for b in char.encode()]
    ids = tok.convert_tokens_to_ids(list(pieces) + ["a"])
    assert len(ids) == 5 and tok.decode(ids) == char + "a"
    detok = IncrementalDetokenizer(tok)
    got = [detok.step([i]) for i in ids]
    assert "".join(got[:3]) == "" and char in "".join(got), (
        f"{name}: nothing is shown until the 4th byte completes the emoji, then the emoji whole; got {got}")
    assert detok.finish() == "" and detok.text == tok.decode(ids)


def test_an_incomplete_character_at_the_end_comes_out_at_finish(tokenizers):
    tok = tokenizers["sentencepiece BPE, byte fallback"]
    ids = tok("lord", add_special_tokens=False)["input_ids"] + tok.convert_tokens_to_ids(["<0xE6>", "<0x9D>"])
    detok = IncrementalDetokenizer(tok)
    shown = "".join(detok.step([i]) for i in ids)
    assert REPLACEMENT not in shown, "two bytes of a 3-byte character are held back while the request runs"
    assert shown + detok.finish() == tok.decode(ids), "finish() gives what the whole decode has: the bytes as U+FFFD"


def test_each_step_decodes_a_short_window_not_the_whole_completion(tokenizers):
    tok = tokenizers["byte-level BPE"]
    ids = tok(" ".join(training_text()[:60]), add_special_tokens=False)["input_ids"][:400]
    decoder = TextDecoder(tok)
    longest = []
    inner = decoder.decode
    decoder.decode = lambda window: (longest.append(len(window)), inner(window))[1]
    detok = IncrementalDetokenizer(decoder=decoder)
    for i in ids:
        detok.step([i])
    assert detok.text + detok.finish() == tok.decode(ids)
    assert max(longest) <= 4, (
        f"over {len(ids)} tokens no decode saw more than a few tokens (longest {max(longest)}): a step costs O(1), "
        "not O(length) as decoding the whole completion again would")


def wordpiece(clean_up: bool) -> PreTrainedTokenizerFast:
    """BERT's scheme, where transformers' clean_up_tokenization_spaces (meant for it) rewrites the joined text."""
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(cleanup=False)
    tok.train_from_iterator(training_text()[:400], trainers.WordPieceTrainer(
        vocab_size=600, special_tokens=["[UNK]", "[SEP]"], show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]",
                                   clean_up_tokenization_spaces=clean_up)


def test_clean_up_of_spaces_is_not_applied_so_streamed_text_never_changes():
    tok = wordpiece(clean_up=True)
    ids = tok("Farewell, my lord. I'll go.", add_special_tokens=False)["input_ids"]
    streamed = "".join(stream(tok, ids))
    assert tok.decode(ids) == "Farewell, my lord. I'll go.", "clean-up joins ' ,' and ' .' in the whole text"
    assert streamed == tok.decode(ids, clean_up_tokenization_spaces=False) == TextDecoder(tok).decode(ids), (
        "a stream cannot take back the space it already sent before '.': kvlab's text, streamed and final alike, is "
        f"the decode without clean-up, as vLLM's is; streamed {streamed!r}")


def test_a_tokenizer_without_a_backend_works_through_its_decode():
    class Letters:
        def decode(self, ids):
            return "".join(chr(97 + i) for i in ids)

    detok = IncrementalDetokenizer(Letters())
    assert [detok.step([0]), detok.step([1, 2]), detok.finish()] == ["a", "bc", ""]
