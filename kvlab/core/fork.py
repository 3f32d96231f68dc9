"""Chapter 5's fork and copy-on-write: sequences that share their parent's KV blocks until they diverge.

Forking a sequence (a new beam, one of n parallel samples) copies no K/V at all: the child's block
table lists the parent's blocks and each of them gains one reference. Full blocks never change
again, so they can stay shared forever. Only the last, partly filled block is a problem: the next
token of each sequence would be written into it. So before a sequence writes into a partly filled
block that someone else also holds, it takes a fresh block and orders a copy of the shared one
(copy-on-write); kvlab.cache.paged_cache.copy_blocks carries out such orders on the K and V pools of
every layer before the forward pass that writes the new token.

CowBlockManager speaks the block-manager vocabulary of kvlab.core.paging.BaseBlockManager and adds
two things: fork(parent_id, child_id), and the copy orders that allocate_slots makes, which wait in
the manager until take_copy_orders() hands them to the engine (vLLM V0's scheduler calls them
blocks_to_copy):

    slots = manager.allocate_slots(seq_id, 1)          # may swap a shared last block for a fresh one
    copy_blocks(cache, manager.take_copy_orders())     # [(src_block, dst_block), ...], before the forward pass
"""

from collections.abc import Sequence

from kvlab.core.block_pool import PooledBlockManager
from kvlab.core.paging import num_blocks_needed, slot_mapping_for


class CowBlockManager(PooledBlockManager):
    """Per-sequence block tables over a reference-counted BlockPool, with fork and copy-on-write.

    Every method checks everything before it changes anything: on an error the manager and the
    pool are exactly as they were.
    """

    def __init__(self, num_blocks: int, block_size: int = 16):
        super().__init__(num_blocks, block_size, enable_prefix_caching=False)
        self.copy_orders: list[tuple[int, int]] = []  # (src_block, dst_block) not yet taken by the engine
        self.freed: set = set()  # ids of sequences that finished and were freed (for clear error messages)

    # ----- queries -----
    def _needs_copy(self, request_id) -> bool:
        """Whether the next token of a running sequence lands in a partly filled block that another sequence holds."""
        blocks = self.req_to_blocks[request_id]
        return self.num_tokens[request_id] % self.block_size != 0 and blocks[-1].ref_cnt > 1

    def num_blocks_to_allocate(self, request_id, num_new_tokens: int, computed_blocks: Sequence = ()) -> int:
        """Blocks allocate_slots would take: new ones as the last block fills, plus 1 for a copy-on-write copy."""
        new = super().num_blocks_to_allocate(request_id, num_new_tokens, computed_blocks)
        copies = num_new_tokens > 0 and request_id in self.num_tokens and self._needs_copy(request_id)
        return new + int(copies)

    def _why_not_running(self, request_id, action: str) -> str:
        if request_id in self.freed:
            return ("double free: " if action == "free" else "") + "it has finished and its blocks were already freed"
        return "it is unknown"

    # ----- changes -----
    def allocate_slots(self, request_id, num_new_tokens: int, computed_blocks: Sequence = (),
                       new_token_ids: Sequence[int] | None = None) -> list[int]:
        """A new sequence's first num_new_tokens tokens (its prompt), or that many more of a running one: their slots.

        A full last block (or none) means fresh blocks; a partly filled last block that another
        sequence also holds is replaced by a fresh block that must first receive the shared one's
        K/V: the copy order (src_block, dst_block) joins copy_orders (see take_copy_orders). A
        partly filled block held by this sequence alone is written in place.
        """
        self._check_new_tokens(num_new_tokens, new_token_ids)
        self._check_no_computed_blocks(computed_blocks)
        self._check_free_blocks(request_id, self.num_blocks_to_allocate(request_id, num_new_tokens))
        pool, size = self.block_pool, self.block_size
        if request_id not in self.num_tokens:
            self.req_to_blocks[request_id] = []
            self.num_tokens[request_id] = 0
            self.freed.discard(request_id)
        blocks = self.req_to_blocks[request_id]
        start = self.num_tokens[request_id]
        if start and self._needs_copy(request_id):
            shared = blocks[-1]
            fresh = pool.get_new_blocks(1)[0]
            pool.free_blocks([shared])  # ref_cnt > 1: it stays with its other owners
            blocks[-1] = fresh
            self.copy_orders.append((shared.block_id, fresh.block_id))
        end = start + num_new_tokens
        blocks.extend(pool.get_new_blocks(num_blocks_needed(end, size) - len(blocks)))
        self.num_tokens[request_id] = end
        first = start // size  # only the blocks the new tokens land in, not the whole table, on every decode
        return slot_mapping_for([b.block_id for b in blocks[first:]], start - first * size, num_new_tokens, size)

    def take_copy_orders(self) -> list[tuple[int, int]]:
        """The copy-on-write orders (src_block, dst_block) made since the last call, oldest first; clears them.

        Run them (kvlab.cache.paged_cache.copy_blocks) before the forward pass that writes the new tokens.
        """
        orders, self.copy_orders = self.copy_orders, []
        return orders

    def fork(self, parent_id, child_id) -> None:
        """The child shares all of the parent's blocks (one more reference each) and its token count."""
        self._check_running(parent_id, "fork")
        if child_id in self.num_tokens:
            raise ValueError(f"cannot fork {parent_id!r} into {child_id!r}: sequence {child_id!r} already exists")
        blocks = self.req_to_blocks[parent_id]
        for block in blocks:
            block.ref_cnt += 1  # every block is held by the parent, so none of them is in the free queue
        self.req_to_blocks[child_id] = list(blocks)
        self.num_tokens[child_id] = self.num_tokens[parent_id]
        self.freed.discard(child_id)

    def _forget(self, request_id) -> None:
        self.freed.add(request_id)
        # A copy into a block that just went back to the pool has nobody left to read it.
        self.copy_orders = [(src, dst) for src, dst in self.copy_orders if self.block_pool.blocks[dst].ref_cnt > 0]
