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
