"""Greedy decoding of several sequences at once on a paged cache; sequences join and finish at any step.

Each step is one forward pass over a ragged batch: a newly arrived sequence contributes its whole
prompt (prefill), every other running sequence its last token (decode). There is no scheduler and
no preemption yet (Chapter 6): a step that needs more blocks than are free raises MemoryError
before touching the pool.

The loop talks to its block manager only through the vocabulary every chapter's manager shares
(kvlab.core.paging.BaseBlockManager): a joining sequence asks get_computed_blocks for cached
blocks of its prompt (Chapter 3's BlockManager never has any) and feeds the model only the rest,
so Chapter 4's PrefixCachingGenerator is this loop with a KVCacheManager plugged in.
"""

from dataclasses import dataclass, field

from kvlab.cache.paged_cache import PagedKVCache
from kvlab.cache.ragged_batch import SequenceChunk, forward_batch, last_token_logits
from kvlab.core.paging import BaseBlockManager, BlockManager
from kvlab.model.config import check_fits_context


@dataclass(slots=True)
class Sequence:
    """One request: its prompt, what it has generated so far, and when it arrives."""

    seq_id: int
    prompt_ids: list[int]
    max_new_tokens: int
    arrival_step: int = 0
    output_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        """Whether it has generated all of its tokens."""
        return len(self.output_ids) >= self.max_new_tokens


class PagedGenerator:
    """Runs a real model greedily over many sequences whose K/V live in one shared block pool.

    block_manager: any manager of the common block-manager API (by default Chapter 3's BlockManager
    of num_blocks blocks of block_size tokens); with prefix caching, joining prompts skip their hits.
    """

    # Whether the pre-step block count may overestimate the need (prefix hits found during the step lower it).
    block_need_is_upper_bound = False

    def __init__(self, model, num_blocks: int, block_size: int = 16, max_blocks_per_seq: int | None = None,
                 block_manager: BaseBlockManager | None = None):
        if block_manager is None:
            block_manager = BlockManager(num_blocks, block_size, max_blocks_per_seq)
        if (block_manager.num_blocks, block_manager.block_size) != (num_blocks, block_size):
            raise ValueError(f"the block manager has {block_manager.num_blocks} blocks of {block_manager.block_size}, "
                             f"the generator was asked for {num_blocks} blocks of {block_size}")
        self.model = model
        self.block_manager = block_manager
        self.cache = PagedKVCache.for_model(model, num_blocks, block_size)
        self.block_size = block_size
        self.sequences: dict[int, Sequence] = {}
        self.running: list[Sequence] = []
        self.finished: list[Sequence] = []
        self.step_count = 0
        self.prefill_tokens_fed = 0  # prompt tokens that actually went through the model
        self.num_cached_tokens: dict[int, int] = {}  # seq id -> prompt tokens served from the cache at admission
        self.last_hit_blocks: set[int] = set()  # block ids that were prefix-cache hits in the last step

    def add_request(self, prompt_ids, max_new_tokens: int, arrival_step: int = 0) -> int:
        """Queue a prompt that joins at `arrival_step`; returns its sequence id."""
        prompt_ids = [int(t) for t in prompt_ids]
        check_fits_context(self.model, len(prompt_ids), max_new_tokens)
        seq = Sequence(len(self.sequences), prompt_ids, max_new_tokens, arrival_step)
        self.sequences[seq.seq_id] = seq
        return seq.seq_id

    @property
    def waiting(self) -> list[Sequence]:
        """Sequences that have not started yet."""
        started = {s.seq_id for s in self.running + self.finished}
        return [s for s in self.sequences.values() if s.seq_id not in started]

    def has_unfinished(self) -> bool:
        """Whether any sequence is still waiting or running."""
        return len(self.finished) < len(self.sequences)

    def step(self) -> list[int]:
        """One forward pass for every running sequence; returns the ids of sequences that finished."""
        manager = self.block_manager
        joining = [s for s in self.waiting if s.arrival_step <= self.step_count]
        batch = self.running + joining
        self.step_count += 1
        self.last_hit_blocks = set()
        if not batch:
            return []
        # Blocks for the whole prompt of each joining sequence and one token of each running one. Hits
        # never make a joining sequence take more than that, so once this passes no allocation below
        # can fail halfway through the batch.
        needed = sum(manager.num_blocks_to_allocate(s.seq_id, len(s.prompt_ids) if s in joining else 1) for s in batch)
        if needed > manager.num_free_blocks:
            bound = "up to " if self.block_need_is_upper_bound else ""
            raise MemoryError(f"this step needs {bound}{needed} new blocks but only {manager.num_free_blocks} are free")
        chunks = []
        for s in batch:
            if s in joining:
                # Looked up one at a time: a request joining later in the batch may hit blocks that one
                # joining before it has just filled (see kvlab.decoding.prefix_generate).
                hits, start = manager.get_computed_blocks(s.seq_id, s.prompt_ids)
                new_ids = s.prompt_ids[start:]
                self.num_cached_tokens[s.seq_id] = start
                self.last_hit_blocks.update(b.block_id for b in hits)
                self.prefill_tokens_fed += len(new_ids)
            else:
                hits, new_ids, start = [], [s.output_ids[-1]], s.num_tokens - 1
            slots = manager.allocate_slots(s.seq_id, len(new_ids), hits, new_token_ids=new_ids)
            chunks.append(SequenceChunk(new_ids, start, manager.block_tables[s.seq_id], slots))
        logits, layout = forward_batch(self.model, self.cache, chunks)
        done = []
        for seq, token in zip(batch, last_token_logits(logits, layout.query_lens).argmax(-1).tolist()):
            seq.output_ids.append(token)
            if seq.finished:
                manager.free(seq.seq_id)
                self.finished.append(seq)
                done.append(seq.seq_id)
        self.running = [s for s in batch if not s.finished]
        return done

    def sequence_views(self, block_tables: dict, num_tokens: dict) -> list[dict]:
        """Each sequence's status, block table and tokens as plain data, by id (for the block map)."""
        running = {s.seq_id for s in self.running}
        finished = {s.seq_id for s in self.finished}
        views = []
        for seq_id in sorted(self.sequences):
            seq = self.sequences[seq_id]
            views.append({
                "id": seq_id,
                "status": "finished" if seq_id in finished else "running" if seq_id in running else "waiting",
                "block_table": list(block_tables.get(seq_id, [])),
                "tokens_stored": num_tokens.get(seq_id, 0),
                "prompt_ids": list(seq.prompt_ids),
                "output_ids": list(seq.output_ids),
                "arrival_step": seq.arrival_step,
            })
        return views

    def run(self) -> list[list[int]]:
        """Step until every sequence is done; returns each sequence's new tokens, by sequence id."""
        while self.has_unfinished():
            self.step()
        return [self.sequences[i].output_ids for i in sorted(self.sequences)]
