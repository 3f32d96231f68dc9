"""The Mooncake FAST'25 production traces: loading, prompt token ids with the trace's prefix sharing, prefix-cache hits.

Qin et al., "Mooncake: Trading More Storage for Less Computation — A KVCache-centric Architecture for Serving
LLM Chatbot", USENIX FAST 2025 (kvcache-ai/Mooncake, FAST25-release/traces/, Apache-2.0; the copy and its
licence are in assets/traces/). Each JSON line is one request: `timestamp` (arrival, ms from the start),
`input_length` and `output_length` (tokens) and `hash_ids`, one id per 512-token block of the prompt, the last
one covering a partly filled block. Ids are remapped prefix hashes: an id names its block and, through its
parent, the whole prefix before it, so two requests whose lists start with the same m ids share their first
m blocks of prompt, and nothing else. The trace holds no text and no tokens.

`PromptSynthesizer` gives every request prompt token ids that keep exactly that sharing. Each id's 512 tokens
are a fixed function of the id: its first `id_digits` tokens spell the id in base `vocab_size` (so two different
ids differ within those tokens), the rest are a hash of (seed, id, offset) reduced mod `vocab_size`. A prompt is
its ids' blocks concatenated and cut to `input_length` (a last partial block is a prefix of its id's block). For
a kvlab block size b that divides 512 and is at least `id_digits` (2 for a vocabulary of 32,000 and the trace's
ids), every kvlab block lies inside one Mooncake block and holds the id's digits if it starts one, so two
prompts' kvlab blocks hash alike exactly where their Mooncake blocks do. For a b that does not divide 512, the
kvlab block straddling the first differing Mooncake block does not match (it holds that block's digits), so a
hit covers floor(512 m / b) blocks of b tokens, up to b - 1 tokens fewer than the trace shares; the one
exception is a block that ends within the first id_digits - 1 tokens of a Mooncake block, whose ids may agree
in the digits it holds.

`prefix_cache_hits` replays a trace through kvlab's real KVCacheManager (prefix caching over the BlockPool's LRU
free queue) with a given KV capacity, ignoring compute time: each request is admitted, and freed, before the
next arrives, so at most one request holds blocks and the capacity is all prefix cache. `infinite_cache_hits`
computes what an unbounded cache would serve straight from the hash ids, with the same rules (full blocks
only, the last prompt token always computed): the check on the replay.
"""

import gzip
import json
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvlab.core.block_pool import BlockPool
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.paths import ASSETS_DIR
from kvlab.validation import check_block_size

MOONCAKE_BLOCK_TOKENS = 512  # tokens per hash id in the Mooncake traces
TRACES_DIR = ASSETS_DIR / "traces"
MOONCAKE_TRACES = {"conversation": TRACES_DIR / "mooncake_conversation_trace.jsonl.gz"}
_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


