"""Chapter 3's paging: fixed-size blocks, per-sequence block tables, and slot mapping.

A sequence's token at position p lives in logical block p // block_size, at offset p % block_size.
The block table maps logical block i to a physical block of the pool, so the token's K and V sit at

    slot = block_table[p // block_size] * block_size + p % block_size

in a pool viewed as [num_blocks * block_size, num_kv_heads, head_dim]. The block table is a plain
software structure (a list of ints), not hardware: the attention kernel reads it to find the blocks.

This module also sets the vocabulary that every chapter's block manager shares, under vLLM V1's
names (BaseBlockManager): Chapter 3's BlockManager below, Chapter 4's KVCacheManager (prefix
caching) and Chapter 5's CowBlockManager (fork and copy-on-write) are three implementations of it.
"""

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence

from kvlab.validation import check_block_size, check_int, check_positive_int


def num_blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold num_tokens tokens: the ceiling of num_tokens / block_size."""
    return -(-num_tokens // block_size)


def physical_slot(block_table: list[int], position: int, block_size: int) -> int:
    """The pool slot of the token at `position` of a sequence with this block table."""
    logical_block, offset = divmod(position, block_size)
    if not 0 <= logical_block < len(block_table):
        raise IndexError(f"position {position} is outside the sequence's {len(block_table)} blocks of {block_size}")
    return block_table[logical_block] * block_size + offset


def slot_mapping_for(block_table: list[int], start: int, num_tokens: int, block_size: int) -> list[int]:
    """The pool slots of positions start .. start + num_tokens - 1 of a sequence with this block table."""
    return [physical_slot(block_table, p, block_size) for p in range(start, start + num_tokens)]


class BaseBlockManager(ABC):
    """What every chapter's block manager does, under vLLM V1's names.

    A request (a sequence) is admitted by its first allocate_slots call and leaves with free():

        blocks, num_computed = manager.get_computed_blocks(request_id, prompt_ids)   # ([], 0) without prefix caching
        manager.num_blocks_to_allocate(request_id, n, blocks)   # blocks the call below takes (changes nothing)
        slots = manager.allocate_slots(request_id, n, blocks, new_token_ids=...)   # admit, or grow by n tokens
        manager.free(request_id)

    Queries: `block_size`, `num_blocks`, `num_free_blocks`, `num_used_blocks`, `block_tables`
    (request id -> its physical block ids, in logical order) and `num_tokens` (request id -> the
    tokens it stores), both plain dicts of the running requests.

    Errors are the same everywhere, and a call that raises has changed nothing: an unknown or
    already freed request is a KeyError that says so, running out of blocks a MemoryError, a bad
    argument a ValueError.
    """

    block_size: int
    num_blocks: int
    num_tokens: dict  # request id -> tokens stored, for every running request

    # ----- queries -----
    @property
    @abstractmethod
    def num_free_blocks(self) -> int:
        """Blocks that allocate_slots can still hand out."""

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one request."""
        return self.num_blocks - self.num_free_blocks

    def get_computed_blocks(self, request_id, token_ids: Sequence[int]) -> tuple[list, int]:
        """Blocks that already hold a prefix of token_ids, and the tokens they cover (changes nothing).

        A manager without prefix caching never has any: ([], 0).
        """
        self._check_new(request_id)
        return [], 0

    def num_blocks_to_allocate(self, request_id, num_new_tokens: int, computed_blocks: Sequence = ()) -> int:
        """Blocks allocate_slots(request_id, num_new_tokens, computed_blocks) would take from the free blocks.

        A request takes a new block only when its last one is full (0 while the last block has room).
        """
        current = self.num_tokens.get(request_id, 0)
        after = current + len(computed_blocks) * self.block_size + num_new_tokens
        held = num_blocks_needed(current, self.block_size)  # a request holds exactly the blocks its tokens fill
        return num_blocks_needed(after, self.block_size) - held - len(computed_blocks)

    def get_block_ids(self, request_id, start: int = 0) -> list[int]:
        """A running request's physical block ids from logical block `start` on, in logical order (a new list).

        What crosses from the block manager to the scheduler and on to the model runner: one request's
        table, or the tail of it that grew, instead of every request's table rebuilt.
        """
        self._check_running(request_id, "read the blocks of")
        return list(self.block_tables[request_id][start:])

    # ----- changes -----
    @abstractmethod
    def allocate_slots(self, request_id, num_new_tokens: int, computed_blocks: Sequence = (),
                       new_token_ids: Sequence[int] | None = None) -> list[int]:
        """Admit a new request (after its computed blocks) or grow a running one by num_new_tokens: their slots."""

    @abstractmethod
    def free(self, request_id) -> None:
        """Return the request's blocks: every block nobody else holds becomes free."""

    # ----- the checks every manager makes before it changes anything -----
    def _check_new_tokens(self, num_new_tokens: int, new_token_ids: Sequence[int] | None) -> None:
        check_int("num_new_tokens", num_new_tokens, 1)
        if new_token_ids is not None and len(new_token_ids) != num_new_tokens:
            raise ValueError(f"{len(new_token_ids)} new token ids for {num_new_tokens} new tokens")

    def _check_new(self, request_id) -> None:
        if request_id in self.num_tokens:
            raise ValueError(f"request {request_id!r} is already running: only a new request looks up the cache")

    def _check_no_computed_blocks(self, computed_blocks: Sequence) -> None:
        # Managers without prefix caching: get_computed_blocks never returns any.
        if len(computed_blocks):
            raise ValueError(f"{type(self).__name__} has no prefix cache: computed_blocks must be empty, "
                             f"got {len(computed_blocks)}")

    def _check_running(self, request_id, action: str) -> None:
        if request_id not in self.num_tokens:
            raise KeyError(f"request {request_id!r} holds no blocks ({self._why_not_running(request_id, action)}): "
                           f"cannot {action} it")

    def _why_not_running(self, request_id, action: str) -> str:
        return "it is unknown or was already freed"

    def _check_free_blocks(self, request_id, needed: int) -> None:
        if needed > self.num_free_blocks:
            raise MemoryError(f"request {request_id!r} needs {needed} more blocks "
                              f"but only {self.num_free_blocks} are free")


