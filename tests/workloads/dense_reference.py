"""Brute-force (q, k) predicates of workloads W1-W8, for the oracle's self-test.

Deliberately written apart from oracle.py: each predicate is the text of workloads.md read
literally, positions are laid out one token at a time, and the default parameters are typed in
again, so that a slip in the interval builders (or in their constants) shows up as a mismatch.
Only the trace file reader is shared.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from oracle import load_trace

Predicate = Callable[[int, int], bool]

W2_LENGTHS = [2048, 1536, 3072, 1024, 2560, 512, 4096, 1280]
W3_PROMPTS = [3072, 1536, 2048, 4096]
W3_BASE = [384, 512, 640, 256, 768, 448, 320, 576]
W3_RESPONSES = [x for rot in range(8) for x in W3_BASE[rot:] + W3_BASE[:rot]]
W6_LENGTHS = [4096, 1024, 8192, 512, 2048, 3072, 256, 6144]


def _segments(lengths: Sequence[int], q_len: int) -> tuple[list[int], list[int]]:
    """Per position: start and (cut) length of its segment, cycling ``lengths`` token by token."""
    start: list[int] = []
    length: list[int] = []
    i = 0
    while len(start) < q_len:
        first = len(start)
        for _ in range(lengths[i % len(lengths)]):
            if len(start) == q_len:
                break
            start.append(first)
        length += [len(start) - first] * (len(start) - first)
        i += 1
    return start, length


def _prompt_groups(prompts: Sequence[int], responses: Sequence[int], group: int,
                   q_len: int) -> list[tuple[int, int, int | None]]:
    """Per position: (prompt start, prompt end, own response start or None for prompt rows)."""
    label: list[tuple[int, int, int | None]] = []
    sample = cursor = 0
    while len(label) < q_len:
        p0 = len(label)
        p1 = min(q_len, p0 + prompts[sample % len(prompts)])
        label += [(p0, p1, None)] * (p1 - p0)
        for _ in range(group):
            r0 = len(label)
            for _ in range(responses[cursor % len(responses)]):
                if len(label) == q_len:
                    break
                label.append((p0, p1, r0))
            cursor += 1
        sample += 1
    return label


def _hstu(q_len: int, lengths: Sequence[int] = W2_LENGTHS, contextual: int = 8,
          target_divisor: int = 8) -> Predicate:
    start, length = _segments(lengths, q_len)

    def visible(q: int, k: int) -> bool:
        o, n = start[q], length[q]
        targets = max(1, n // target_divisor)
        e = o + n - targets
        i = q - o
        if i >= n - targets:
            return o <= k < e or k == q
        if i < contextual:
            return o <= k < e
        return o <= k <= q

    return visible


def _document(q_len: int, lengths: Sequence[int] = W6_LENGTHS) -> Predicate:
    start, _ = _segments(lengths, q_len)
    return lambda q, k: start[q] <= k <= q


def _shared_prefix(q_len: int, prompts: Sequence[int] = W3_PROMPTS,
                   responses: Sequence[int] = W3_RESPONSES, group: int = 8) -> Predicate:
    label = _prompt_groups(prompts, responses, group, q_len)

    def visible(q: int, k: int) -> bool:
        p0, p1, r0 = label[q]
        if r0 is None:
            return p0 <= k <= q
        return p0 <= k < p1 or r0 <= k <= q

    return visible


def _clear(q_len: int, radius: int = 16, text: int = 512) -> Predicate:
    n = round((q_len - text) ** 0.5)
    assert text + n * n == q_len

    def visible(q: int, k: int) -> bool:
        if q < text or k < text:
            return True
        yq, xq = divmod(q - text, n)
        yk, xk = divmod(k - text, n)
        return (yq - yk) ** 2 + (xq - xk) ** 2 < radius ** 2

    return visible


def dense_predicate(name: str, q_len: int, **params) -> Predicate:
    """``visible(q, k)`` of built-in ``name`` at ``q_len`` with the oracle's parameter names."""
    if name == "causal":
        return lambda q, k: k <= q
    if name == "sliding_window":
        window = params.get("window", 4096)
        return lambda q, k: q - window < k <= q
    if name == "document_causal":
        return _document(q_len, **params)
    if name == "hstu":
        return _hstu(q_len, **params)
    if name == "shared_prefix":
        return _shared_prefix(q_len, **params)
    if name == "clear":
        return _clear(q_len, **params)
    context, generated = load_trace()
    if name == "trace_documents":
        return _document(q_len, [c + g for c, g in zip(context, generated)])
    if name == "trace_prompt_groups":
        return _shared_prefix(q_len, context, generated, **params)
    raise KeyError(name)