@dataclass(slots=True, frozen=True)
class MooncakeRequest:
    """One request of a Mooncake trace: arrival in seconds, prompt and output lengths, prefix-block hash ids."""

    request_id: int
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_mooncake_lines(lines: Iterable[str], source: str = "<trace>") -> list[MooncakeRequest]:
    """Parse JSON lines of a Mooncake trace, raising ValueError that names the line on anything malformed."""
    requests: list[MooncakeRequest] = []
    last_ms = None
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{source}:{line_no}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not a JSON object ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
        missing = [k for k in _FIELDS if k not in row]
        if missing:
            raise ValueError(f"{where}: missing field(s) {', '.join(missing)} (a request needs {', '.join(_FIELDS)})")
        ms, n_in, n_out, ids = (row[k] for k in _FIELDS)
        if not (_is_int(ms) or isinstance(ms, float)) or not math.isfinite(ms) or ms < 0:
            raise ValueError(f"{where}: timestamp must be a non-negative number of milliseconds, got {ms!r}")
        if last_ms is not None and ms < last_ms:
            raise ValueError(f"{where}: arrivals must be sorted: timestamp {ms} comes after {last_ms}")
        for name, value in (("input_length", n_in), ("output_length", n_out)):
            if not _is_int(value) or value <= 0:
                raise ValueError(f"{where}: {name} must be a positive integer, got {value!r}")
        if not isinstance(ids, list) or not all(_is_int(h) and h >= 0 for h in ids):
            raise ValueError(f"{where}: hash_ids must be a list of non-negative integers")
        expected = -(-n_in // MOONCAKE_BLOCK_TOKENS)
        if len(ids) != expected:
            raise ValueError(f"{where}: {n_in} input tokens need ceil({n_in}/{MOONCAKE_BLOCK_TOKENS}) = {expected} "
                             f"hash ids (one per {MOONCAKE_BLOCK_TOKENS}-token block, the last may be partial), "
                             f"got {len(ids)}")
        last_ms = ms
        requests.append(MooncakeRequest(len(requests), ms / 1000.0, n_in, n_out, tuple(ids)))
    return requests


def load_mooncake_trace(path: str | Path = "conversation", limit: int | None = None) -> list[MooncakeRequest]:
    """Read a Mooncake trace (a name of MOONCAKE_TRACES, or a .jsonl / .jsonl.gz path), first `limit` requests."""
    path = MOONCAKE_TRACES.get(path, path) if isinstance(path, str) else path
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no Mooncake trace at {path} (names: {', '.join(MOONCAKE_TRACES)})")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        lines = f if limit is None else (line for _, line in zip(range(limit), f))
        return parse_mooncake_lines(lines, str(path))


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 arrays: a cheap, well-spread hash (wraps modulo 2**64 by design)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class PromptSynthesizer:
    """Prompt token ids for Mooncake requests: equal hash-id prefixes give equal token blocks, and nothing more.

    Deterministic for (vocab_size, seed); every token is in [0, vocab_size). Builds one prompt at a time, so a
    whole trace streams through in a few seconds without holding its 145M tokens.
    """

    def __init__(self, vocab_size: int, seed: int = 0, max_hash_id: int = 2**32 - 1):
        if not _is_int(vocab_size) or vocab_size < 2:
            raise ValueError(f"vocab_size must be an integer >= 2, got {vocab_size!r}")
        if not _is_int(max_hash_id) or max_hash_id < 0:
            raise ValueError(f"max_hash_id must be a non-negative integer, got {max_hash_id!r}")
        self.vocab_size = vocab_size
        self.seed = seed
        self.max_hash_id = max_hash_id
        # Enough base-vocab_size digits to tell every id apart within a block's first tokens.
        digits = 1
        while vocab_size ** digits <= max_hash_id:
            digits += 1
        if digits > MOONCAKE_BLOCK_TOKENS:
            raise ValueError(f"vocab_size {vocab_size} cannot spell ids up to {max_hash_id} in one block")
        self.id_digits = digits
        self._offsets = np.arange(MOONCAKE_BLOCK_TOKENS, dtype=np.uint64)
        self._place = np.uint64(vocab_size) ** np.arange(digits, dtype=np.uint64)
        self._salt = _mix64(np.array([seed & (2**64 - 1)], dtype=np.uint64))[0]

    def block_token_ids(self, hash_ids: Sequence[int]) -> np.ndarray:
        """The 512 token ids of each hash id: int64 array of shape (len(hash_ids), 512)."""
        ids = np.asarray(hash_ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() > self.max_hash_id):
            raise ValueError(f"hash ids must lie in [0, {self.max_hash_id}], got {int(ids.min())}..{int(ids.max())}")
        ids = ids.astype(np.uint64)
        keys = (ids[:, None] << np.uint64(9)) | self._offsets[None, :]  # (id, offset) -> id * 512 + offset
        tokens = _mix64(keys ^ self._salt) % np.uint64(self.vocab_size)
        tokens[:, :self.id_digits] = (ids[:, None] // self._place[None, :]) % np.uint64(self.vocab_size)
        return tokens.astype(np.int64)

    def prompt_token_ids(self, request: MooncakeRequest) -> np.ndarray:
        """The prompt: its blocks' tokens concatenated, cut to input_length (int64, shape (input_length,))."""
        return self.block_token_ids(request.hash_ids).reshape(-1)[:request.input_length]

    def iter_prompts(self, requests: Iterable[MooncakeRequest]) -> Iterator[list[int]]:
        """Each request's prompt token ids as a list of Python ints (what KVCacheManager hashes), one at a time."""
        for request in requests:
            yield self.prompt_token_ids(request).tolist()


@dataclass(slots=True, frozen=True)
class PrefixCacheHits:
    """Prompt tokens a prefix cache served out of all prompt tokens of a replay, and the blocks it evicted."""

    capacity_tokens: int | None
    block_size: int
    prompt_tokens: int
    hit_tokens: int
    evictions: int

    @property
    def hit_rate(self) -> float:
        """Share of prompt tokens whose K/V came from the cache."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def block_keys(request: MooncakeRequest, block_size: int) -> list[int]:
    """A name for each full kvlab block of the prompt, equal in two requests exactly when their prefixes are.

    The block ending at token e is named by the hash id of the Mooncake block holding token e and e's offset in
    it (id * 512 + offset): an id stands for its whole prefix, so this names every token up to e.
    """
    ids = request.hash_ids
    last = request.input_length // block_size * block_size
    return [ids[e // MOONCAKE_BLOCK_TOKENS] * MOONCAKE_BLOCK_TOKENS + e % MOONCAKE_BLOCK_TOKENS
            for e in range(block_size - 1, last, block_size)]


def _check_capacity(requests: Sequence[MooncakeRequest], capacity_tokens: int, block_size: int) -> int:
    check_block_size(block_size)
    if not _is_int(capacity_tokens) or capacity_tokens <= 0:
        raise ValueError(f"capacity_tokens must be a positive integer, got {capacity_tokens!r}")
    num_blocks = capacity_tokens // block_size
    longest = max((r.input_length for r in requests), default=0)
    if num_blocks * block_size < longest:
        raise ValueError(f"a capacity of {capacity_tokens} tokens ({num_blocks} blocks of {block_size}) cannot hold "
                         f"the longest prompt ({longest} tokens)")
    return num_blocks


def prefix_cache_hits(requests: Sequence[MooncakeRequest], capacity_tokens: int,
                      block_size: int = 16) -> PrefixCacheHits:
    """Replay prompts in arrival order on a BlockPool of capacity_tokens, as KVCacheManager admits and frees them.

    The same pool calls as KVCacheManager.get_computed_blocks, allocate_slots and free, in the same order, with
    block_keys in place of the token hashes (which they equal one for one on PromptSynthesizer's prompts), so
    the LRU free queue evicts the same blocks; each request is freed before the next is admitted.
    """
    num_blocks = _check_capacity(requests, capacity_tokens, block_size)
    pool = BlockPool(num_blocks, enable_prefix_caching=True)
    prompt_tokens = hit_tokens = 0
    for request in requests:
        length = request.input_length
        keys = block_keys(request, block_size)
        hits = []
        for key in keys[:(length - 1) // block_size]:  # the last prompt token is always computed
            block = pool.get_cached_block(key)
            if block is None:
                break
            hits.append(block)
        pool.touch(hits)  # before taking new blocks, so these cannot evict them
        blocks = hits + pool.get_new_blocks(-(-length // block_size) - len(hits))
        pool.cache_full_blocks(blocks[len(hits):len(keys)], keys[len(hits):])
        pool.free_blocks(reversed(blocks))  # last block first, as PooledBlockManager.free
        prompt_tokens += length
        hit_tokens += len(hits) * block_size
    return PrefixCacheHits(capacity_tokens, block_size, prompt_tokens, hit_tokens, pool.num_evictions)


def prefix_cache_hits_from_tokens(requests: Sequence[MooncakeRequest], capacity_tokens: int, block_size: int = 16,
                                  synthesizer: PromptSynthesizer | None = None) -> PrefixCacheHits:
    """The same replay through KVCacheManager itself on synthesized prompt tokens (about 1 us per token: slices)."""
    num_blocks = _check_capacity(requests, capacity_tokens, block_size)
    if synthesizer is None:
        top = max((max(r.hash_ids) for r in requests), default=0)
        synthesizer = PromptSynthesizer(vocab_size=32000, max_hash_id=max(top, 1))
    manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
    for request, tokens in zip(requests, synthesizer.iter_prompts(requests)):
        rid = request.request_id
        hits, num_cached = manager.get_computed_blocks(rid, tokens)
        manager.allocate_slots(rid, len(tokens) - num_cached, computed_blocks=hits, new_token_ids=tokens[num_cached:])
        manager.free(rid)
    return PrefixCacheHits(capacity_tokens, block_size, manager.queries, manager.hits,
                           manager.block_pool.num_evictions)


def infinite_cache_hits(requests: Sequence[MooncakeRequest], block_size: int = 16) -> PrefixCacheHits:
    """What an unbounded prefix cache of block_size-token blocks serves, straight from the hash ids.

    A request shares with the earlier ones the tokens of its longest seen run of ids, at most 512 per id and at
    most the longest earlier prompt through its last seen id (a partial block); the cache serves the full blocks
    of that, short of the last prompt token. Exact for the prompts of PromptSynthesizer at a block_size that
    divides 512 (floor(shared / block_size) blocks for any other size).
    """
    hit_tokens = sum(infinite_cache_hit_tokens(requests, block_size))
    return PrefixCacheHits(None, block_size, sum(r.input_length for r in requests), hit_tokens, 0)


def infinite_cache_hit_tokens(requests: Sequence[MooncakeRequest], block_size: int = 16) -> list[int]:
    """Each request's prompt tokens an unbounded prefix cache serves (infinite_cache_hits' rule), in order."""
    longest_through: dict[int, int] = {}  # hash id -> longest earlier prompt containing it
    hits = []
    for r in requests:
        seen = 0
        for h in r.hash_ids:
            if h not in longest_through:
                break
            seen += 1
        shared = 0
        if seen:
            shared = min(MOONCAKE_BLOCK_TOKENS * seen, longest_through[r.hash_ids[seen - 1]], r.input_length)
        hits.append(block_size * min(shared // block_size, (r.input_length - 1) // block_size))
        for h in r.hash_ids:
            if longest_through.get(h, 0) < r.input_length:
                longest_through[h] = r.input_length
    return hits
