"""The backend end to end on vLLM's own objects: KV caches carved by vLLM's ``create_kv_cache_views``,
a real ``Attention`` layer, ``CommonAttentionMetadata`` batches, ``do_kv_cache_update`` + ``forward``.

Oracle: fp64 dense causal attention over K/V round-tripped through the NVFP4 format with the
layer's global scales.  The cache bytes are read back through vLLM's own NVFP4 page views
(``flashinfer._nvfp4_kv_views``, executed from vLLM's source), so the page layout is checked
against vLLM, not against this project's layout code.
"""
from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch
import vllm
from vllm.utils.torch_utils import nvfp4_split_data_scale
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.kv_cache_interface import KVCacheLayout, KVCacheTensor, create_kv_cache_views
from vllm.v1.worker.utils import customize_attention_spec

from conftest import cuda_or_skip, make_layer
from nvfp4_backend import format as fmt
from nvfp4_backend.modes import KV_MODE_ENV, KVMode
from nvfp4_vllm.backend import Nvfp4XqaBackend as Backend

NUM_BLOCKS = 48
PAD_TOKENS = 3  # CUDA-graph style padding: rows past the batch that nothing may read or write
LAYOUTS = [KVCacheLayout.LBHNC, KVCacheLayout.LBNHC, KVCacheLayout.BLHNC, KVCacheLayout.BLNHC]
# (context tokens already cached, new query tokens) per request, in vLLM's reordered order
# (decodes first); lengths leave partial last pages.
BATCHES = {
    "decode": [(15, 1), (39, 1), (32, 1), (0, 1)],
    "graph_padded_decode": [(15, 1), (39, 1), (0, 0), (0, 0)],  # FULL-graph padding requests
    "mixed": [(20, 1), (47, 1), (10, 37), (5, 3), (0, 64)],
    "short_extends": [(30, 3), (17, 4)],
    "prefill": [(0, 70), (0, 9)],
}


def vllm_nvfp4_kv_views():
    """vLLM's ``_nvfp4_kv_views`` from its flashinfer backend's source, without importing flashinfer."""
    path = Path(vllm.__file__).parent / "v1" / "attention" / "backends" / "flashinfer.py"
    tree = ast.parse(path.read_text())
    fns = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_nvfp4_kv_views"]
    assert fns, f"vLLM moved _nvfp4_kv_views out of {path}: re-check the inline NVFP4 page layout"
    namespace = {"torch": torch, "nvfp4_split_data_scale": nvfp4_split_data_scale, "_KVPair": tuple}
    exec(compile(ast.Module(body=fns, type_ignores=[]), str(path), "exec"), namespace)
    return namespace["_nvfp4_kv_views"]


def token_major(x: torch.Tensor, layout: str) -> torch.Tensor:
    """vLLM's [pages, H, N, ·] (HND) or [pages, N, H, ·] (NHD) view as [pages, N, H, ·] bytes."""
    x = x.view(torch.uint8)
    return x.transpose(1, 2) if layout == "HND" else x


def make_kv_caches(spec, layout: KVCacheLayout, device, num_layers: int = 2) -> tuple[torch.Tensor, list]:
    """One raw buffer of random bytes viewed per layer exactly as vLLM's worker does."""
    page = spec.page_size_bytes
    layer_stride, block_stride = ((page * NUM_BLOCKS, page) if layout.is_layer_compact
                                  else (page, page * num_layers))
    raw = torch.randint(0, 256, (page * NUM_BLOCKS * num_layers,), dtype=torch.uint8, device=device)
    tensor = KVCacheTensor(size=raw.numel(), layers=[f"l{i}" for i in range(num_layers)],
                           layer_stride=layer_stride, block_stride=block_stride)
    return raw, create_kv_cache_views(raw.view(torch.int8), spec, NUM_BLOCKS, layout, tensor)