class BlockManager(BaseBlockManager):
    """Per-sequence block tables over a pool of num_blocks physical blocks, handed out from a free list.

    Freed blocks go to the back of the free list and new ones come from the front, so the block
    freed longest ago is reused first.
    """

    def __init__(self, num_blocks: int, block_size: int, max_blocks_per_seq: int | None = None):
        check_positive_int("num_blocks", num_blocks)
        self.block_size = check_block_size(block_size)
        self.num_blocks = num_blocks
        self.max_blocks_per_seq = max_blocks_per_seq or num_blocks
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.block_tables: dict[object, list[int]] = {}
        self.num_tokens: dict[object, int] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks not held by any sequence."""
        return len(self.free_block_ids)

    def allocate_slots(self, request_id, num_new_tokens: int, computed_blocks: Sequence = (),
                       new_token_ids: Sequence[int] | None = None) -> list[int]:
        """Grow the sequence by num_new_tokens (allocating blocks only as its last one fills); return their slots."""
        self._check_new_tokens(num_new_tokens, new_token_ids)
        self._check_no_computed_blocks(computed_blocks)
        needed = self.num_blocks_to_allocate(request_id, num_new_tokens)
        table = self.block_tables.get(request_id, [])
        # Check everything before changing anything, so a failed call leaves the pool as it was.
        if len(table) + needed > self.max_blocks_per_seq:
            raise ValueError(f"request {request_id!r} would need {len(table) + needed} blocks; "
                             f"at most {self.max_blocks_per_seq} are allowed")
        self._check_free_blocks(request_id, needed)
        table = self.block_tables.setdefault(request_id, [])
        table.extend(self.free_block_ids.popleft() for _ in range(needed))
        start = self.num_tokens.get(request_id, 0)
        self.num_tokens[request_id] = start + num_new_tokens
        return slot_mapping_for(table, start, num_new_tokens, self.block_size)

    def free(self, request_id) -> None:
        """Return all of the sequence's blocks to the back of the free list."""
        self._check_running(request_id, "free")
        self.free_block_ids.extend(self.block_tables.pop(request_id))
        del self.num_tokens[request_id]

    def owners(self) -> dict[int, object]:
        """Physical block id -> the sequence holding it."""
        return {block: seq for seq, table in self.block_tables.items() for block in table}

    def block_fill(self, block_id: int) -> int:
        """Tokens stored in a physical block (0 when free)."""
        for seq, table in self.block_tables.items():
            if block_id in table:
                index = table.index(block_id)
                return min(self.block_size, self.num_tokens[seq] - index * self.block_size)
        return 0
