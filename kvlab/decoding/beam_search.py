"""Chapter 5's beam search on the paged cache: beams are forked sequences, so shared history costs no memory.

The search itself follows transformers' `generate(num_beams=k)` (version 5.x) step for step, so
that its sequences and scores can be checked against it:

* each running beam carries the sum of the log-softmax probabilities of its generated tokens; the
  k beams start identical, with scores [0, -1e9, ..., -1e9] so the first step only expands beam 0;
* every step takes the top 2k (more generally max(2, 1 + #eos) * k) continuations over all beams;
* a continuation that hits a stopping criterion (an EOS token, or reaching max_new_tokens) cannot run
  on: the best k of the rest become the next running beams. If it is among the top k of the
  candidates it becomes a finished hypothesis scored sum_logprob / (generated_len ** length_penalty),
  generated_len counting the new token (EOS included) but not the prompt, and joins the best k
  finished hypotheses kept so far;
* the search stops when every candidate hits a stopping criterion (max_new_tokens reached), when
  early_stopping is True and k hypotheses are finished, or when the best running beam, scored at
  its current length (at max length for early_stopping="never" with a positive length penalty),
  can no longer beat the worst of k finished hypotheses.

On the cache side, a parent's first child continues the parent's own sequence (it takes over its
block table), and each further child is a fork: a parent with c surviving children makes c - 1
forks, and the `forks` counter counts exactly those. The beams that have no child are freed, and
only then does each beam ask for a slot, the forks first: they copy the parent's partly filled last
block (copy-on-write, at most c - 1 copies), and the first child then writes into that block in
place. The copies run before the forward pass that writes the new tokens.
"""

import torch

from kvlab.cache.paged_cache import PagedKVCache, copy_blocks
from kvlab.cache.ragged_batch import SequenceChunk, forward_batch, last_token_logits
from kvlab.core.block_views import counters_for
from kvlab.core.fork import CowBlockManager
from kvlab.core.paging import num_blocks_needed
from kvlab.model.config import as_token_ids, check_fits_context, eos_token_ids
from kvlab.validation import check_positive_int

NEG = -1.0e9  # transformers' "impossible" score


