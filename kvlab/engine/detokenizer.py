"""Token ids to text as they arrive, decoding a few tokens per step instead of the whole completion.

    detok = IncrementalDetokenizer(tokenizer)
    piece = detok.step([ids of this step])   # the text those tokens add ('' while a character is incomplete)
    piece = detok.finish()                   # at the end: whatever was still held back
    detok.text == TextDecoder(tokenizer).decode(every id so far)

Decoding a completion's whole token list after every step costs O(length) per step, O(length²) per
request. The text of a token can depend on its neighbours, though: a byte-level BPE token may hold
half of a multi-byte character, a sentencepiece decoder drops the leading space of the first token it
sees. So each step decodes a short window of ids, from `prefix_offset` (tokens already shown, kept as
context) to the end, and also the context alone (`prefix_offset` to `read_offset`); the new text is
what the window adds to its context. While the window's text ends in U+FFFD (an incomplete UTF-8
character) nothing is shown and the window grows until the next token completes it. Once text is
shown the window moves on: the tokens just shown become the next context. This is the scheme of
vLLM's slow path (vllm/v1/engine/detokenizer.py, SlowIncrementalDetokenizer, with the prefix/read
offsets of vllm/transformers_utils/detokenizer_utils.py); its fast path hands the same job to the
`tokenizers` library's DecodeStream. Two differences: vLLM primes the window with the prompt's last
tokens (kvlab's completion text is the completion decoded alone, as `decode(token_ids)` gives it), and
vLLM drops an incomplete character still held at the end, where finish() here returns it, so that the
pieces always add up to the whole decode.

The decode is the tokenizer's own without `clean_up_tokenization_spaces`: that option rewrites the
joined string (" ." becomes ".", " 's" becomes "'s"), so text already streamed would have to change
when the next token arrives. vLLM never applies it to generated text either (neither of its
incremental detokenizers does); kvlab's final text (RequestOutputKind.FINAL_ONLY) uses the same
decode, so a stream and LLM.generate give the same text whatever the tokenizer's setting.
"""

import re
from collections.abc import Callable

REPLACEMENT = "\ufffd"  # what a decoder makes of the bytes of an incomplete UTF-8 character
BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # sentencepiece's byte-fallback tokens


class TextDecoder:
    """How kvlab turns a tokenizer's ids into generated text, and which ids keep a window open.

    decode(ids): the tokenizer's decode, special tokens kept, no clean-up of spaces. A tokenizer backed by
    the `tokenizers` library is called directly (a few microseconds for a short window, against tens for
    transformers' wrapper); another transformers tokenizer with clean-up turned off; anything else (a
    test's stub) through its plain decode(ids).

    open_ids: the byte tokens ("<0xE3>") of a tokenizer whose decoder has ByteFallback (sentencepiece's
    scheme, Llama's). That decoder turns a run of byte tokens into text only as a whole, and into one
    U+FFFD per byte if the run is not valid UTF-8, so a valid byte already shown could turn into U+FFFD
    when an invalid one follows it. A window that ends in a byte token is therefore held until a token of
    another kind closes the run.
    """

    __slots__ = ("decode", "open_ids")

    def __init__(self, tokenizer):
        backend = getattr(tokenizer, "_tokenizer", None)
        self.open_ids: frozenset[int] = frozenset()
        if backend is not None and callable(getattr(backend, "decode", None)):
            def decode(ids):
                return backend.decode(ids, skip_special_tokens=False)
            if "ByteFallback" in repr(getattr(backend, "decoder", None)):
                self.open_ids = frozenset(i for t, i in backend.get_vocab(with_added_tokens=True).items()
                                          if BYTE_TOKEN.fullmatch(t))
        elif hasattr(tokenizer, "clean_up_tokenization_spaces"):
            def decode(ids):
                return tokenizer.decode(ids, clean_up_tokenization_spaces=False)
        else:
            decode = tokenizer.decode
        self.decode: Callable[[list[int]], str] = decode


class IncrementalDetokenizer:
    """One completion's text, grown a few tokens at a time; `text` is what step() and finish() returned so far."""

    __slots__ = ("decode", "open_ids", "token_ids", "text", "prefix_offset", "read_offset", "_prefix_text")

    def __init__(self, tokenizer=None, decoder: TextDecoder | None = None):
        if decoder is None:
            if tokenizer is None:
                raise ValueError("IncrementalDetokenizer needs a tokenizer or a TextDecoder")
            decoder = TextDecoder(tokenizer)
        self.decode, self.open_ids = decoder.decode, decoder.open_ids
        self.token_ids: list[int] = []
        self.text = ""
        self.prefix_offset = 0     # the window starts here: tokens already shown, decoded again as context
        self.read_offset = 0       # tokens before this have been shown
        self._prefix_text = ""     # decode(token_ids[prefix_offset:read_offset])

    def step(self, new_token_ids: list[int]) -> str:
        """Add tokens; returns the text they complete ('' while the last character is still incomplete)."""
        self.token_ids.extend(new_token_ids)
        if len(self.token_ids) == self.read_offset or (self.open_ids and self.token_ids[-1] in self.open_ids):
            return ""
        window = self.decode(self.token_ids[self.prefix_offset:])
        if window.endswith(REPLACEMENT):
            return ""  # wait: the next token may complete the character (finish() shows it if none does)
        return self._advance(window)

    def finish(self) -> str:
        """The text still held back (an incomplete character at the very end); afterwards text is the whole decode."""
        if len(self.token_ids) == self.read_offset:
            return ""
        return self._advance(self.decode(self.token_ids[self.prefix_offset:]))

    def _advance(self, window: str) -> str:
        if window.startswith(self._prefix_text):
            piece = window[len(self._prefix_text):]
        else:
            # A decoder whose text for the context changed once more tokens followed (none of the usual
            # ones does: byte-level BPE, sentencepiece, WordPiece, character-level): fall back to one
            # whole decode, so the text stays exactly the decode of all ids.
            whole = self.decode(self.token_ids)
            piece = whole[len(self.text):] if whole.startswith(self.text) else ""
        self.text += piece
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self._prefix_text = self.decode(self.token_ids[self.prefix_offset:self.read_offset])
        return piece
