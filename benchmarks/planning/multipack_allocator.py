"""The multipack sampler's allocator, reproduced for benchmarks/planning/bench_packing.py (not part of evenflow).

Source: ``multipack_sampler.py`` of https://github.com/imoneoi/multipack_sampler (MIT licence, Copyright (c) 2023
One), the allocator Axolotl's multipack sampler derives from. It is not installed here, so its three functions are
restated in plain Python/numpy (the original compiles them with numba; the arithmetic is the same):

* ``ffd_check(a, c, n)``: can lengths ``a`` fit in ``n`` bins of capacity ``c`` by first fit decreasing?
* ``ffd_with_result(a, c, start)``: the first-fit-decreasing bins of ``a`` (ids offset by ``start``);
* ``allocate(lengths, cumsum, rank, c, n)``: from the front of the (shuffled) epoch, binary-search the longest
  prefix that first fit decreasing packs into ``n`` bins (one per rank), emit it as one step, repeat; the loop ends
  at the first prefix that fills fewer than ``n`` bins, and what is left is **dropped** (the sampler's
  ``drop_last`` behaviour: every rank runs the same number of steps).

MIT licence of the original: Permission is hereby granted, free of charge, to any person obtaining a copy of this
software and associated documentation files (the "Software"), to deal in the Software without restriction,
including without limitation the rights to use, copy, modify, merge, publish, distribute, sublicense, and/or sell
copies of the Software, and to permit persons to whom the Software is furnished to do so, subject to the following
conditions: The above copyright notice and this permission notice shall be included in all copies or substantial
portions of the Software. THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND.
"""

from __future__ import annotations

import numpy as np

__all__ = ["ffd_check", "ffd_with_result", "allocate", "multipack_steps"]


def ffd_check(a: np.ndarray, c: int, n: int) -> bool:
    """Whether ``a`` fits in ``n`` bins of capacity ``c`` by first fit decreasing."""
    bins = [c] * n
    for size in sorted(a.tolist(), reverse=True):
        for k in range(n):
            if bins[k] >= size:
                bins[k] -= size
                break
        else:
            return False
    return True


def ffd_with_result(a: np.ndarray, c: int, start_index: int) -> list[list[int]]:
    """First-fit-decreasing bins of ``a``, as lists of ``start_index + position``."""
    indices = np.argsort(a, kind="stable")[::-1]
    bins: list[int] = []
    result: list[list[int]] = []
    for idx, size in zip(indices.tolist(), a[indices].tolist()):
        for k in range(len(bins)):
            if bins[k] >= size:
                bins[k] -= size
                result[k].append(idx + start_index)
                break
        else:
            bins.append(c - size)
            result.append([idx + start_index])
    return result


def allocate(lengths: np.ndarray, lengths_cumsum: np.ndarray, c: int, n: int) -> list[list[list[int]]]:
    """Every step's ``n`` bins (positions in ``lengths``); the original returns rank ``rank``'s bin of each."""
    s, start, steps = 0, 0, []
    while True:
        lo, hi = 1, 1 + int(np.searchsorted(lengths_cumsum[start:], s + c * n, "right"))
        while hi - lo > 1:  # binary search [lo, hi) for the longest prefix that fits
            mid = (lo + hi) // 2
            if ffd_check(lengths[start:start + mid], c, n):
                lo = mid
            else:
                hi = mid
        batch = ffd_with_result(lengths[start:start + lo], c, start)
        if len(batch) < n:
            break
        start += lo
        s = int(lengths_cumsum[start - 1])
        steps.append(batch)
    return steps


def multipack_steps(lengths: np.ndarray, world_size: int, token_budget: int, seed: int = 0) -> list[list[list[int]]]:
    """``out[t][r]``: the sample ids rank r trains at step t, as the multipack sampler deals one epoch (a seeded
    permutation, then :func:`allocate`).

    >>> multipack_steps(np.array([5, 5, 5, 5, 3]), 2, 10)  # sample 1 (a 5) is left alone: fewer than 2 bins, dropped
    [[[0, 3], [2, 4]]]
    """
    order = np.random.default_rng(seed).permutation(len(lengths))
    ls = np.asarray(lengths, dtype=np.int64)[order]
    return [[order[b].tolist() for b in step] for step in allocate(ls, np.cumsum(ls), token_budget, world_size)]
