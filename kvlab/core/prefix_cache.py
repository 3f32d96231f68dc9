"""Chapter 4's block hashes: a full block is named by its parent's hash, its token ids and optional extra keys.

Because each hash folds in the parent's, equal hashes mean equal whole prefixes, not only equal
blocks: "to be or" after "ROMEO:" and after "JULIET:" get different hashes, since the K/V of a token
depend on every token before it. Extra keys separate requests whose token ids agree but whose K/V
(or whose right to see them) do not. vLLM V1 builds them from the LoRA adapter's name, the
multimodal inputs a block covers (each item's hash and offset), a hash of prompt embeddings, and a
request's `cache_salt` (first block only, which by the chain separates every later block too); kvlab
takes whatever hashable value the caller passes.

The hash is SHA-256 over a pickle of (parent hash, token ids, extra keys), kept as 32 bytes. Python's
built-in hash() would be faster but is only 64 bits (a collision would silently serve another
prompt's K/V), and it is salted per process for str and bytes (PYTHONHASHSEED): a tuple of ints
hashes the same in every process, but a LoRA name or cache salt among the extra keys would not.

The first block's parent: vLLM does not use None but NONE_HASH (vllm/v1/core/kv_cache_utils.py,
init_none_hash): 32 random bytes drawn at start-up (os.urandom, against collisions, as Python salts its own
hash()), or a hash of PYTHONHASHSEED when that is set. Since every later hash folds in its parent's, the seed
names every block: processes that must agree on block hashes (the prefill and decode instances of a disaggregated
set-up, a router reading replicas' KV-cache events, a disk tier read after a restart) need the same
PYTHONHASHSEED. kvlab has the same knob, hash_seed (`kvlab serve` takes PYTHONHASHSEED as its default, as vLLM
does); none_hash(seed) is the root. Where vLLM draws random bytes for an unset seed, kvlab keeps a fixed root,
the parent None, so that without a seed a block's hash is the same in every process and every run: tests can pin
a digest and notebooks show the same hashes each time. (vLLM's cache_salt, for isolating tenants, has no
counterpart here.)

The hash function is a named choice, as vLLM's --prefix-caching-hash-algo is (vllm/utils/hashing.py offers
sha256, its default and kvlab's, sha256_cbor, xxhash and xxhash_cbor). kvlab adds "builtin": Python's hash() of
the same (parent, token ids, extra keys) tuple, about ten times faster than SHA-256 over a pickle. It suits a
simulation that hashes millions of blocks and serves no K/V: its 64 bits make a collision among ten million
blocks about a one-in-a-million event, and its values differ between processes (None and str are salted), so
two processes cannot compare them. An engine that serves real K/V keeps sha256.
"""

import hashlib
import pickle
from collections.abc import Hashable, Sequence

BlockHash = bytes


def none_hash(hash_seed: str | int | None = None) -> BlockHash | None:
    """The parent of a chain's first block: None (kvlab's fixed root) without a seed, else a digest of the seed."""
    if hash_seed is None:
        return None
    if isinstance(hash_seed, bool) or not isinstance(hash_seed, (str, int)) or str(hash_seed) == "":
        raise ValueError(f"hash_seed must be a non-empty string (as PYTHONHASHSEED is) or None, got {hash_seed!r}")
    return hashlib.sha256(pickle.dumps(("hash_seed", str(hash_seed)), protocol=5)).digest()


def hash_block_tokens(parent_block_hash: BlockHash | None, token_ids: Sequence[int],
                      extra_keys: Hashable | None = None) -> BlockHash:
    """The hash of one full block given its parent's hash (None for the first block: kvlab's fixed seed)."""
    key = (parent_block_hash, tuple(int(t) for t in token_ids), extra_keys)
    return hashlib.sha256(pickle.dumps(key, protocol=5)).digest()


def hash_block_tokens_builtin(parent_block_hash: int | None, token_ids: Sequence[int],
                              extra_keys: Hashable | None = None) -> int:
    """The "builtin" choice: Python's 64-bit hash() of the same (parent, token ids, extra keys) key, for one process."""
    return hash((parent_block_hash, tuple(token_ids), extra_keys))


# --prefix-caching-hash-algo's values: name -> the function of (parent hash, token ids, extra keys).
HASH_FUNCTIONS = {"sha256": hash_block_tokens, "builtin": hash_block_tokens_builtin}


def get_hash_fn(name: str):
    """The block-hash function of a --prefix-caching-hash-algo name; ValueError naming the choices otherwise."""
    try:
        return HASH_FUNCTIONS[name]
    except (KeyError, TypeError):
        raise ValueError(f"prefix_caching_hash_algo must be one of {', '.join(HASH_FUNCTIONS)}, got {name!r}") from None


def chain_hashes(token_ids: Sequence[int], block_size: int, hash_fn=hash_block_tokens, root=None,
                 extra_keys: Hashable | None = None) -> list:
    """Every full block's hash by hash_fn, chained from root (the seed's none_hash); a partial last block gets none."""
    hashes, parent = [], root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_fn(parent, token_ids[start:start + block_size], extra_keys)
        hashes.append(parent)
    return hashes


def block_hashes(token_ids: Sequence[int], block_size: int, extra_keys: Hashable | None = None,
                 hash_seed: str | int | None = None) -> list[BlockHash]:
    """Hashes of every full block of a sequence, first block first; a partly filled last block gets none."""
    return chain_hashes(token_ids, block_size, root=none_hash(hash_seed), extra_keys=extra_keys)
