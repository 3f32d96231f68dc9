"""Chapter 3's paging: fixed-size blocks, per-sequence block tables, and slot mapping.

A sequence's token at position p lives in logical block p // block_size, at offset p % block_size.
The block table maps logical block i to a physical block of the pool, so the token's K and V sit at

    slot = block_table[p // block_size] * block_size + p % block_size

in a pool viewed as [num_blocks * block_size, num_kv_heads, head_dim]. The block table is a plain
software structure (a list of ints), not hardware: the attention kernel reads it to find the blocks.
"""

from collections import deque

from kvlab.validation import check_block_size, check_positive_int


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


class BlockManager:
    """Per-sequence block tables over a pool of num_blocks physical blocks, handed out from a free list."""

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

    def blocks_to_append(self, seq_id, num_new_tokens: int) -> int:
        """New blocks the sequence needs to grow by num_new_tokens (0 while its last block has room)."""
        current = self.num_tokens.get(seq_id, 0)
        return num_blocks_needed(current + num_new_tokens, self.block_size) - num_blocks_needed(current, self.block_size)

    def can_append(self, seq_id, num_new_tokens: int = 1) -> bool:
        """Whether the pool has the blocks this growth needs (no side effects)."""
        return self.blocks_to_append(seq_id, num_new_tokens) <= self.num_free_blocks

    def append_slots(self, seq_id, num_new_tokens: int = 1) -> list[int]:
        """Grow the sequence by num_new_tokens (allocating blocks only as its last one fills); return their slots."""
        check_positive_int("num_new_tokens", num_new_tokens)
        needed = self.blocks_to_append(seq_id, num_new_tokens)
        table = self.block_tables.get(seq_id, [])
        # Check everything before changing anything, so a failed call leaves the pool as it was.
        if len(table) + needed > self.max_blocks_per_seq:
            raise ValueError(
                f"sequence {seq_id!r} would need {len(table) + needed} blocks; at most {self.max_blocks_per_seq} are allowed"
            )
        if needed > self.num_free_blocks:
            raise MemoryError(f"sequence {seq_id!r} needs {needed} more blocks but only {self.num_free_blocks} are free")
        table = self.block_tables.setdefault(seq_id, [])
        table.extend(self.free_block_ids.popleft() for _ in range(needed))
        start = self.num_tokens.get(seq_id, 0)
        self.num_tokens[seq_id] = start + num_new_tokens
        return [physical_slot(table, p, self.block_size) for p in range(start, start + num_new_tokens)]

    def free(self, seq_id) -> None:
        """Return all of the sequence's blocks to the pool."""
        if seq_id not in self.block_tables:
            raise KeyError(f"sequence {seq_id!r} holds no blocks: it is unknown or was already freed")
        self.free_block_ids.extend(self.block_tables.pop(seq_id))
        del self.num_tokens[seq_id]

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