def oracle(q, keys, values, q_lens, scale, window=None, soft_cap=None, sinks=None) -> torch.Tensor:
    """fp64 causal attention per request; keys/values: per request [seq_len, kv_heads, D]."""
    out, row = [], 0
    for k, v, q_len in zip(keys, values, q_lens):
        qb = q[row:row + q_len].double()
        group = qb.shape[1] // k.shape[1]
        k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", qb, k) * scale
        if soft_cap:
            s = soft_cap * torch.tanh(s / soft_cap)
        q_pos = torch.arange(k.shape[0] - q_len, k.shape[0])[:, None]
        k_pos = torch.arange(k.shape[0])[None, :]
        visible = k_pos <= q_pos
        if window:
            visible &= k_pos > q_pos - window
        s = s.masked_fill(~visible.to(s.device), -math.inf)
        if sinks is not None:
            s = torch.cat([s, sinks.double().view(-1, 1, 1).expand(-1, q_len, 1)], -1)
        p = torch.softmax(s, -1)[..., :k.shape[0]]
        out.append(torch.einsum("hqk,khd->qhd", p, v))
        row += q_len
    return torch.cat(out)


class Step:
    """One engine step over a random paged block table (block 0 held back, as vLLM's null block)."""

    def __init__(self, requests, block_size: int, device, gen: torch.Generator):
        self.requests = requests
        self.seq_lens = [c + q for c, q in requests]
        self.q_lens = [q for _, q in requests]
        width = max(math.ceil(s / block_size) for s in self.seq_lens) + 1
        pages = (torch.randperm(NUM_BLOCKS - 1, generator=gen) + 1)[:len(requests) * width]
        self.block_table = pages.view(len(requests), width).to(torch.int32)
        self.block_size = block_size
        self.device = device

    def slots(self, b: int, positions: range) -> list[int]:
        return [int(self.block_table[b, p // self.block_size]) * self.block_size + p % self.block_size
                for p in positions]

    def context_slots(self) -> torch.Tensor:
        return torch.tensor([s for b, (c, _) in enumerate(self.requests) for s in self.slots(b, range(c))],
                            dtype=torch.int64)

    def new_slots(self) -> torch.Tensor:
        return torch.tensor([s for b, (c, q) in enumerate(self.requests) for s in self.slots(b, range(c, c + q))],
                            dtype=torch.int64)

    def metadata(self) -> CommonAttentionMetadata:
        qsl = torch.tensor([0, *torch.tensor(self.q_lens).cumsum(0).tolist()], dtype=torch.int32)
        dev = self.device
        return CommonAttentionMetadata(
            query_start_loc=qsl.to(dev), query_start_loc_cpu=qsl, seq_lens=torch.tensor(self.seq_lens, dtype=torch.int32,
                                                                                      device=dev),
            num_reqs=len(self.requests), num_actual_tokens=sum(self.q_lens), max_query_len=max(self.q_lens),
            max_seq_len=max(self.seq_lens), block_table_tensor=self.block_table.to(dev),
            slot_mapping=self.new_slots().to(dev),
            seq_lens_cpu_upper_bound=torch.tensor(self.seq_lens, dtype=torch.int32))


def run_step(config, layer, layout: KVCacheLayout, batch: str, device: str, dtype=torch.bfloat16, seed: int = 0,
             graph_reqs: int | None = None):
    """Write the context, then one step's K/V, then attention; return everything needed to check.
    ``graph_reqs``: run it as a FULL graph of that many requests replays it (``replayed_metadata``)."""
    gen = torch.Generator().manual_seed(seed)
    spec = customize_attention_spec(Backend, layer.get_kv_cache_spec(config))
    raw, (other_layer, kv_cache) = make_kv_caches(spec, layout, device)
    other_before = other_layer.clone()
    step = Step(BATCHES[batch], spec.block_size, device, gen)
    layer._k_scale.fill_(0.5)  # non-trivial global (dequant) scales must flow through to the cache
    layer._v_scale.fill_(0.25)
    layer._k_scale_float, layer._v_scale_float = 0.5, 0.25  # as vLLM's weight loading keeps them
    layer._k_scale, layer._v_scale = layer._k_scale.to(device), layer._v_scale.to(device)
    h, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_size
    ctx, new = sum(c for c, _ in step.requests), sum(step.q_lens)
    k = torch.randn(ctx + new, hkv, d, generator=gen).to(dtype)
    v = torch.randn(ctx + new, hkv, d, generator=gen).to(dtype)
    q = torch.randn(new + PAD_TOKENS, h, d, generator=gen).to(dtype)
    impl = layer.impl
    if ctx:  # an earlier step
        impl.do_kv_cache_update(layer, k[:ctx].to(device), v[:ctx].to(device), kv_cache, step.context_slots().to(device))
    # this step: key/value padded past slot_mapping, and slot_mapping padded with -1
    pad_kv = torch.randn(PAD_TOKENS, hkv, d, generator=gen).to(dtype)
    slot_mapping = torch.cat([step.new_slots(), torch.full((1,), -1, dtype=torch.int64)]).to(device)
    k_step = torch.cat([k[ctx:], pad_kv]).to(device)
    v_step = torch.cat([v[ctx:], pad_kv]).to(device)
    cm = step.metadata()
    builder = Backend.get_builder_cls()(spec, [layer.layer_name], config, torch.device(device))
    metadata = builder.build(0, cm) if graph_reqs is None else replayed_metadata(builder, cm, new + PAD_TOKENS, graph_reqs)
    impl.do_kv_cache_update(layer, k_step, v_step, kv_cache, slot_mapping)
    output = torch.full((new + PAD_TOKENS, h, d), float("nan"), dtype=dtype, device=device)
    impl.forward(layer, q.to(device), k_step, v_step, kv_cache, metadata, output)

    # per request, in sequence order: its context tokens, then its new tokens
    order, c0, n0 = [], 0, ctx
    for c, qn in step.requests:
        order.append(list(range(c0, c0 + c)) + list(range(n0, n0 + qn)))
        c0, n0 = c0 + c, n0 + qn
    return dict(step=step, metadata=metadata, kv_cache=kv_cache, output=output.cpu(), q=q, k=k, v=v, order=order, ctx=ctx,
                other_before=other_before, other_after=other_layer, k_scale=0.5, v_scale=0.25)


def replayed_metadata(builder, cm: CommonAttentionMetadata, num_tokens: int, num_reqs: int):
    """What a FULL graph of a mixed batch (``num_tokens`` rows, ``num_reqs`` requests) runs when it
    replays ``cm``: metadata built at capture from vLLM's dummy batch for that size (its token count
    as max_query_len, the tokens spread evenly, ``_dummy_run``), on buffers into which the real
    step is then written as vLLM's runner writes it (padding requests: no tokens, no positions)."""
    n = cm.num_reqs
    assert n <= num_reqs and cm.num_actual_tokens <= num_tokens
    dummy = [num_tokens // num_reqs] * num_reqs
    dummy[-1] += num_tokens % num_reqs
    qsl = torch.tensor([0, *torch.tensor(dummy).cumsum(0).tolist()], dtype=torch.int32, device=cm.seq_lens.device)
    seq_lens = torch.tensor(dummy, dtype=torch.int32, device=qsl.device)
    table = torch.zeros(num_reqs, cm.block_table_tensor.shape[1], dtype=torch.int32, device=qsl.device)
    capture = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.cpu(), seq_lens=seq_lens, num_reqs=num_reqs,
        num_actual_tokens=num_tokens, max_query_len=num_tokens, max_seq_len=num_tokens, block_table_tensor=table,
        slot_mapping=cm.slot_mapping, seq_lens_cpu_upper_bound=seq_lens.cpu())
    metadata = builder.build_for_cudagraph_capture(capture)
    qsl[:n + 1].copy_(cm.query_start_loc)
    qsl[n + 1:] = cm.num_actual_tokens
    seq_lens[:n].copy_(cm.seq_lens)
    seq_lens[n:] = 0
    table[:n].copy_(cm.block_table_tensor)
    return metadata


def stored(x, mode: KVMode):
    """What the cache holds for x in a mode: x, or x H (bf16, as the core rotates)."""
    if mode.rotation == "none":
        return x.float()
    return fmt.hadamard_transform(x).to(x.dtype).float()


def roundtrip(x, scale, mode: KVMode = KVMode()):
    """The values attention sees: dequantized cache contents, rotated back (H H = I)."""
    y = fmt.dequantize(*fmt.quantize(stored(x, mode), scale, mode.scale_rule), scale, torch.float64)
    return y if mode.rotation == "none" else y @ fmt.hadamard(x.shape[-1], dtype=torch.float64)


def check_step(r, layer, window=None, soft_cap=None, sinks=None, atol=2e-2):
    step, new = r["step"], sum(r["step"].q_lens)
    mode = layer.impl.kv_mode
    keys = [roundtrip(r["k"][idx], r["k_scale"], mode) for idx in r["order"]]
    values = [roundtrip(r["v"][idx], r["v_scale"], mode) for idx in r["order"]]
    want = oracle(r["q"][:new], keys, values, step.q_lens, layer.impl.scale, window, soft_cap, sinks)
    got = r["output"][:new].double()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=atol, rtol=2e-2)
    assert torch.isnan(r["output"][new:]).all(), "padding rows must be left untouched"
    assert torch.equal(r["other_before"], r["other_after"]), "another layer's cache bytes changed"


def check_cache_bytes(r, layer):
    """Every written token's bytes, read through vLLM's own NVFP4 page views."""
    (k_data, v_data), (k_sf, v_sf), layout = vllm_nvfp4_kv_views()(r["kv_cache"], layer.num_kv_heads)
    step = r["step"]
    slots = torch.cat([step.context_slots(), step.new_slots()])
    page, offset = slots // step.block_size, slots % step.block_size
    mode = layer.impl.kv_mode
    for x, scale, data, sf in ((r["k"], r["k_scale"], k_data, k_sf), (r["v"], r["v_scale"], v_data, v_sf)):
        want_data, want_sf = fmt.quantize(stored(x, mode), scale, mode.scale_rule)
        torch.testing.assert_close(token_major(data, layout)[page, offset].cpu(), want_data, atol=0, rtol=0)
        torch.testing.assert_close(token_major(sf, layout)[page, offset].cpu(), want_sf, atol=0, rtol=0)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
@pytest.mark.parametrize("batch", list(BATCHES))
def test_update_and_forward_match_dense_attention(make_config, device, layout, batch):
    cuda_or_skip(device)
    config = make_config()
    layer = make_layer(config)
    r = run_step(config, layer, layout, batch, device)
    check_cache_bytes(r, layer)
    check_step(r, layer)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_window_soft_cap_sinks_fp16(make_config, device, dtype):
    cuda_or_skip(device)
    config = make_config(dtype="float16" if dtype == torch.float16 else "bfloat16")
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(1)).to(device)
    layer = make_layer(config, per_layer_sliding_window=24, logits_soft_cap=30.0, sinks=sinks)
    assert layer.impl.sliding_window == 24
    r = run_step(config, layer, KVCacheLayout.LBHNC, "mixed", device, dtype=dtype)
    check_step(r, layer, window=24, soft_cap=30.0, sinks=sinks.cpu())


