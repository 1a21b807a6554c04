"""The support rules (``capabilities``): what the kernels serve, as the planner, the ops and the
plugins ask it."""
from __future__ import annotations

import pytest

from nvfp4_backend import capabilities


@pytest.mark.parametrize("head_dim, group, q_len, heads_per_block, allowed", [
    (128, 4, 2, 8, True), (64, 4, 4, 4, True), (128, 3, 3, 8, False), (128, 17, 1, 1, False),
    (256, 4, 1, 1, False), (128, 4, 1, 16, False), (128, 16, 1, 4, True), (128, 16, 1, 8, False)])
def test_fused_allowed_mirrors_the_binding(head_dim, group, q_len, heads_per_block, allowed):
    """capabilities.fused_allowed against csrc decode_fused_ok's rule (tests/csrc/binding_messages.cpp checks
    the C++ side on the same limits): D 64 / 128, up to 16 rows, 8 heads up to 8 rows, 4 past them."""
    assert capabilities.fused_allowed(head_dim, group, q_len, heads_per_block) == allowed


@pytest.mark.parametrize("group, q_len, heads_per_block, allowed", [
    (4, 1, 1, True), (4, 1, 2, True), (2, 1, 4, True), (4, 1, 4, False), (1, 1, 8, False), (4, 2, 2, False),
    (1, 1, 3, False), (8, 3, 1, True), (1, 1, 0, False)])
def test_heads_per_block_allowed(group, q_len, heads_per_block, allowed):
    """Static kernels: one kv head per block, or 2 or 4 in plain decode whose packed rows fit one row tile."""
    assert capabilities.heads_per_block_allowed(group, q_len, heads_per_block) == allowed


@pytest.mark.parametrize("group, q_len, head_dim, supported", [
    (4, 16, 128, True), (4, 17, 128, False), (16, 4, 64, True), (4, 8, 256, True), (4, 9, 256, False),
    (1, 1, 96, False), (4, 0, 128, False)])
def test_decode_supports_the_rows_of_one_block(group, q_len, head_dim, supported):
    """The decode kernel holds up to DECODE_MAX_ROWS query rows per (request, kv head): 64 at D 64 and
    128, 32 at D 256, none at a head dim it is not built for."""
    assert capabilities.decode_supports(group, q_len, head_dim) == supported


@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("group_size", [1, 4, 8, 16, 32, 64, 128])
def test_kernels_serve_any_batch_where_both_kernels_hold_the_group(head_dim, group_size):
    """A shape whose one-token requests fit a decode block and whose group fits a prefill block: any
    mix of a batch runs in one call (an engine's FULL graph of a mixed batch)."""
    want = 0 < group_size <= capabilities.decode_max_rows(head_dim) and group_size <= capabilities.prefill_rows(head_dim)
    assert capabilities.kernels_serve_any_batch(group_size, head_dim) == want
    assert capabilities.kernels_serve_any_batch(group_size, head_dim) == (
        capabilities.decode_supports(group_size, 1, head_dim) and head_dim in capabilities.SUPPORTED_HEAD_DIMS)
