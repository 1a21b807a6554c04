"""Shared fixtures for the whole suite (tests/ and tests/gpu/): per-test seeds, random paged batches,
poisoned caches, and the skip of GPU tests without a GPU.

One seed policy: every test draws its data from its own generator (``gen``), seeded from the test's
id (``seed``: crc32 of the node id, stable across runs, different between tests) xor
``$NVFP4_TEST_SEED`` (default 0), which shifts every seed to explore new data.  A failing test that
drew from it shows its seed and the command that replays it.
"""
from __future__ import annotations

import math
import os
import zlib
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, settings

from nvfp4_backend import PagedKVCache

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
"""Decorator for GPU tests: ``@requires_gpu`` (tests marked ``@pytest.mark.gpu`` are skipped the same way)."""

settings.register_profile("nvfp4", deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "nvfp4"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


# ----------------------------------------------------------------------------- randomness
SEED_ENV = "NVFP4_TEST_SEED"


def seed_of(nodeid: str) -> int:
    """The seed of the test ``nodeid``: crc32 of it, xor $NVFP4_TEST_SEED."""
    return zlib.crc32(nodeid.encode()) ^ int(os.environ.get(SEED_ENV, "0"))


@pytest.fixture
def seed(request) -> int:
    """This test's seed (``seed_of``)."""
    return seed_of(request.node.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that drew from its seed (the ``seed`` or ``gen`` fixture) reports the seed and
    how to replay it."""
    report = (yield).get_result()
    params = getattr(getattr(item, "callspec", None), "params", {})
    seeded = "gen" in item.fixturenames or ("seed" in item.fixturenames and "seed" not in params)
    if report.failed and seeded:
        shift = os.environ.get(SEED_ENV, "0")
        report.sections.append(("seed", f"seed {seed_of(item.nodeid)} (crc32 of the test id xor ${SEED_ENV}={shift}); "
                                        f"replay: {SEED_ENV}={shift} pytest '{item.nodeid}'"))


@pytest.fixture
def gen(seed) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_bytes_(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Overwrite a (possibly strided) uint8 view with random bytes, NaN scale bytes included."""
    t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=gen))
    return t


@pytest.fixture
def poison_cache(gen):
    """``poison_cache(cache)`` fills all four views with random bytes and returns clones of them."""
    def poison(cache: PagedKVCache) -> list[torch.Tensor]:
        return [random_bytes_(t, gen).clone() for t in cache.tensors()]
    return poison


# ----------------------------------------------------------------------------- paged batches
@dataclass
class Batch:
    """One step of ragged requests over a paged cache, with the K/V that fill it.

    key/value: [total_kv_tokens, kv_heads, D] written to slot_mapping (every position of every
    request); q: [total_q_tokens, q_heads, D]; block_table: [batch, max_pages] int32, pages in a
    random order with page 0 never used (a null block full of garbage).
    """
    q: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    k_global_scale: float
    v_global_scale: float

    @property
    def softmax_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def max_query_len(self) -> int:
        return int((self.query_start_loc[1:] - self.query_start_loc[:-1]).max())


@pytest.fixture
def make_batch(gen):
    default_gen = gen

    def make(seq_lens, q_lens, *, page_size: int, num_kv_heads: int, group_size: int, head_dim: int,
             q_dtype=torch.float16, kv_dtype=None, k_global_scale: float = 0.5, v_global_scale: float = 2.0,
             spare_pages: int = 3, extra_table_cols: int = 1, generator: torch.Generator | None = None) -> Batch:
        gen = generator or default_gen
        assert len(seq_lens) == len(q_lens) and all(1 <= ql <= sl for ql, sl in zip(q_lens, seq_lens))
        kv_dtype = kv_dtype or q_dtype
        pages_per_req = [math.ceil(s / page_size) for s in seq_lens]
        num_pages = 1 + sum(pages_per_req) + spare_pages          # page 0: the null block
        order = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
        max_pages = max(pages_per_req) + extra_table_cols
        # unused table entries point at the null block or past the cache: never to be read
        block_table = torch.zeros(len(seq_lens), max_pages, dtype=torch.int32)
        slots = []
        for b, (n, s) in enumerate(zip(pages_per_req, seq_lens)):
            pages = [order.pop() for _ in range(n)]
            block_table[b, :n] = torch.tensor(pages, dtype=torch.int32)
            block_table[b, n:] = torch.randint(0, 2, (max_pages - n,), generator=gen, dtype=torch.int32) * 10**6
            pos = torch.arange(s)
            slots.append(block_table[b, pos // page_size].long() * page_size + pos % page_size)
        slot_mapping = torch.cat(slots)
        n_kv = slot_mapping.shape[0]
        key = torch.randn(n_kv, num_kv_heads, head_dim, generator=gen).to(kv_dtype)
        value = torch.randn(n_kv, num_kv_heads, head_dim, generator=gen).to(kv_dtype)
        q = torch.randn(sum(q_lens), num_kv_heads * group_size, head_dim, generator=gen).to(q_dtype)
        qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        return Batch(q, key, value, slot_mapping, block_table, torch.tensor(seq_lens, dtype=torch.int32), qsl,
                     num_pages, page_size, num_kv_heads, head_dim, k_global_scale, v_global_scale)
    return make


@pytest.fixture(autouse=True)
def dense_prefill_at_any_size(monkeypatch):
    """Test steps are small: the dense path is planned for them whatever their work
    (``DensePrefill.min_flops``; its own test sets it back)."""
    from nvfp4_backend.dense_prefill import DensePrefill
    monkeypatch.setattr(DensePrefill, "min_flops", 0)
