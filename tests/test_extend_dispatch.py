"""extend.attend_on_kernels' dispatch on the CPU, with the kernels and the side stream stubbed: which
kernel takes which requests, and the mixed step's fork and join around both launches (also when a
launch raises).  The kernels' numerics are tests/gpu's."""
from __future__ import annotations

import pytest
import torch

from nvfp4_backend import capabilities, extend, jit


class _Recorder:
    """Stands in for the built kernels and the side stream: records the calls in order."""

    def __init__(self, fail_prefill: bool = False):
        self.calls: list[tuple] = []
        self.fail_prefill = fail_prefill
        self.stream = None  # torch.cuda.stream(None) is a no-op, also on a CPU-only build

    def paged_prefill(self, *args):
        self.calls.append(("prefill", args[-2]))  # min_query_len
        if self.fail_prefill:
            raise RuntimeError("prefill launch failed")

    def paged_attention(self, *args):
        self.calls.append(("decode", args[15]))  # max_query_len: the decode kernel's share

    def fork(self):
        self.calls.append(("fork",))
        return "caller"

    def join(self, caller):
        self.calls.append(("join", caller))


def _call(monkeypatch, rec, max_query_len, decode_query_len, page_size=16):
    monkeypatch.setattr(jit, "load", lambda device: rec)
    monkeypatch.setattr(extend, "_side_stream", lambda device: rec)
    group, head_dim = 4, 128
    q = torch.zeros(10, 8 * group // 4, head_dim, dtype=torch.bfloat16)
    k_data = torch.zeros(4, page_size, 2, head_dim // 2, dtype=torch.uint8)
    k_scales = torch.zeros(4, page_size, 2, head_dim // 16, dtype=torch.uint8)
    extend.attend_on_kernels(torch.empty_like(q), q, k_data, k_scales, k_data.clone(), k_scales.clone(), None, None,
                             None, None, None, 0.1, 0, 0.0, None, max_query_len, 1, torch.empty(16), "none", 1, False,
                             decode_query_len)
    return rec.calls


def test_mixed_step_forks_runs_prefill_then_decode_beside_it_and_joins(monkeypatch):
    share = capabilities.decode_query_len(4, 128)
    calls = _call(monkeypatch, _Recorder(), max_query_len=700, decode_query_len=-1)
    assert calls == [("fork",), ("prefill", share + 1), ("decode", share), ("join", "caller")]


def test_a_planned_decode_share_splits_the_requests_there(monkeypatch):
    calls = _call(monkeypatch, _Recorder(), max_query_len=700, decode_query_len=2)
    assert calls == [("fork",), ("prefill", 3), ("decode", 2), ("join", "caller")]


@pytest.mark.parametrize("max_query_len, decode_query_len, want", [
    (1, -1, [("decode", 1)]),     # decodes only: one stream, no fork
    (700, 0, [("prefill", 1)]),   # the plan says no decode rows: the prefill kernel takes every request
])
def test_one_kernel_needs_no_fork(monkeypatch, max_query_len, decode_query_len, want):
    assert _call(monkeypatch, _Recorder(), max_query_len, decode_query_len) == want


def test_a_page_size_the_decode_kernel_cannot_shift_leaves_every_request_to_the_prefill_kernel(monkeypatch):
    assert _call(monkeypatch, _Recorder(), 1, -1, page_size=12) == [("prefill", 1)]


def test_a_failed_launch_still_joins_the_side_stream(monkeypatch):
    rec = _Recorder(fail_prefill=True)
    with pytest.raises(RuntimeError, match="prefill launch failed"):
        _call(monkeypatch, rec, max_query_len=700, decode_query_len=-1)
    assert rec.calls[0] == ("fork",) and rec.calls[-1] == ("join", "caller")
