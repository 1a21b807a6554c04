"""Which KV the dense prefill path dequantizes, in which passes: host arithmetic on the step's lengths.

A step's long requests (prefill, chunked prefill) read the cache positions ``[lo, seq_len)``: all of
them, or with a sliding window W only the last ``q_len + W - 1``.  When those ranges fit the 16-bit
workspace together, one causal pass dequantizes them all and one dense kernel call serves every
request.  When they do not, the first pass dequantizes each request's own query positions (the causal
part, ``[seq_len - q_len, seq_len)``) and later passes the older prefix in chunks of at most the
workspace, attended without a mask and merged by log-sum-exp.  A pass serves a run of consecutive
requests, one KV segment each (the dense kernel's ragged batch); a request whose prefix is used up
ends a run.  Windowed requests always fit or fall back: a window's prefix chunk would need a mask
relative to positions the chunk does not hold.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Segment:
    """``length`` cache positions of request ``request`` from ``position`` on."""
    request: int
    position: int
    length: int


@dataclass(frozen=True)
class Pass:
    """One dequantize + dense-attention round: requests ``first_request ..`` (consecutive), one
    segment each, with the bottom-right causal mask (``causal``) or none."""
    causal: bool
    first_request: int
    segments: tuple[Segment, ...]

    @property
    def rows(self) -> int:
        """Workspace rows (tokens) the pass fills."""
        return sum(s.length for s in self.segments)

    @property
    def last_request(self) -> int:
        return self.first_request + len(self.segments)


def extend_requests(query_lens: list[int], decode_len: int) -> range | None:
    """The requests from the first to the last one longer than ``decode_len`` query tokens (None when
    there are none).  Shorter ones between them ride along: the dense kernel takes any query length,
    and the decode kernel's rows for them are overwritten (it leaves the long ones alone:
    ``extend``).  vLLM orders decodes first, SGLang's mixed batches last,
    so the range is the prefills."""
    longer = [b for b, n in enumerate(query_lens) if n > decode_len]
    return range(longer[0], longer[-1] + 1) if longer else None


def attention_pairs(query_lens: list[int], seq_lens: list[int], requests: range, sliding_window: int | None) -> int:
    """The (query, key) pairs ``requests`` attend to under the bottom-right causal mask and the window:
    the work of a step's long requests, which decides whether the dense path pays for its fixed cost."""
    def keys_up_to(m: int) -> int:  # sum over query positions p < m of the keys p sees: min(p + 1, window)
        w = sliding_window or m
        return m * (m + 1) // 2 if m <= w else w * (w + 1) // 2 + (m - w) * w
    return sum(keys_up_to(seq_lens[b]) - keys_up_to(seq_lens[b] - query_lens[b]) for b in requests)


def plan_passes(query_lens: list[int], seq_lens: list[int], requests: range, sliding_window: int | None,
                capacity: int) -> list[Pass] | None:
    """The passes over ``requests`` with at most ``capacity`` workspace rows each, the causal pass
    first; None when the step cannot run this way (the queries alone exceed the workspace, or a
    windowed step does not fit one pass)."""
    if capacity <= 0:
        return None
    spans = []  # (request, first position read, first query position, seq_len)
    for b in requests:
        q, length = query_lens[b], seq_lens[b]
        if not 0 < q <= length:
            raise ValueError(f"seq_lens[{b}] = {length} must hold the request's {q} query tokens")
        lo = max(0, length - q - sliding_window + 1) if sliding_window else 0
        spans.append((b, lo, length - q, length))
    if sum(length - lo for _, lo, _, length in spans) <= capacity:
        return [Pass(True, requests.start, tuple(Segment(b, lo, length - lo) for b, lo, _, length in spans))]
    if sliding_window or sum(length - start for _, _, start, length in spans) > capacity:
        return None
    passes = [Pass(True, requests.start, tuple(Segment(b, start, length - start) for b, _, start, length in spans))]
    run: list[Segment] = []

    def flush() -> None:
        if run:
            passes.append(Pass(False, run[0].request, tuple(run)))
            run.clear()

    for b, lo, start, _ in spans:
        if lo == start:  # no prefix: the run of consecutive requests ends here
            flush()
        while lo < start:
            room = capacity - sum(s.length for s in run)
            take = min(start - lo, room)
            run.append(Segment(b, lo, take))
            lo += take
            if take == room:
                flush()
    flush()
    return passes