@pytest.mark.parametrize("batch, features", [("mixed", {}), ("prefill", {}),
                                             ("mixed", dict(per_layer_sliding_window=24, logits_soft_cap=30.0))])
def test_long_requests_take_the_dense_prefill(make_config, monkeypatch, batch, features):
    # The dense path where the core offers it (SM90 with FlashInfer; here its CPU form, the fp64 kernel):
    # the builder plans it on vLLM's host lengths, forward runs it, and the step still matches the oracle.
    monkeypatch.setattr("nvfp4_vllm.dense.dense_unavailable_reason", lambda device: None)
    config = make_config()
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(2))
    layer = make_layer(config, sinks=sinks, **features)
    r = run_step(config, layer, KVCacheLayout.LBHNC, batch, "cpu")
    dense = r["metadata"].prefill.dense_plans[layer.impl.dense_features].prefill
    assert dense is not None and dense.sliding_window == features.get("per_layer_sliding_window")
    qsl = r["metadata"].prefill.query_start_loc.tolist()
    long = [b for b in range(len(qsl) - 1) if qsl[b + 1] - qsl[b] > dense.decode_len]
    first_pass = dense.passes[0].spec
    assert long and first_pass.first_request <= long[0] and long[-1] < first_pass.last_request
    check_step(r, layer, window=features.get("per_layer_sliding_window"), soft_cap=features.get("logits_soft_cap"),
               sinks=sinks)


def test_dense_prefill_needs_host_lengths_and_no_capture(make_config, monkeypatch):
    monkeypatch.setattr("nvfp4_vllm.dense.dense_unavailable_reason", lambda device: None)
    config = make_config()
    layer = make_layer(config)
    spec = customize_attention_spec(Backend, layer.get_kv_cache_spec(config))
    builder = Backend.get_builder_cls()(spec, [layer.layer_name], config, torch.device("cpu"))
    cm = Step(BATCHES["mixed"], spec.block_size, "cpu", torch.Generator().manual_seed(0)).metadata()
    assert builder.build(0, cm).prefill.dense_plans[layer.impl.dense_features].prefill is not None
    assert builder.build(0, cm.replace(seq_lens_cpu_upper_bound=None)).prefill.dense_plans == {}
    assert builder.build_for_cudagraph_capture(cm).prefill.dense_plans == {}


def test_layers_with_different_windows_each_get_their_plan(make_config, monkeypatch):
    # gpt-oss alternates windowed and full layers: one builder, one plan per feature set per step.
    monkeypatch.setattr("nvfp4_vllm.dense.dense_unavailable_reason", lambda device: None)
    config = make_config()
    full, windowed = make_layer(config), make_layer(config, per_layer_sliding_window=24)
    spec = customize_attention_spec(Backend, full.get_kv_cache_spec(config))
    builder = Backend.get_builder_cls()(spec, [full.layer_name, windowed.layer_name], config, torch.device("cpu"))
    cm = Step(BATCHES["mixed"], spec.block_size, "cpu", torch.Generator().manual_seed(0)).metadata()
    plans = builder.build(0, cm).prefill.dense_plans
    assert set(plans) == {full.impl.dense_features, windowed.impl.dense_features}
    assert plans[windowed.impl.dense_features].prefill.sliding_window == 24
    assert plans[full.impl.dense_features].prefill.sliding_window is None


@pytest.mark.parametrize("windows, planned", [((24, 24), 24), ((24, None), None), ((None,), None)])
def test_decode_plan_follows_the_groups_common_window(make_config, windows, planned):
    # vLLM's hybrid KV manager puts gpt-oss's windowed layers in a group of their own: its builder plans
    # the decodes for the tokens the window lets them read; a group of mixed windows plans the full range.
    from nvfp4_backend import planner
    config = make_config()
    layers = [make_layer(config, per_layer_sliding_window=w) for w in windows]
    spec = customize_attention_spec(Backend, layers[0].get_kv_cache_spec(config))
    builder = Backend.get_builder_cls()(spec, [layer.layer_name for layer in layers], config, torch.device("cpu"))
    assert builder.sliding_window == planned
    cm = Step(BATCHES["mixed"], spec.block_size, "cpu", torch.Generator().manual_seed(0)).metadata()
    assert builder.build(0, cm).decode.plan == planner.plan_attention(2, 2, 4, 1, cm.max_seq_len, 128,
                                                                      sliding_window=planned)
    assert builder._plan(4, 1, 131072) == planner.plan_attention(4, 2, 4, 1, 131072, 128, sliding_window=planned)
    if planned:
        assert builder._plan(4, 1, 131072).num_splits < planner.plan_attention(4, 2, 4, 1, 131072, 128).num_splits


@pytest.mark.parametrize("batch", ["mixed", "prefill", "decode", "short_extends"])
@pytest.mark.parametrize("graph_reqs", [8, None])
def test_a_mixed_full_graph_replays_any_batch(make_config, batch, graph_reqs):
    # cudagraph_mode FULL (AttentionCGSupport.ALWAYS): one graph per token count, captured on a dummy
    # batch (8 requests, or one per token as vLLM makes it when max_num_seqs allows) and replayed for
    # whatever step vLLM writes into its buffers: one call over every request, on views of them.
    config = make_config()
    layer = make_layer(config, per_layer_sliding_window=24, logits_soft_cap=30.0)
    num_tokens = sum(q for _, q in BATCHES[batch]) + PAD_TOKENS
    reqs = graph_reqs or min(num_tokens, config.scheduler_config.max_num_seqs)
    r = run_step(config, layer, KVCacheLayout.LBHNC, batch, "cpu", graph_reqs=reqs)
    check_step(r, layer, window=24, soft_cap=30.0)
    md = r["metadata"]
    assert md.decode is None and (md.prefill.token_start, md.prefill.token_end) == (0, num_tokens)
    assert md.prefill.max_query_len == num_tokens and md.prefill.dense_plans == {}
    assert md.prefill.plan.decode_query_len is None and md.prefill.plan.workspace_bytes <= md.workspace.numel()


def test_a_uniform_decode_graph_keeps_the_decode_call(make_config):
    # FULL_AND_PIECEWISE's decode graphs (max_query_len at the reorder threshold): no prefill kernel in them
    config = make_config()
    layer = make_layer(config)
    spec = customize_attention_spec(Backend, layer.get_kv_cache_spec(config))
    builder = Backend.get_builder_cls()(spec, [layer.layer_name], config, torch.device("cpu"))
    md = builder.build_for_cudagraph_capture(Step(BATCHES["decode"], 16, "cpu", torch.Generator()).metadata())
    assert md.prefill is None and md.decode.max_query_len == 1


def test_dense_prefill_off_where_the_core_says(make_config, vllm_log):
    config = make_config()
    layer = make_layer(config)
    spec = customize_attention_spec(Backend, layer.get_kv_cache_spec(config))
    builder = Backend.get_builder_cls()(spec, [layer.layer_name], config, torch.device("cpu"))
    assert builder.dense is None
    assert "prefill on the prefill kernel (the dense prefill runs on CUDA devices" in vllm_log.text


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["6or4", "hadamard", "hadamard-6or4"])
def test_kv_mode_from_the_environment(make_config, monkeypatch, device, mode):
    """$NVFP4_BACKEND_KV_MODE selects the mode: the cache holds quantize(x H) with the mode's scale
    rule (read through vLLM's own page views) and attention equals the unrotated oracle."""
    cuda_or_skip(device)
    monkeypatch.setenv(KV_MODE_ENV, mode)
    config = make_config()
    layer = make_layer(config)
    assert layer.impl.kv_mode == KVMode.from_name(mode)
    r = run_step(config, layer, KVCacheLayout.LBHNC, "mixed", device)
    check_cache_bytes(r, layer)
    check_step(r, layer)


@pytest.mark.parametrize("env, want", [(None, "6or4"), ("hadamard", "hadamard-6or4")])
def test_nvfp4_4over6_selects_the_6or4_scale_rule(make_config, monkeypatch, env, want):
    """vLLM's own --kv-cache-dtype nvfp4_4over6 (same bytes) turns on the 6-or-4 scale rule."""
    if env is None:
        monkeypatch.delenv(KV_MODE_ENV, raising=False)
    else:
        monkeypatch.setenv(KV_MODE_ENV, env)
    config = make_config(kv_cache_dtype="nvfp4_4over6")
    layer = make_layer(config)
    assert layer.impl.kv_mode.name == want
    r = run_step(config, layer, KVCacheLayout.LBNHC, "mixed", "cpu")
    check_cache_bytes(r, layer)
    check_step(r, layer)


def test_bad_kv_mode_stops_the_layer(make_config, monkeypatch):
    monkeypatch.setenv(KV_MODE_ENV, "hadamard-4or6")
    with pytest.raises(ValueError, match=r"\$NVFP4_BACKEND_KV_MODE: KV mode must be one of"):
        make_layer(make_config())


@pytest.mark.parametrize("head_size, num_heads, num_kv_heads", [(64, 4, 4), (256, 8, 1)])
def test_other_head_sizes_and_groups(make_config, head_size, num_heads, num_kv_heads):
    config = make_config()
    layer = make_layer(config, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size)
    r = run_step(config, layer, KVCacheLayout.LBNHC, "mixed", "cpu")
    check_cache_bytes(r, layer)
    check_step(r, layer)


@pytest.mark.parametrize("layout, token_major", [(None, False), ("LBHNC", False), ("BLHNC", False),
                                                 ("LBNHC", True), ("BLNHC", True)])
def test_builder_plans_for_the_resolved_layout(make_config, layout, token_major):
    """The builder plans for the layout vLLM's engine core resolved (token-major pages pack kv heads
    where a grid splits); unresolved, for head-major pages, the backend's first choice."""
    from nvfp4_backend import planner
    config = make_config()
    config.cache_config.kv_cache_layout = layout
    layer = make_layer(config)
    spec = customize_attention_spec(Backend, layer.get_kv_cache_spec(config))
    builder = Backend.get_builder_cls()(spec, [layer.layer_name], config, torch.device("cpu"))
    assert builder._plan(1, 1, 131072) == planner.plan_attention(1, 2, 4, 1, 131072, 128, token_major=token_major)
    assert (builder._plan(1, 1, 131072).heads_per_block == 2) == token_major


def test_builder_splits_mixed_batch(make_config):
    from nvfp4_backend import planner
    config = make_config()
    layer = make_layer(config)
    spec = customize_attention_spec(Backend, layer.get_kv_cache_spec(config))
    step = Step(BATCHES["mixed"], spec.block_size, "cpu", torch.Generator().manual_seed(0))
    cm = step.metadata()
    builder = Backend.get_builder_cls()(spec, [layer.layer_name], config, torch.device("cpu"))
    assert builder.reorder_batch_threshold == 1 and builder.group_size == 4
    md = builder.build(0, cm)
    d, p = md.decode, md.prefill
    assert (d.token_start, d.token_end, p.token_start, p.token_end) == (0, 2, 2, cm.num_actual_tokens)
    assert d.query_start_loc.tolist() == [0, 1, 2]
    assert p.query_start_loc.tolist() == [0, 37, 40, 104]  # rebased to the prefill rows
    assert p.seq_lens.tolist() == step.seq_lens[2:] and torch.equal(p.block_table, cm.block_table_tensor[2:])
    assert (d.max_query_len, p.max_query_len) == (1, 64)
    assert d.plan == planner.plan_attention(2, 2, 4, 1, cm.max_seq_len, 128)
    assert p.plan.num_splits == 1  # the unsplit default: the prefill kernel takes the rows past the decode kernel
    assert md.slot_mapping is cm.slot_mapping and md.num_actual_tokens == cm.num_actual_tokens
    # graphs are captured once and replayed for any length: plan for the longest
    captured = builder.build_for_cudagraph_capture(Step(BATCHES["decode"], 16, "cpu", torch.Generator()).metadata())
    assert captured.prefill is None
    assert captured.decode.plan == planner.plan_attention(4, 2, 4, 1, config.model_config.max_model_len, 128)
    assert captured.decode.plan.workspace_bytes <= md.workspace.numel()
    assert captured.workspace is md.workspace  # one preallocated buffer for every step and graph


