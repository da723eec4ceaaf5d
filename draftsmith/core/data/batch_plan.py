"""Length-bucketed batch plans of whole samples: what an extraction job runs and its estimate probes."""

from __future__ import annotations


def token_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Group sample indices, sorted by length, into batches whose padded size stays within batch_tokens."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[i] <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches
