"""What a map-style dataset's saved state says about its data, so a resume onto other data -- or the same data in
another order -- is refused before it trains (``DynamicBatchLoader.load_state_dict``).

NOTE [ The resume fingerprint ]
    A state names samples by dataset index: resumed onto a dataset whose indices name other samples, some train
    twice and others never, with no error. Equal sample counts are common (the same files listed in another
    order by ``os.listdir``, a copy to another file system, a per-file sort, a dedup pass that breaks ties
    differently), so a state records, and ``load_state_dict`` compares:

    * ``tokens`` -- the token digests ([`token_digest()`][evenflow.runtime.shard_check.token_digest]) of ``READS``
      items, one at a fixed pseudo-random position in each of ``READS`` equal strata of the indices (every item when
      the dataset holds fewer), read in a fixed shuffled order of the strata. A reorder that moves a share q of
      the items leaves every read item in place with probability at most ``exp(-READS q)`` (q = 5 %: 3e-6); a
      reorder of whole files of at least ``n / READS`` items, or a sort inside files, moves read items and is
      refused. The first ``STABLE_READS`` are read twice: token content that changes between reads (random
      crops) cannot be compared, and is not.
    * ``lengths`` -- with ``lengths=`` given, a digest of every sample's length in index order (and the extra
      budgets' values): any reorder that moves a sample to an index of another length is refused, at ~25 ms
      per million samples. The reads then stop after ``LENGTHS_READ_S`` (at least ``STABLE_READS`` of them):
      the lengths catch what reads would, but for swaps of equal length. Without lengths they stop after
      ``READ_S`` (at least ``MIN_READS``: a reorder moving half the items is then missed with probability
      2^-32), so slow items (video decoding) cannot hold a checkpoint for long. A state records how many items
      it read; a resume reads the same ones (a prefix of the same shuffled order).

    What passes: a swap of items of equal length that no read item sees (with ``lengths=``), or any reorder
    that leaves the ``READS`` read items in place (without it). Either part that could not be taken (reads
    past the bound, items without ``input_ids``, content that changes between reads) is not compared, and the
    resume warns on that rank naming why. Cost: at most ``READS + STABLE_READS`` ``__getitem__`` calls in the
    main process, once per loader when it saves its first state and once when it loads one: about
    ``LENGTHS_READ_S`` plus ``STABLE_READS`` re-reads with ``lengths=`` (measured on a million samples: 0.1 s
    for instant items, 1.9 s at 100 ms an item), ``READ_S`` without, unless single items take longer; all
    bounded by ``worker_timeout``.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from time import perf_counter

import numpy as np

from ..planning.alignment import config_fingerprint
from .shard_check import token_digest

__all__ = ["READS", "STABLE_READS", "MIN_READS", "LENGTHS_READ_S", "READ_S", "ResumePrint", "read_positions",
           "resume_print", "compare_prints"]

READS = 256
"""Items whose token content a state records (fewer when the dataset holds fewer)."""
STABLE_READS = 8
"""Of them, the first read a second time: content that changes between reads is not compared."""
LENGTHS_READ_S = 1.0
"""With ``lengths=``, reading stops after this long (having read at least ``STABLE_READS`` items)."""
MIN_READS = 32
READ_S = 10.0
"""Without ``lengths=``, reading stops after this long, having read at least ``MIN_READS`` items."""
_SEED = 0x5EED_0F_DA7A
"""Fixed: the positions depend on the dataset's length only, so a save and a load read the same ones."""


def read_positions(n: int, reads: int = READS) -> np.ndarray:
    """One position per stratum of ``[0, n)`` cut in ``reads`` equal parts (every index when ``n <= reads``), in a
    fixed shuffled order of the strata, so that any prefix is spread over the dataset too."""
    rng = np.random.default_rng(_SEED)
    if n <= reads:
        return rng.permutation(n).astype(np.int64)
    edges = (np.arange(reads + 1, dtype=np.int64) * n) // reads
    positions = edges[:-1] + (rng.random(reads) * np.diff(edges)).astype(np.int64)
    return positions[rng.permutation(reads)]


def _digest_arrays(arrays: Sequence[np.ndarray]) -> int:
    h = hashlib.blake2b(digest_size=8)
    for arr in arrays:
        arr = np.ascontiguousarray(arr, dtype=np.int64)
        h.update(repr(arr.shape).encode())
        h.update(arr.data)
    return int.from_bytes(h.digest(), "little") >> 2


@dataclass(frozen=True)
class ResumePrint:
    """The two parts of a map-style dataset's resume fingerprint (NOTE [ The resume fingerprint ])."""

    reads: int
    """Items whose token content ``tokens`` covers (``min(READS, n)``)."""
    tokens: int | None
    """Their digests' fingerprint; None when it could not be taken (``why`` says so)."""
    lengths: int | None
    """The digest of ``lengths=`` in index order; None without ``lengths=``."""
    why: str = ""
    """Why ``tokens`` is None."""

    def as_state(self) -> dict:
        return {"reads": self.reads, "tokens": self.tokens, "lengths": self.lengths}


def resume_print(dataset: Sequence, lengths: Sequence[np.ndarray] | None, limit_s: float | None, *,
                 reads: int | None = None) -> ResumePrint:
    """Read ``dataset``'s fingerprint: the first ``reads`` items of [`read_positions()`][read_positions] (``None``: up
    to ``READS``, stopping past ``LENGTHS_READ_S`` with ``lengths``, ``READ_S`` without), the first ``STABLE_READS``
    of them twice, all within ``limit_s`` (past it the reader thread is left behind, a daemon, and ``tokens`` is
    None)."""
    n = len(dataset)
    picks = read_positions(n).tolist()[:reads]
    lengths_print = None if lengths is None else _digest_arrays(lengths)
    soft, least = (LENGTHS_READ_S, STABLE_READS) if lengths is not None else (READ_S, MIN_READS)
    soft = None if reads is not None else soft  # a resume reads what the state read
    got: list = []

    def read() -> None:
        started, first = perf_counter(), []
        try:
            for i in picks:
                if soft is not None and len(first) >= least and perf_counter() - started > soft:
                    break
                first.append(token_digest(dataset[i]))
            got.append(first)
            got.append([token_digest(dataset[i]) for i in picks[:min(STABLE_READS, len(first))]])
        except Exception as exc:  # noqa: BLE001 - a failing item is named by the epoch's own stream
            got.append(exc)

    reader = threading.Thread(target=read, name="evenflow-resume-print", daemon=True)
    reader.start()
    reader.join(limit_s)
    got = list(got)  # what was read in time (a reader left behind may still append)
    why = ""
    if len(got) < 2 or not isinstance(got[-1], list):
        why = (f"reading {len(picks) + STABLE_READS} items took longer than {limit_s} s (worker_timeout)"
               if not got or isinstance(got[-1], list) else f"reading an item failed ({got[-1]!r:.80})")
    elif any(d is None for d in got[0]):
        why = "its items are not mappings with integer input_ids"
    elif got[1] != got[0][:STABLE_READS]:
        why = "its token ids change between reads (random crops or prompts)"
    tokens = None if why else config_fingerprint("resume-reads", tuple(got[0]))
    return ResumePrint(len(got[0]) if not why else len(picks), tokens, lengths_print, why)


def compare_prints(saved: Mapping, now: ResumePrint, *, rank: int, n: int) -> tuple[ValueError | None, str]:
    """(the refusal, or None; a warning, or ``""``) for a state's ``data`` against this dataset's print."""
    if not isinstance(saved, Mapping) or set(saved) != {"reads", "tokens", "lengths"} or not all(
            isinstance(saved[k], int) and not isinstance(saved[k], bool) for k in saved if saved[k] is not None):
        return ValueError(f"cannot resume: state['data'] is {saved!r:.80}, expected the dict "
                          "{'reads', 'tokens', 'lengths'} a state records; the state was modified"), ""
    fix = ("Its indices would name other samples: some would train twice, others never. Resume with the saved "
           "dataset in its saved order (sort file lists: sorted(os.listdir(...)); the same dedup and filters), or "
           "start the epoch afresh without the state")
    if saved["lengths"] is not None and now.lengths is not None and saved["lengths"] != now.lengths:
        return ValueError(f"cannot resume on rank {rank}: the dataset is not the one the state was saved with, or "
                          f"not in its order: both have {n} samples, but their lengths (lengths=) in index order "
                          f"differ. {fix}"), ""
    compared = saved["tokens"] is not None and now.tokens is not None and saved["reads"] == now.reads
    if compared and saved["tokens"] != now.tokens:
        return ValueError(f"cannot resume on rank {rank}: the dataset is not the one the state was saved with, or "
                          f"not in its order: both have {n} samples, but the token content (input_ids and labels) "
                          f"of {now.reads} items spread over it differs (saved fingerprint {saved['tokens']}, this "
                          f"dataset's {now.tokens}). {fix}"), ""
    if compared:
        return None, ""
    why = now.why or "the state could not record it when it was saved"
    lengths = saved["lengths"] is not None and now.lengths is not None
    return None, (f"evenflow: rank {rank}: resumed without comparing the dataset's token content with the saved "
                  f"one ({why}); {'only its lengths (lengths=) and' if lengths else 'only'} its sample count "
                  f"({n}) were compared, so a reordered dataset would not be refused. Pass lengths= to compare every "
                  "sample's length in index order, and make sure the dataset is the saved one in its saved order")