def test_profiling_run_returns_zeros(make_config):
    config = make_config()
    layer = make_layer(config)
    output = torch.full((5, 8, 128), float("nan"), dtype=torch.bfloat16)
    q = torch.randn(5, 8, 128, dtype=torch.bfloat16)
    layer.impl.forward(layer, q, None, None, torch.empty(0), None, output)
    assert torch.equal(output, torch.zeros_like(output))


def test_the_profiling_run_makes_the_dense_prefill_the_builders_use(make_config, monkeypatch, vllm_log):
    # vLLM sizes the KV cache from the profiling run's peak memory: the dense prefill's workspace is
    # made there (where the core offers it), and the builders made afterwards share that one.
    monkeypatch.setattr("nvfp4_vllm.dense.dense_unavailable_reason", lambda device: None)
    config = make_config()
    layers = [make_layer(config), make_layer(config, per_layer_sliding_window=24)]
    q = torch.randn(5, 8, 128, dtype=torch.bfloat16)
    for layer in layers:
        layer.impl.forward(layer, q, None, None, torch.empty(0), None, torch.empty_like(q))
    from nvfp4_vllm import dense
    (made,) = dense._made.values()
    assert made.allocated_bytes > 0 and "allocated in vLLM's memory profiling" in vllm_log.text
    spec = customize_attention_spec(Backend, layers[0].get_kv_cache_spec(config))
    builders = [Backend.get_builder_cls()(spec, [layer.layer_name], config, torch.device("cpu")) for layer in layers]
    assert all(b.dense is made for b in builders) and len(dense._made) == 1


@pytest.mark.parametrize("workspace_rows, merge_made", [(300, True), (4096, False)])
def test_the_profiling_run_makes_the_merge_buffer_where_contexts_outgrow_the_workspace(
        make_config, monkeypatch, workspace_rows, merge_made):
    # A context longer than the workspace runs in passes merged through a buffer of the step's queries:
    # made in profiling too where max_model_len (2048) exceeds the workspace's rows.
    from nvfp4_backend.dense_prefill import DensePrefill
    monkeypatch.setattr("nvfp4_vllm.dense.dense_unavailable_reason", lambda device: None)
    row_bytes = 2 * 2 * 128 * 2  # a K and a V row of 2 kv heads, D 128, bf16

    class SmallWorkspace(DensePrefill):
        def __init__(self, *args):
            super().__init__(*args, workspace_bytes=workspace_rows * row_bytes)
    monkeypatch.setattr("nvfp4_vllm.dense.DensePrefill", SmallWorkspace)
    config = make_config(max_num_batched_tokens=256, enable_chunked_prefill=True)
    layer = make_layer(config)
    q = torch.randn(5, 8, 128, dtype=torch.bfloat16)
    layer.impl.forward(layer, q, None, None, torch.empty(0), None, torch.empty_like(q))
    from nvfp4_vllm import dense
    (made,) = dense._made.values()
    assert made.capacity == workspace_rows and (made.merge_out is not None) == merge_made


def test_rejects_pages_that_are_not_dense(make_config):
    config = make_config()
    layer = make_layer(config)
    spec = customize_attention_spec(Backend, layer.get_kv_cache_spec(config))
    # LHBNC-like: head slots outside blocks, so a page's bytes are scattered over the buffer
    heads_outer = torch.zeros(spec.num_heads, NUM_BLOCKS, spec.block_size, spec.state_content_size_bytes,
                              dtype=torch.uint8)
    kv_cache = heads_outer.transpose(0, 1)
    key = torch.zeros(1, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="KV pages must be dense"):
        layer.impl.do_kv_cache_update(layer, key, key, kv_cache, torch.zeros(1, dtype=torch.int64))
