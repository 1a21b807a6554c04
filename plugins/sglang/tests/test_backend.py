"""The backend on CPU (the core's reference path) against dense fp64 attention.

Scenarios are named: each runs prefill / chunked prefill / decode steps over a real SGLang NVFP4
pool with randomly ordered pages, then checks every layer's output and the pool bytes.
"""
import pytest
import torch
from conftest import Harness, assert_close, rotated

from nvfp4_backend import format as fmt
from nvfp4_backend.modes import KV_MODE_ENV, KVMode

# new tokens per request, step by step (awkward lengths leave partial pages)
SCENARIOS = {
    "prefill_then_decode": [({1: 7, 2: 13}, False), ({1: 1, 2: 1}, True), ({1: 1, 2: 1}, True)],
    "chunked_prefill": [({1: 9}, False), ({1: 6}, False), ({1: 5, 2: 3}, False), ({1: 1, 2: 1}, True)],
    "mixed_extend": [({1: 5, 2: 4}, False), ({1: 1, 2: 7}, False), ({3: 2, 1: 1}, False)],
}


@pytest.mark.parametrize("steps", SCENARIOS.values(), ids=SCENARIOS.keys())
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_forward_matches_dense(steps, page_size):
    h = Harness(page_size=page_size)
    for new, decode in steps:
        assert_close(h.run_step(h.batch(new, decode=decode)))


def test_pool_rows_hold_what_the_format_writes():
    """K/V land in SGLang's own buffers at out_cache_loc, with the layer's global scale and the
    configured mode's scale rule (the default mode is 6-or-4)."""
    h = Harness(page_size=4)
    fb = h.batch({1: 6, 2: 3})
    h.backend.init_forward_metadata(fb)
    layer = h.layers[1]
    q, k, v = h.qkv(fb, layer)
    h.backend.forward(q, k, v, layer, fb)
    loc = fb.out_cache_loc
    kg, vg = h.scales[1]
    for x, g, data, sf in ((k, kg, h.pool.k_buffer[1], h.pool.k_scale_buffer[1]),
                           (v, vg, h.pool.v_buffer[1], h.pool.v_scale_buffer[1])):
        packed, scales = fmt.quantize(x, g, h.backend.kv_mode.scale_rule)
        assert torch.equal(data[loc], packed)
        assert torch.equal(sf[loc].view(torch.uint8), scales)
    untouched = torch.ones(h.pool.k_buffer[1].shape[0], dtype=torch.bool)
    untouched[loc] = False
    assert not h.pool.k_buffer[1][untouched].any(), "bytes written outside out_cache_loc"


@pytest.mark.parametrize("mode", ["6or4", "hadamard", "hadamard-6or4"])
def test_kv_mode_from_the_environment(monkeypatch, mode):
    """$NVFP4_BACKEND_KV_MODE: the pool holds quantize(x H) with the mode's scale rule, and prefill,
    chunked prefill and decode equal dense attention over those values rotated back."""
    monkeypatch.setenv(KV_MODE_ENV, mode)
    h = Harness(page_size=4)
    assert h.backend.kv_mode == KVMode.from_name(mode)
    for new, decode in SCENARIOS["chunked_prefill"]:
        fb = h.batch(new, decode=decode)
        assert_close(h.run_step(fb))
    layer = h.layers[1]
    fb = h.batch({1: 1}, decode=True)
    h.backend.init_forward_metadata(fb)
    q, k, v = h.qkv(fb, layer)
    h.backend.forward(q, k, v, layer, fb)
    loc = fb.out_cache_loc
    packed, scales = fmt.quantize(rotated(k, h.backend.kv_mode), h.scales[1][0], h.backend.kv_mode.scale_rule)
    assert torch.equal(h.pool.k_buffer[1][loc], packed)
    assert torch.equal(h.pool.k_scale_buffer[1][loc].view(torch.uint8), scales)


def test_rotated_mode_refuses_kv_written_elsewhere(monkeypatch):
    """save_kv_cache=False means someone else stored unrotated K/V: a rotated cache cannot read it."""
    monkeypatch.setenv(KV_MODE_ENV, "hadamard")
    h = Harness(page_size=4)
    fb = h.batch({1: 5})
    h.backend.init_forward_metadata(fb)
    q, k, v = h.qkv(fb, h.layers[0])
    with pytest.raises(NotImplementedError, match="save_kv_cache=False"):
        h.backend.forward(q, k, v, h.layers[0], fb, save_kv_cache=False)


def test_save_kv_cache_false_does_not_write():
    """save_kv_cache=False: the model (or a fused writer) already stored K/V; no second write."""
    h = Harness(page_size=4)
    fb = h.batch({1: 5})
    h.backend.init_forward_metadata(fb)
    layer = h.layers[0]
    q, k, v = h.qkv(fb, layer)
    before = h.pool.k_buffer[0].clone()
    h.backend.forward(q, k, v, layer, fb, save_kv_cache=False)
    assert torch.equal(before, h.pool.k_buffer[0])


@pytest.mark.parametrize("window_left", [0, 2, 5])
def test_sliding_window_is_window_left(window_left):
    """SGLang's sliding_window_size is window_left: position p sees p - window_left .. p."""
    h = Harness(page_size=4, layers=[{"sliding_window_size": window_left}, {}])
    assert_close(h.run_step(h.batch({1: 11, 2: 4})))
    assert_close(h.run_step(h.batch({1: 1, 2: 1}, decode=True)))


def test_logit_cap():
    h = Harness(page_size=4, layers=[{"logit_cap": 2.0}, {}])
    assert_close(h.run_step(h.batch({1: 8})))


def test_attention_sinks():
    """gpt-oss passes bf16 sinks [q_heads] as a kwarg; large sinks visibly shrink the output."""
    h = Harness(page_size=4)
    sinks = (torch.randn(8, generator=h.gen) * 2).to(torch.bfloat16)
    assert_close(h.run_step(h.batch({1: 7, 2: 2}), sinks=sinks))
    assert_close(h.run_step(h.batch({1: 1, 2: 1}, decode=True), sinks=sinks))


def test_long_extends_take_the_dense_prefill(monkeypatch):
    # Where the core offers it (SM90 with FlashInfer; here its CPU form, the fp64 kernel): planned once
    # per step and layer feature set (a windowed and a full layer: two plans), then a decode.
    monkeypatch.setattr("nvfp4_sglang.backend.dense_unavailable_reason", lambda device: None)
    h = Harness(page_size=4, layers=[{"sliding_window_size": 6}, {}])
    sinks = (torch.randn(8, generator=h.gen) * 2).to(torch.bfloat16)
    assert_close(h.run_step(h.batch({1: 37, 2: 1, 3: 24}), sinks=sinks))
    plans = h.backend.forward_metadata.dense_plans
    assert sorted(p.prefill.sliding_window or 0 for p in plans.values()) == [0, 7]
    assert_close(h.run_step(h.batch({1: 20, 3: 2}), sinks=sinks))  # a chunk over a cached prefix
    assert_close(h.run_step(h.batch({1: 1, 2: 1, 3: 1}, decode=True), sinks=sinks))
    assert h.backend.forward_metadata.dense_plans == {}


def test_dense_prefill_off_where_the_core_says(caplog):
    h = Harness(page_size=4)
    with caplog.at_level("INFO", logger="nvfp4_sglang"):
        assert_close(h.run_step(h.batch({1: 30})))
    assert "prefill on the prefill kernel (the dense prefill runs on CUDA devices" in caplog.text
    assert h.backend.forward_metadata.dense_plans == {}


def test_cuda_graph_hooks_use_preallocated_buffers():
    """Capture, then replay with other lengths: same buffers, padded rows ignored, right output."""
    h = Harness(page_size=4)
    h.run_step(h.batch({1: 5, 2: 9}))
    b = h.backend
    b.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    assert b.get_cuda_graph_seq_len_fill_value() == 1

    capture = h.batch({1: 1, 2: 1}, decode=True, pad_to=4)
    b.init_forward_metadata_out_graph(capture, in_capture=True)
    captured = b.forward_metadata
    b.init_forward_metadata_in_graph(capture)
    assert_close(h.run_step(capture, graph_metadata=True))

    replay = h.batch({1: 1, 2: 1}, decode=True, pad_to=4)  # what the runner copies into its buffers
    b.init_forward_metadata_out_graph(replay)
    assert b.forward_metadata is captured
    b.init_forward_metadata_in_graph(replay)  # graph.replay() re-runs these recorded ops
    assert captured.seq_lens.data_ptr() == b._graph_seq_lens.data_ptr()
    assert captured.seq_lens.tolist() == replay.seq_lens.tolist()
    assert_close(h.run_step(replay, graph_metadata=True))


def test_windowed_layers_plan_for_the_tokens_they_read(monkeypatch):
    """Layers share one metadata: a windowed layer's decode plan is made for the positions its window
    lets a request read (no splits here, where the full layers' graph plan splits a 64K context),
    once per window and step, and is the plan its call runs; the step still matches dense attention."""
    from nvfp4_backend import ops, planner
    calls = []
    real = ops.paged_attention
    monkeypatch.setattr(ops, "paged_attention", lambda *a, plan, **kw: calls.append(plan) or real(*a, plan=plan, **kw))
    h = Harness(page_size=4, max_context=65536, layers=[{"sliding_window_size": 6}, {}])
    h.run_step(h.batch({1: 5, 2: 9}))
    b = h.backend
    b.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    capture = h.batch({1: 1, 2: 1}, decode=True, pad_to=4)
    b.init_forward_metadata_out_graph(capture, in_capture=True)
    b.init_forward_metadata_in_graph(capture)
    calls.clear()
    assert_close(h.run_step(capture, graph_metadata=True))
    md = b.forward_metadata
    windowed = planner.plan_attention(4, 2, 4, 1, 65536, 64, b.num_sms, token_major=True, device=b.device,
                                      sliding_window=7)
    assert md.window_plans == {7: windowed} and windowed.num_splits == 1 < md.plan.num_splits
    assert calls == [windowed, md.plan]  # layer 0 (window 7), then layer 1 (full)
    assert_close(h.run_step(h.batch({1: 3, 2: 1}), graph_metadata=False))  # an eager extend plans its own
    assert set(b.forward_metadata.window_plans) == {7} and b.forward_metadata.window_plans[7].num_splits == 1


def _greedy_window_plans(monkeypatch, backend, extra: int):
    """Windowed plans that split more than the full ones and need ``extra`` more workspace bytes."""
    import dataclasses
    real = backend._plan

    def plan(*args, sliding_window=None, **kw):
        full = real(*args, **kw)
        return full if sliding_window is None else dataclasses.replace(
            full, num_splits=2, workspace_bytes=full.workspace_bytes + extra)
    monkeypatch.setattr(backend, "_plan", plan)


def test_a_window_plan_past_the_workspace_grows_an_eager_step_and_falls_back_in_a_graph(monkeypatch):
    """A windowed plan may split more than the unwindowed one (the static kernel where the fused one
    ran): an eager step's scratch grows for it; a graph's workspace, sized before the model's windows
    were known, keeps the step's plan."""
    h = Harness(page_size=4, layers=[{"sliding_window_size": 6}, {}])
    b = h.backend
    h.run_step(h.batch({1: 5, 2: 9}))
    _greedy_window_plans(monkeypatch, b, extra=4096)
    fb = h.batch({1: 1, 2: 1}, decode=True)
    b.init_forward_metadata(fb)
    md = b.forward_metadata
    assert b._window_plan(md, 7).num_splits == 2 and md.workspace.numel() >= md.window_plans[7].workspace_bytes
    assert md.workspace is b._workspace and b._window_plan(md, None) is md.plan
    b.init_cuda_graph_state(max_bs=2, max_num_tokens=2)  # no model on this runner: its windows are unknown
    capture = h.batch({1: 1, 2: 1}, decode=True)
    b.init_forward_metadata_out_graph(capture, in_capture=True)
    assert b._window_plan(b.forward_metadata, 7) is b.forward_metadata.plan


def test_graph_workspace_holds_the_models_windowed_plans(monkeypatch):
    """With the model's layers on the runner, the graphs' workspace holds their windows' plans too,
    so a captured windowed layer runs its own plan; the step still matches dense attention."""
    h = Harness(page_size=4, layers=[{"sliding_window_size": 6}, {}])
    h.runner.model = torch.nn.ModuleList(h.layers)
    b = h.backend
    assert b._layer_windows() == {None, 7}
    h.run_step(h.batch({1: 5, 2: 9}))
    _greedy_window_plans(monkeypatch, b, extra=4096)
    b.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    capture = h.batch({1: 1, 2: 1}, decode=True, pad_to=4)
    b.init_forward_metadata_out_graph(capture, in_capture=True)
    b.init_forward_metadata_in_graph(capture)
    assert_close(h.run_step(capture, graph_metadata=True))
    md = b.forward_metadata
    assert md.window_plans[7].num_splits == 2 and md.window_plans[7] is not md.plan


