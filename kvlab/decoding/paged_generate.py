"""Greedy decoding of several sequences at once on a paged cache; sequences join and finish at any step.

Each step is one forward pass over a ragged batch: a newly arrived sequence contributes its whole
prompt (prefill), every other running sequence its last token (decode). There is no scheduler and
no preemption yet (Chapter 6): a step that needs more blocks than are free raises MemoryError
before touching the pool.
"""

from dataclasses import dataclass, field


from kvlab.model.config import check_fits_context
from kvlab.cache.paged_cache import PagedKVCache
from kvlab.cache.ragged_batch import SequenceChunk, forward_batch, last_token_logits
from kvlab.core.paging import BlockManager


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
    """Runs a real model greedily over many sequences whose K/V live in one shared block pool."""

    def __init__(self, model, num_blocks: int, block_size: int = 16, max_blocks_per_seq: int | None = None):
        self.model = model
        self.block_manager = BlockManager(num_blocks, block_size, max_blocks_per_seq)
        self.cache = PagedKVCache.for_model(model, num_blocks, block_size)
        self.block_size = block_size
        self.sequences: dict[int, Sequence] = {}
        self.running: list[Sequence] = []
        self.finished: list[Sequence] = []
        self.step_count = 0

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
        joining = [s for s in self.waiting if s.arrival_step <= self.step_count]
        batch = self.running + joining
        self.step_count += 1
        if not batch:
            return []
        # Tokens each sequence feeds this step: the whole prompt when it joins, else its last token.
        feeds = [(s.prompt_ids, list(range(len(s.prompt_ids)))) if s in joining
                 else ([s.output_ids[-1]], [s.num_tokens - 1]) for s in batch]
        needed = sum(self.block_manager.blocks_to_append(s.seq_id, len(ids)) for s, (ids, _) in zip(batch, feeds))
        if needed > self.block_manager.num_free_blocks:
            raise MemoryError(f"this step needs {needed} new blocks but only {self.block_manager.num_free_blocks} are free")
        chunks = []
        for s, (ids, positions) in zip(batch, feeds):
            slots = self.block_manager.append_slots(s.seq_id, len(ids))
            chunks.append(SequenceChunk(ids, positions[0], self.block_manager.block_tables[s.seq_id], slots))
        logits, layout = forward_batch(self.model, self.cache, chunks)
        done = []
        for seq, token in zip(batch, last_token_logits(logits, layout.query_lens).argmax(-1).tolist()):
            seq.output_ids.append(token)
            if seq.finished:
                self.block_manager.free(seq.seq_id)
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
