"""External (host) proposer: drafts come from a Python callable.

``proposer(request_id, token_ids_so_far, k) -> k token ids``; ``token_ids_so_far`` is the prompt
followed by every committed output token (the pending one included). The drafts are verified by
the same round program as MTP drafts (``proposer="external"``), with a one-hot draft
distribution (the proposer is deterministic). Research code uses it for host-side drafting such as
prompt lookup; the tests use it to force every acceptance pattern.
"""

from __future__ import annotations

from typing import Callable, Sequence

Proposer = Callable[[str, Sequence[int], int], Sequence[int]]


def propose(proposer: Proposer, request_id: str, token_ids: Sequence[int], k: int,
            vocab_size: int) -> list[int]:
    """Call the proposer and check its answer: exactly ``k`` ids in ``[0, vocab_size)``.

    Raises ``ValueError`` naming the request and the bad value otherwise.
    """
    drafts = [int(t) for t in proposer(request_id, list(token_ids), k)]
    if len(drafts) != k:
        raise ValueError(f"external proposer returned {len(drafts)} drafts for request "
                         f"{request_id!r}; it must return exactly k={k} token ids.")
    bad = [t for t in drafts if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"external proposer returned token ids {bad} for request "
                         f"{request_id!r}, outside the vocabulary [0, {vocab_size}).")
    return drafts


def prompt_lookup_proposer(max_ngram: int = 3) -> Proposer:
    """A simple n-gram prompt-lookup proposer: find the latest earlier occurrence of the last
    ``n`` tokens (n = max_ngram..1) and propose the tokens that followed it (padded by repeating
    the last token)."""

    def proposer(request_id, ids, k):
        for n in range(min(max_ngram, len(ids) - 1), 0, -1):
            tail = ids[-n:]
            for start in range(len(ids) - n - 1, -1, -1):
                if ids[start:start + n] == tail:
                    cont = list(ids[start + n:start + n + k])
                    return (cont + [ids[-1]] * k)[:k]
        return [ids[-1]] * k

    return proposer
