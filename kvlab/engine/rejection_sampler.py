"""Speculative decoding's verification: which draft tokens to keep so the output follows the target model exactly.

A proposer (an n-gram match in the prompt, or a small draft model) guesses k tokens; the target model
scores all of them in one forward pass, which gives its distribution p at each of the k positions and
one more. Leviathan et al. (2023) and Chen et al. (2023) keep draft token x at position i with
probability min(1, p_i(x) / q_i(x)), q_i being the draft's distribution; at the first rejection the
token is drawn from the residual max(p_i - q_i, 0), renormalised, and the rest of the draft is dropped.
When all k are kept, a bonus token is drawn from the target's distribution at position k + 1. Every
emitted token then follows the target's distribution, as if the target had sampled it alone.

Without a distribution (draft_probs=None) q counts as one-hot on the proposed token: a draft token is
kept with probability p_i(x), and a rejection draws from p_i with x removed. That is what vLLM V1 does
for every proposer, not only n-gram lookup: its model runner hands the rejection sampler no draft
probabilities (draft_probs=None in vllm/v1/worker/gpu_model_runner.py), so EAGLE's, MTP's and a draft
model's tokens are verified as one-hot too, and those proposers draft greedily (the argmax of their
logits, vllm/v1/spec_decode/). kvlab keeps the papers' q-based rule for its draft model by default;
speculative_config's use_draft_probs=False verifies the vLLM way. Both keep the target's distribution;
they differ in how often a draft is kept. Greedy decoding is the limit: keep while the draft token is
the target's argmax, then emit the argmax. vLLM does all this in vllm/v1/sample/rejection_sampler.py for
a whole batch at once on the GPU; this is one request's verification, for clarity.
"""

import torch


def _check(draft_token_ids, target_probs, draft_probs) -> int:
    k = len(draft_token_ids)
    if target_probs.ndim != 2 or target_probs.shape[0] != k + 1:
        raise ValueError(f"target_probs must be [k + 1, vocab] = [{k + 1}, vocab] for {k} draft tokens (one more "
                         f"position for the bonus token); got {tuple(target_probs.shape)}")
    vocab = target_probs.shape[1]
    if draft_probs is not None and tuple(draft_probs.shape) != (k, vocab):
        raise ValueError(f"draft_probs must be [k, vocab] = [{k}, {vocab}]; got {tuple(draft_probs.shape)}")
    bad = [t for t in draft_token_ids if not 0 <= int(t) < vocab]
    if bad:
        raise ValueError(f"draft token {int(bad[0])} is outside the vocabulary of {vocab}")
    return k


def residual_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """Where a rejected position draws from: max(p - q, 0), renormalised; p [V] and q [V] are distributions.

    Accepting x with probability min(1, p(x) / q(x)) leaves exactly this much of p unclaimed, which is
    why the two steps together sample p. When q equals p nothing is ever rejected; p is returned then.
    """
    if target_probs.shape != draft_probs.shape or target_probs.ndim != 1:
        raise ValueError(f"p and q must be two distributions of the same vocabulary [V], got "
                         f"{tuple(target_probs.shape)} and {tuple(draft_probs.shape)}")
    residual = (target_probs.double() - draft_probs.double()).clamp_min(0.0)
    total = float(residual.sum())
    return target_probs.double() / float(target_probs.sum()) if total <= 0.0 else residual / total


def rejection_sample(draft_token_ids, target_probs: torch.Tensor, draft_probs: torch.Tensor | None = None,
                     generator: torch.Generator | None = None) -> list[int]:
    """The tokens to emit for one request: the kept draft prefix, then one recovered or bonus token.

    draft_token_ids: k proposed tokens; target_probs [k + 1, vocab]: the target's distribution at each draft
    position and one past them; draft_probs [k, vocab]: the draft model's, or None for a proposer without
    probabilities (n-gram: one-hot). Returns 1 to k + 1 token ids. The generator makes a seeded request
    reproducible: its draws happen in a fixed order (one uniform per examined position, then one sample).
    """
    k = _check(draft_token_ids, target_probs, draft_probs)
    p_all = target_probs.double()
    out = []
    for i in range(k):
        token = int(draft_token_ids[i])
        p = p_all[i]
        q = None if draft_probs is None else draft_probs[i].double()
        q_token = 1.0 if q is None else float(q[token])
        accept = float(p[token]) / q_token if q_token > 0 else 0.0
        if float(torch.rand((), generator=generator, dtype=torch.float64)) < min(1.0, accept):
            out.append(token)
            continue
        if q is None:  # one-hot draft: q is 1 on the proposed token
            q = torch.zeros_like(p)
            q[token] = 1.0
        out.append(int(torch.multinomial(residual_distribution(p, q), 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(p_all[k] / p_all[k].sum(), 1, generator=generator)))  # the bonus token
    return out


def greedy_verify(draft_token_ids, target_logits: torch.Tensor) -> list[int]:
    """Greedy verification: keep draft tokens while each is the target's argmax, then the target's argmax.

    target_logits [k + 1, vocab] (or probabilities: only the argmax matters). Returns 1 to k + 1 tokens,
    exactly what greedy decoding with the target alone would produce for these positions.
    """
    _check(draft_token_ids, target_logits, None)
    best = target_logits.argmax(dim=-1).tolist()
    out = []
    for token, wanted in zip(draft_token_ids, best):
        if int(token) != wanted:
            break
        out.append(wanted)
    out.append(best[len(out)])
    return out