def test_graph_capture_rejects_non_decode():
    h = Harness()
    h.backend.init_cuda_graph_state(max_bs=2, max_num_tokens=2)
    with pytest.raises(NotImplementedError, match="decode only"):
        h.backend.init_forward_metadata_out_graph(h.batch({1: 3}), in_capture=True)


def test_rejects_speculative_modes():
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    h = Harness()
    fb = h.batch({1: 3})
    fb.forward_mode = ForwardMode.TARGET_VERIFY
    with pytest.raises(NotImplementedError, match="speculative"):
        h.backend.init_forward_metadata(fb)


def test_rejects_unsupported_layers():
    from sglang.srt.layers.radix_attention import AttentionType, RadixAttention
    h = Harness()
    fb = h.batch({1: 3})
    h.backend.init_forward_metadata(fb)
    enc = RadixAttention(8, 64, 0.125, 2, layer_id=0, attn_type=AttentionType.ENCODER_ONLY)
    q, k, v = h.qkv(fb, enc)
    with pytest.raises(NotImplementedError, match="decoder self-attention"):
        h.backend.forward(q, k, v, enc, fb)


def test_rejects_unknown_attention_arguments():
    h = Harness()
    fb = h.batch({1: 3})
    h.backend.init_forward_metadata(fb)
    q, k, v = h.qkv(fb, h.layers[0])
    with pytest.raises(NotImplementedError, match=r"\['return_lse'\]"):
        h.backend.forward(q, k, v, h.layers[0], fb, return_lse=True)


def test_through_radix_attention_and_forward_context():
    """SGLang's own call path: RadixAttention.forward -> get_attn_backend().forward, and the
    pool lookups layers make through the active backend."""
    from sglang.srt.model_executor.forward_context import (ForwardContext, forward_context, get_req_to_token_pool,
                                                            get_token_to_kv_pool)
    h = Harness(page_size=4)
    for new, decode in [({1: 6, 2: 3}, False), ({1: 1, 2: 1}, True)]:
        fb = h.batch(new, decode=decode)
        h.backend.init_forward_metadata(fb)
        with forward_context(ForwardContext(attn_backend=h.backend), forward_batch=fb):
            assert get_token_to_kv_pool() is h.pool and get_req_to_token_pool() is h.req_pool
            for layer in h.layers:
                q, k, v = h.qkv(fb, layer)
                got = layer(q, k.flatten(1), v.flatten(1), fb)  # models pass flat k/v rows
                h.record(fb, layer, k, v)
                assert_close([(got.float(), h.expected(fb, layer, q).float())])


def test_rejects_pool_without_nvfp4():
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    h = Harness()
    h.runner.token_to_kv_pool = MHATokenToKVPool(size=16, page_size=4, dtype=torch.bfloat16, head_num=2,
                                                 head_dim=64, layer_num=2, device="cpu",
                                                 enable_memory_saver=False)
    with pytest.raises(ValueError, match="--kv-cache-dtype nvfp4"):
        ATTENTION_BACKENDS["nvfp4-xqa"](h.runner)


def test_rejects_pool_without_linear_scales():
    """SM100 trtllm_mha alone allocates only GenMHA's swizzled scales: fail at build, not later."""
    with pytest.raises(RuntimeError, match="no token-linear block scales"):
        Harness(backends=("trtllm_mha", "trtllm_mha"), native_scale_layout=True)


@pytest.mark.parametrize("backends", [("nvfp4-xqa", "nvfp4-xqa"), ("flashinfer", "nvfp4-xqa")])
def test_sm100_layout_keeps_linear_scales_for_us(backends):
    """On SM100 SGLang gives NATIVE_FP4 readers swizzled scales; the plugin's recipe keeps the
    token-linear ones for nvfp4-xqa (and allocates no swizzled copy nobody reads)."""
    h = Harness(backends=backends, native_scale_layout=True)
    assert h.pool.native_k_scale_buffer is None
    assert_close(h.run_step(h.batch({1: 6, 2: 2})))
