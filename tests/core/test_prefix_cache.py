"""Chapter 4: block hashes name a full block by its whole prefix, the same way in every process."""

import hashlib
import os
import pickle
import subprocess
import sys

from kvlab.core.prefix_cache import block_hashes, hash_block_tokens


def test_hash_chain_covers_the_whole_prefix():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7], 2)
    b = block_hashes([9, 9, 3, 4, 5, 6], 2)
    assert len(a) == 3 and len(b) == 3, "only full blocks get hashes"
    assert a[1] != b[1] and a[2] == hash_block_tokens(a[1], [5, 6])
    assert a[:2] == block_hashes([1, 2, 3, 4], 2), "equal prefixes, equal hashes"
    assert block_hashes([1], 2) == []


def test_extra_keys_change_the_hash_and_hashes_are_stable():
    assert hash_block_tokens(None, [1, 2], "lora-a") != hash_block_tokens(None, [1, 2], "lora-b")
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [1, 2], "lora-a")
    # SHA-256 of a pickle does not depend on the process: a fixed value can be checked.
    assert hash_block_tokens(None, [1, 2]) == hash_block_tokens(None, (1, 2))
    assert len(hash_block_tokens(None, [1])) == 32


# SHA-256 of pickle.dumps((None, (1, 2, 3, 4), None), protocol=5): the first block [1, 2, 3, 4],
# no parent, no extra keys. Computed once from kvlab.core.prefix_cache and written down here, so a
# block hash that drifts (Python's salted hash(), another serialisation, another digest) fails.
FIRST_BLOCK_1234 = "7ead1964a738ba2af62de93940fd69ac41b17a78a2462b98c5255b9e8ca33958"
# The block [5, 6, 7, 8] after it, chained on the hash above.
SECOND_BLOCK_5678 = "e5833490c8bb63127bda85a0240ce920441207bdcb89960bf45442143e195cef"
# [1, 2, 3, 4] with extra key "lora-a": a string, which Python's hash() salts per process.
FIRST_BLOCK_1234_LORA_A = "78be9007833488252c18a837ff27be57db905890a2c91c2b962169fbde9d8726"


def test_a_block_hash_is_sha256_of_the_documented_pickle():
    first = hash_block_tokens(None, [1, 2, 3, 4])
    assert first.hex() == FIRST_BLOCK_1234, "a block hash is a fixed SHA-256 digest, the same on every machine"
    key = pickle.dumps((None, (1, 2, 3, 4), None), protocol=5)
    assert first == hashlib.sha256(key).digest(), \
        "the hash is SHA-256 over pickle.dumps((parent hash, token ids as a tuple, extra keys), protocol=5)"
    second = hash_block_tokens(first, [5, 6, 7, 8])
    assert second.hex() == SECOND_BLOCK_5678 and block_hashes(list(range(1, 10)), 4) == [first, second], \
        "each block's hash folds in its parent's hash"
    assert second == hashlib.sha256(pickle.dumps((first, (5, 6, 7, 8), None), protocol=5)).digest()
    assert hash_block_tokens(None, [1, 2, 3, 4], "lora-a").hex() == FIRST_BLOCK_1234_LORA_A


def test_another_process_with_another_hash_seed_computes_the_same_hashes():
    code = ("from kvlab.core.prefix_cache import hash_block_tokens as h; "
            "print(h(None, [1, 2, 3, 4]).hex(), h(None, [1, 2, 3, 4], 'lora-a').hex())")
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed},
                             capture_output=True, text=True, check=True).stdout.split()
        assert out == [FIRST_BLOCK_1234, FIRST_BLOCK_1234_LORA_A], \
            f"PYTHONHASHSEED={seed} changed a block hash: two processes would disagree on a block's name"


def test_python_salts_the_hash_of_strings_not_of_tuples_of_ints():
    # What the chapter says about Python's hash(): PYTHONHASHSEED changes hash("lora-a") but not
    # hash((1, 2, 3, 4)). kvlab's SHA-256 avoids both the salting and hash()'s 64 bits.
    code = "print(hash((1, 2, 3, 4)), hash('lora-a'))"
    outs = [subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed},
                           capture_output=True, text=True, check=True).stdout.split() for seed in ("1", "2")]
    assert outs[0][0] == outs[1][0], "a tuple of ints hashes the same under every PYTHONHASHSEED"
    assert outs[0][1] != outs[1][1], "a str's hash depends on PYTHONHASHSEED"
