"""Chapter 5's fork and copy-on-write: sequences that share their parent's KV blocks until they diverge.

Forking a sequence (a new beam, one of n parallel samples) copies no K/V at all: the child's block
table lists the parent's blocks and each of them gains one reference. Full blocks never change
again, so they can stay shared forever. Only the last, partly filled block is a problem: the next
token of each sequence would be written into it. So before a sequence writes into a partly filled
block that someone else also holds, it takes a fresh block and orders a copy of the shared one
(copy-on-write); kvlab.cache.paged_cache.copy_blocks carries out such orders on the K and V pools of
every layer before the forward pass that writes the new token.
"""

from dataclasses import dataclass, field

from kvlab.core.block_pool import BlockPool, KVCacheBlock
from kvlab.validation import check_block_size, check_int
from kvlab.core.paging import num_blocks_needed


@dataclass(slots=True)
class SequenceBlocks:
    """One sequence's block table and how many tokens it stores."""

    blocks: list[KVCacheBlock] = field(default_factory=list)
    num_tokens: int = 0


class CowBlockManager:
    """Per-sequence block tables over a reference-counted BlockPool, with fork and copy-on-write.

    Every method checks everything before it changes anything: on an error the manager and the
    pool are exactly as they were.
    """

    def __init__(self, num_blocks: int, block_size: int = 16):
        check_block_size(block_size)
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching=False)
        self.block_size = block_size
        self.seqs: dict[int, SequenceBlocks] = {}
        self.freed: set = set()  # ids of sequences that finished (for clear error messages)

    # ----- queries -----
    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.block_pool.num_used_blocks

    def block_table(self, seq_id) -> list[int]:
        """The physical block ids of a live sequence, in logical order."""
        return [b.block_id for b in self._live(seq_id, "read").blocks]

    @property
    def block_tables(self) -> dict:
        return {sid: [b.block_id for b in s.blocks] for sid, s in self.seqs.items()}

    def num_tokens(self, seq_id) -> int:
        return self._live(seq_id, "read").num_tokens

    def blocks_to_append(self, seq_id) -> int:
        """New blocks append_slot(seq_id) would take: 1 when the last block is full (or there is none) or shared and partly filled."""
        seq = self._live(seq_id, "append to")
        offset = seq.num_tokens % self.block_size
        if offset == 0 or not seq.blocks:
            return 1
        return 1 if seq.blocks[-1].ref_cnt > 1 else 0

    def _live(self, seq_id, action: str) -> SequenceBlocks:
        seq = self.seqs.get(seq_id)
        if seq is None:
            if seq_id in self.freed:
                raise ValueError(f"cannot {action} sequence {seq_id!r}: it has finished and its blocks were freed")
            raise ValueError(f"cannot {action} sequence {seq_id!r}: no such sequence")
        return seq

    # ----- changes -----
    def allocate(self, seq_id, n_tokens: int) -> list[int]:
        """A new sequence of n_tokens tokens (a prompt): its blocks, and the slot of every token."""
        check_int("n_tokens", n_tokens, minimum=0)
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} already exists")
        needed = num_blocks_needed(n_tokens, self.block_size)
        if needed > self.num_free_blocks:
            raise MemoryError(f"sequence {seq_id!r} needs {needed} blocks but only {self.num_free_blocks} are free")
        blocks = self.block_pool.get_new_blocks(needed)
        self.seqs[seq_id] = SequenceBlocks(blocks, n_tokens)
        self.freed.discard(seq_id)
        bs = self.block_size
        return [blocks[i // bs].block_id * bs + i % bs for i in range(n_tokens)]

    def fork(self, parent_id, child_id) -> None:
        """The child shares all of the parent's blocks (one more reference each) and its token count."""
        parent = self._live(parent_id, "fork")
        if child_id in self.seqs:
            raise ValueError(f"cannot fork {parent_id!r} into {child_id!r}: sequence {child_id!r} already exists")
        for block in parent.blocks:
            block.ref_cnt += 1  # every block is held by the parent, so none of them is in the free queue
        self.seqs[child_id] = SequenceBlocks(list(parent.blocks), parent.num_tokens)
        self.freed.discard(child_id)

    def append_slot(self, seq_id) -> tuple[int, tuple[int, int] | None]:
        """Room for one more token: (its slot, a copy order (src_block, dst_block) or None).

        A full last block (or none) means a fresh block; a partly filled last block that another
        sequence also holds is replaced by a fresh block that must first receive the shared one's
        K/V (copy-on-write); a partly filled block held by this sequence alone is written in place.
        """
        seq = self._live(seq_id, "append to")
        bs = self.block_size
        offset = seq.num_tokens % bs
        copy = None
        if offset == 0 or not seq.blocks:
            if self.num_free_blocks < 1:
                raise MemoryError(f"sequence {seq_id!r} needs a new block but none is free")
            seq.blocks.append(self.block_pool.get_new_blocks(1)[0])
        elif seq.blocks[-1].ref_cnt > 1:
            if self.num_free_blocks < 1:
                raise MemoryError(f"sequence {seq_id!r} must copy its shared last block but no block is free")
            shared = seq.blocks[-1]
            fresh = self.block_pool.get_new_blocks(1)[0]
            self.block_pool.free_blocks([shared])  # ref_cnt > 1: it stays with its other owners
            seq.blocks[-1] = fresh
            copy = (shared.block_id, fresh.block_id)
        slot = seq.blocks[-1].block_id * bs + offset
        seq.num_tokens += 1
        return slot, copy

    def free(self, seq_id) -> None:
        """Drop the sequence's reference to each of its blocks; only blocks nobody else holds become free."""
        seq = self.seqs.get(seq_id)
        if seq is None:
            if seq_id in self.freed:
                raise ValueError(f"double free: sequence {seq_id!r} was already freed")
            raise ValueError(f"cannot free sequence {seq_id!r}: no such sequence")
        # Last block first: a sequence's tail is the least likely to be shared, so it is reused first.
        self.block_pool.free_blocks(reversed(seq.blocks))
        del self.seqs[seq_id]
        self.freed.add(seq_id)
