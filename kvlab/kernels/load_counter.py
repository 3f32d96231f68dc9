"""Count, in Triton's interpreter, the bytes a kernel's loads request from each tensor: the cost model of Chapter 7.

On a GPU a decode step is bound by the bytes it moves from memory. In the interpreter every masked
load passes through one method; counting the lanes it lets through, per tensor, gives the bytes a
kernel requests, repeats included. Divided by the bytes the pool holds for the batch's tokens, that
is how many times each cached byte is read: 1.0 is the ideal a GPU kernel aims for.

The same method (and its twin for stores) is where refuse_out_of_bounds stops a lane that points
outside every tensor passed, before the interpreter dereferences it: on a CPU such an address is
whatever memory lies there, and reading or writing it can end the process.
"""

import contextlib

import numpy as np
import torch


@contextlib.contextmanager
def count_requested_bytes(**tensors: torch.Tensor):
    """Within the block, the bytes interpreted loads request from each named tensor: {name: bytes, "elsewhere": n}.

    Only interpreted kernels are counted (TRITON_INTERPRET=1); "elsewhere" counts lanes outside every tensor.
    """
    from triton.runtime.interpreter import InterpreterBuilder

    spans = [(name, t.data_ptr(), t.element_size(), t.numel()) for name, t in tensors.items()]
    counts = {name: 0 for name in tensors} | {"elsewhere": 0}
    original = InterpreterBuilder.create_masked_load

    def create_masked_load(self, ptrs, mask, other, *args):
        addresses = np.broadcast_to(ptrs.data, mask.data.shape)[mask.data].astype(np.int64)
        known = np.zeros(addresses.shape, dtype=bool)
        for name, start, size, numel in spans:
            inside = (addresses >= start) & (addresses < start + size * numel)
            counts[name] += int(inside.sum()) * size
            known |= inside
        counts["elsewhere"] += int((~known).sum())
        return original(self, ptrs, mask, other, *args)

    InterpreterBuilder.create_masked_load = create_masked_load
    try:
        yield counts
    finally:
        InterpreterBuilder.create_masked_load = original


def kv_bytes_held(k_cache: torch.Tensor, seq_lens) -> int:
    """Bytes one pool [num_blocks, block_size, num_kv_heads, head_dim] holds for sequences of these lengths."""
    _, _, num_kv_heads, head_dim = k_cache.shape
    return int(sum(int(n) for n in seq_lens)) * num_kv_heads * head_dim * k_cache.element_size()


class OutOfBounds(RuntimeError):
    """An interpreted load or store whose masked-in lanes point outside every tensor the kernel was given."""


def _lanes(ptrs, mask) -> np.ndarray:
    """The byte addresses of the lanes a masked load or store lets through, as int64 [n]."""
    return np.broadcast_to(ptrs.data, mask.data.shape)[mask.data].astype(np.int64)


@contextlib.contextmanager
def refuse_out_of_bounds(**tensors: torch.Tensor):
    """Within the block, an interpreted load or store with a lane outside every named tensor raises OutOfBounds.

    The check runs before the interpreter touches memory, so a kernel that would read or write a wild
    address fails with a message instead of ending the process. Only interpreted kernels are checked.
    """
    from triton.runtime.interpreter import InterpreterBuilder

    spans = [(name, t.data_ptr(), t.data_ptr() + t.element_size() * t.numel()) for name, t in tensors.items()]
    load, store = InterpreterBuilder.create_masked_load, InterpreterBuilder.create_masked_store

    def refuse(kind: str, addresses: np.ndarray) -> None:
        if not addresses.size:
            return
        low, high = int(addresses.min()), int(addresses.max())
        if any(start <= low and high < end for _, start, end in spans):  # the usual case: all lanes in one tensor
            return
        inside = np.zeros(addresses.shape, dtype=bool)
        for _, start, end in spans:
            inside |= (addresses >= start) & (addresses < end)
        if not inside.all():
            wild = int(addresses[~inside][0])
            nearest = min(spans, key=lambda span: min(abs(wild - span[1]), abs(wild - span[2])), default=None)
            where = ""
            if nearest is not None:
                name, start, end = nearest
                where = (f"; the nearest tensor is {name}, and the address is {wild - start:+d} bytes from its start "
                         f"({end - start} bytes long)")
            raise OutOfBounds(f"a {kind} had {int((~inside).sum())} lane(s) pointing outside every tensor passed "
                              f"to the kernel{where}. It was stopped before touching memory: mask that {kind} "
                              "(mask=...) so that only lanes inside their tensor are enabled")

    def create_masked_load(self, ptrs, mask, other, *args):
        refuse("load", _lanes(ptrs, mask))
        return load(self, ptrs, mask, other, *args)

    def create_masked_store(self, ptrs, value, mask, *args):
        refuse("store", _lanes(ptrs, mask))
        return store(self, ptrs, value, mask, *args)

    InterpreterBuilder.create_masked_load = create_masked_load
    InterpreterBuilder.create_masked_store = create_masked_store
    try:
        yield
    finally:
        InterpreterBuilder.create_masked_load = load
        InterpreterBuilder.create_masked_store = store


def out_of_bounds_cause(err: BaseException) -> OutOfBounds | None:
    """The OutOfBounds behind err (the interpreter wraps what a kernel raises), or None."""
    seen = set()
    while err is not None and id(err) not in seen:
        if type(err).__name__ == "OutOfBounds":   # also a copy of this module loaded afresh by the checks
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def main() -> None:
    """Print the bytes kvlab's decode kernels request, per cached byte, for several head layouts (interpreter only)."""
    from kvlab.kernels import paged_attention_decode, paged_attention_decode_split_kv
    from kvlab.kernels.interpreter import RUNS_IN_INTERPRETER

    if not RUNS_IN_INTERPRETER:
        raise SystemExit("the counter reads the interpreter's loads: run with TRITON_INTERPRET=1")
    seq_lens, head_dim, block_size = [100, 37], 32, 16
    print(f"two sequences of {seq_lens[0]} and {seq_lens[1]} tokens, head_dim {head_dim}, block size {block_size}: "
          "K bytes requested / K bytes the sequences hold (V is the same)")
    print("| query heads : KV heads | unified kernel (one-pass decode) | split-KV kernel, 2 splits |")
    print("|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for num_heads, num_kv_heads, label in ((32, 4, "GQA 8:1"), (16, 4, "GQA 4:1"), (32, 8, "Llama-3-8B"),
                                           (32, 1, "MQA"), (8, 8, "MHA")):
        needed = [-(-n // block_size) for n in seq_lens]
        k = torch.randn(sum(needed), block_size, num_kv_heads, head_dim, generator=gen)
        v = torch.randn_like(k)
        tables = torch.zeros(len(seq_lens), max(needed), dtype=torch.int32)
        for i, n in enumerate(needed):
            tables[i, :n] = torch.arange(sum(needed[:i]), sum(needed[:i]) + n, dtype=torch.int32)
        lens = torch.tensor(seq_lens, dtype=torch.int32)
        q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen)
        ratios = []
        for fn in (paged_attention_decode, lambda *a: paged_attention_decode_split_kv(*a, num_splits=2)):
            with count_requested_bytes(k_cache=k) as reads:
                fn(q, k, v, tables, lens)
            ratios.append(reads["k_cache"] / kv_bytes_held(k, seq_lens))
        print(f"| {num_heads} : {num_kv_heads} ({label}) | {ratios[0]:.2f}x | {ratios[1]:.2f}x |")


if __name__ == "__main__":
    main()
