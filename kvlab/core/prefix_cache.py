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

The first block's parent: vLLM does not use None but NONE_HASH, 32 random bytes drawn at start-up
(os.urandom; its source says: against hash collisions, as Python salts its own hash()), or the hash
of PYTHONHASHSEED when that is set, so that processes can share the seed: processes that must agree
on block hashes (the prefill and decode instances of a disaggregated set-up, a router reading
KV-cache events) need the same PYTHONHASHSEED. kvlab keeps a fixed seed, the parent None, so that a
block's hash is the same in every process and every run: tests can pin a digest and notebooks show
the same hashes each time. (vLLM's cache_salt, for isolating tenants, has no counterpart here.)
"""

import hashlib
import pickle
from collections.abc import Hashable, Sequence

BlockHash = bytes


def hash_block_tokens(parent_block_hash: BlockHash | None, token_ids: Sequence[int],
                      extra_keys: Hashable | None = None) -> BlockHash:
    """The hash of one full block given its parent's hash (None for the first block: kvlab's fixed seed)."""
    key = (parent_block_hash, tuple(int(t) for t in token_ids), extra_keys)
    return hashlib.sha256(pickle.dumps(key, protocol=5)).digest()


def block_hashes(token_ids: Sequence[int], block_size: int, extra_keys: Hashable | None = None) -> list[BlockHash]:
    """Hashes of every full block of a sequence, first block first; a partly filled last block gets none."""
    hashes: list[BlockHash] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start:start + block_size], extra_keys)
        hashes.append(parent)
    return hashes