class BeamSearch:
    """Beam search as an engine that runs one step at a time, so the block map can watch beams fork and die.

    The first `step()` prefills the prompt; each later step selects the next beams (as transformers
    does), then forks, frees, copies and runs one forward pass over the k new tokens. `done` turns
    True when the search stops; `results()` then gives the hypotheses.
    """

    def __init__(self, model, prompt_ids, beam_width: int, max_new_tokens: int, length_penalty: float = 1.0,
                 early_stopping: bool | str = False, num_blocks: int | None = None, block_size: int = 16,
                 kv_cache_dtype: str = "auto"):
        check_positive_int("beam_width", beam_width)
        check_positive_int("max_new_tokens", max_new_tokens)
        if early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {early_stopping!r}")
        self.prompt = as_token_ids(prompt_ids)
        check_fits_context(model, len(self.prompt), max_new_tokens)
        self.model = model
        self.k, self.P = beam_width, len(self.prompt)
        self.max_length = self.P + max_new_tokens
        self.length_penalty, self.early_stopping = length_penalty, early_stopping
        self.eos = set(eos_token_ids(model))
        self.keep = max(2, 1 + len(self.eos)) * self.k
        self.block_size = block_size
        if num_blocks is None:
            num_blocks = self.k * num_blocks_needed(self.max_length, block_size) + 1
        self.manager = CowBlockManager(num_blocks, block_size)
        self.cache = PagedKVCache.for_model(model, num_blocks, block_size, kv_cache_dtype=kv_cache_dtype)
        self.counters = {"peak_used_blocks": 0, "copies": 0, "forks": 0, "forward_passes": 0}

        k = self.k
        self.step_count = 0
        self.done = False
        self.log_probs = None           # [k, vocab] of the running beams' next tokens, once prefilled
        self.beam_seq = [0] * k         # the cache sequence of each running beam
        self.next_id = 1
        self.run_tokens: list[list[int]] = [[] for _ in range(k)]
        self.run_scores = torch.full((k,), NEG, dtype=torch.float32)
        self.run_scores[0] = 0.0
        self.fin_tokens: list[list[int]] = [[] for _ in range(k)]
        self.fin_scores = torch.full((k,), NEG, dtype=torch.float32)
        self.fin_done = torch.zeros(k, dtype=torch.bool)
        self.improvable = True  # can a running beam still beat the worst kept hypothesis?
        self.in_top_k = torch.arange(self.keep) < k
        self.cur = self.P  # tokens in every running beam (prompt + generated)
        # What the last step did, for the block map.
        self.last_copies: list[tuple[int, int]] = []
        self.last_dead = 0
        self.last_forked = 0

    def has_unfinished(self) -> bool:
        return not self.done

    @torch.inference_mode()
    def step(self) -> list:
        """One step: the prefill first, then select, fork, free, copy and decode; returns [] (or the hypotheses at
        the end)."""
        if self.done:
            raise RuntimeError("the beam search has finished; read results()")
        self.step_count += 1
        self.last_copies, self.last_dead, self.last_forked = [], 0, 0
        if self.log_probs is None:
            self._prefill()
            return []
        if self._select():
            for old in dict.fromkeys(self.beam_seq):
                self.manager.free(old)
            self.done = True
            return self.results()
        self._decode()
        return []

    def _prefill(self) -> None:
        # The prompt is prefilled once; every beam starts as that one sequence.
        P = self.P
        slots = self.manager.allocate_slots(0, P)
        prompt_chunk = SequenceChunk(self.prompt, 0, self.manager.block_tables[0], slots)
        logits, layout = forward_batch(self.model, self.cache, [prompt_chunk])
        logits = last_token_logits(logits, layout.query_lens)
        self.counters["forward_passes"] += 1
        self.counters["peak_used_blocks"] = self.manager.num_used_blocks
        self.log_probs = torch.log_softmax(logits.float(), dim=-1).expand(self.k, -1)

    def _select(self) -> bool:
        """Pick the next running beams and update the finished hypotheses; True when the search stops."""
        k, P = self.k, self.P
        vocab = self.log_probs.shape[-1]
        total = (self.log_probs + self.run_scores[:, None]).reshape(-1)
        cand_scores, cand_idx = torch.topk(total, self.keep)
        cand_parent = (cand_idx // vocab).tolist()
        cand_token = (cand_idx % vocab).tolist()
        reached_max = self.cur + 1 >= self.max_length
        hits = torch.tensor([reached_max or t in self.eos for t in cand_token], dtype=torch.bool)

        # The next running beams: the best candidates that can still continue.
        runnable = cand_scores + hits.to(torch.float32) * NEG
        chosen = torch.topk(runnable, k).indices.tolist()
        new_scores = runnable[chosen]

        # Finished hypotheses: candidates among the top k that just stopped, length-penalised.
        penalised = cand_scores / ((self.cur + 1 - P) ** self.length_penalty)
        if self.early_stopping is True and bool(self.fin_done.all()):
            penalised = penalised + NEG
        if not self.improvable:
            penalised = penalised + NEG
        just_finished = hits & self.in_top_k
        penalised = penalised + (~just_finished).to(torch.float32) * NEG
        merged_scores = torch.cat([self.fin_scores, penalised])
        merged_done = torch.cat([self.fin_done, just_finished])
        best = torch.topk(merged_scores, k).indices.tolist()
        merged_tokens = self.fin_tokens + [self.run_tokens[p] + [t] for p, t in zip(cand_parent, cand_token)]
        self.fin_tokens = [merged_tokens[i] for i in best]
        self.fin_scores, self.fin_done = merged_scores[best], merged_done[best]

        self.cur += 1
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_len = self.max_length - P
        else:
            best_len = self.cur - P
        best_running = new_scores[0] / (best_len ** self.length_penalty)
        worst_kept = torch.where(self.fin_done, self.fin_scores.min(), torch.tensor(NEG))
        self.improvable = self.improvable and bool((best_running > worst_kept).any())
        all_kept_done = bool(self.fin_done.all()) and self.early_stopping is True
        if not self.improvable or all_kept_done or bool(hits.all()):
            return True
        self._parents = [cand_parent[c] for c in chosen]
        self._new_tokens = [cand_token[c] for c in chosen]
        self._new_scores = new_scores
        return False

    def _decode(self) -> None:
        # Cache side, as Chapter 5 teaches: a parent's first child continues the parent's own sequence,
        # each further child is a fork (c - 1 forks for c children); then the dead beams are freed and
        # every beam takes a slot for its new token, the forks first so that the continuing parent
        # writes into its own last block and only the forks copy it.
        manager = self.manager
        parents = [self.beam_seq[p] for p in self._parents]
        children, forks = [], []
        for parent in parents:
            if parent in children:  # the parent's sequence is already taken by its first child
                child = self.next_id
                self.next_id += 1
                manager.fork(parent, child)
                forks.append(child)
            else:
                child = parent
            children.append(child)
        self.last_forked = len(forks)
        self.counters["forks"] += len(forks)
        dead = [old for old in dict.fromkeys(self.beam_seq) if old not in children]
        self.last_dead = len(dead)
        for old in dead:
            manager.free(old)
        slots = {child: manager.allocate_slots(child, 1) for child in forks}
        slots.update({child: manager.allocate_slots(child, 1) for child in children if child not in slots})
        new_slots = [slots[child] for child in children]
        copies = manager.take_copy_orders()  # copy-on-write of the forks' shared, partly filled last blocks
        copy_blocks(self.cache, copies)
        self.last_copies = copies
        self.counters["copies"] += len(copies)
        self.counters["peak_used_blocks"] = max(self.counters["peak_used_blocks"], manager.num_used_blocks)
        self.beam_seq = children
        self.run_tokens = [self.run_tokens[p] + [t] for p, t in zip(self._parents, self._new_tokens)]
        self.run_scores = self._new_scores

        block_tables = manager.block_tables
        chunks = [SequenceChunk([toks[-1]], self.cur - 1, block_tables[c], slots)
                  for toks, c, slots in zip(self.run_tokens, children, new_slots)]
        logits, _ = forward_batch(self.model, self.cache, chunks)  # one new token each: every row is a last token
        self.counters["forward_passes"] += 1
        self.log_probs = torch.log_softmax(logits.float(), dim=-1)

    def results(self) -> list[tuple[list[int], float]]:
        """The beam_width best hypotheses as (generated token ids, score), best first (once done)."""
        if not self.done:
            raise RuntimeError("the beam search is still running; step() until done")
        return [(toks, float(score)) for toks, score in zip(self.fin_tokens, self.fin_scores.tolist())]

    def stats(self) -> dict:
        """Block-usage counters: peak used blocks, copies, forks, forward passes, and blocks without sharing."""
        out = dict(self.counters)
        out["num_blocks"] = self.manager.num_blocks
        out["blocks_without_sharing"] = self.k * num_blocks_needed(self.cur - 1, self.block_size)
        return out

    def snapshot(self) -> dict:
        """The pool as the block map's plain data: beams as sequences 0..k-1, shared blocks, this step's copies."""
        manager, size = self.manager, self.block_size
        copied = {dst for _, dst in self.last_copies}
        blocks = [{"id": b.block_id, "owner": None, "owners": [], "fill": 0, "logical": None,
                   "ref_count": b.ref_cnt} for b in manager.block_pool.blocks]
        prefilled = self.log_probs is not None
        live = list(dict.fromkeys(self.beam_seq)) if prefilled and not self.done else []
        beam_of = {seq: i for i, seq in enumerate(live)}
        block_tables = manager.block_tables
        for seq in live:
            stored = manager.num_tokens[seq]
            for logical, block_id in enumerate(block_tables[seq]):
                entry = blocks[block_id]
                if entry["owner"] is None:
                    entry.update(owner=beam_of[seq], logical=logical)
                entry["owners"].append(beam_of[seq])
                entry["fill"] = max(entry["fill"], min(size, stored - logical * size))
        for block_id in copied:
            blocks[block_id]["copied"] = True
            blocks[block_id]["note"] = "copy-on-write copy made in the last step"
        sequences = []
        for seq in live:
            i = beam_of[seq]
            score = float(self.run_scores[i]) if self.cur > self.P else 0.0
            sequences.append({"id": i, "status": f"beam, log-prob {score:.2f}",
                              "block_table": block_tables[seq], "tokens_stored": manager.num_tokens[seq],
                              "prompt_ids": self.prompt, "output_ids": self.run_tokens[i]})
        for j, (toks, score, kept) in enumerate(zip(self.fin_tokens, self.fin_scores.tolist(), self.fin_done.tolist())):
            if kept:
                sequences.append({"id": f"h{j}", "status": f"finished, score {score:.3f}", "block_table": [],
                                  "tokens_stored": 0, "prompt_ids": self.prompt, "output_ids": toks})

        counters = counters_for(blocks, size, self.step_count)
        counters["extra"] = {"shared blocks": sum(len(b["owners"]) > 1 for b in blocks),
                             "beams died": self.last_dead, "forks": self.last_forked,
                             "copy-on-write copies": len(self.last_copies)}
        return {"block_size": size, "num_blocks": manager.num_blocks, "step": self.step_count, "done": self.done,
                "blocks": blocks, "sequences": sequences, "counters": counters}


def beam_search(model, prompt_ids, beam_width: int, max_new_tokens: int, length_penalty: float = 1.0,
                early_stopping: bool | str = False, num_blocks: int | None = None, block_size: int = 16,
                stats: dict | None = None, kv_cache_dtype: str = "auto") -> list[tuple[list[int], float]]:
    """The beam_width best hypotheses as (generated token ids, score), best first.

    Equal to transformers' `generate(num_beams=beam_width, num_return_sequences=beam_width,
    do_sample=False, ...)` `sequences` (without prompt and padding) and `sequences_scores`.
    `stats`, when given, receives block-usage counters (peak used blocks, copies, forks).
    `kv_cache_dtype` ("auto", "int8", "fp8") is the cache's storage; copy-on-write copies 8-bit blocks' scales too.
    """
    search = BeamSearch(model, prompt_ids, beam_width, max_new_tokens, length_penalty, early_stopping,
                        num_blocks, block_size, kv_cache_dtype)
    while not search.done:
        search.step()
    if stats is not None:
        stats.update(search.stats())
    return search.results()
