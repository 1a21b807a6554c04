"""The backend on a CUDA GPU (the core's kernels where they serve the shape), and a real
``torch.cuda.CUDAGraph`` capture/replay of decode through the backend's graph hooks."""
import pytest
import torch
from conftest import Harness, assert_close

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GPU_TOL = dict(atol=3e-2, rtol=3e-2)  # bf16 probabilities in the kernel's P @ V


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_chunked_decode_on_gpu(page_size, head_dim):
    h = Harness("cuda", page_size=page_size, head_dim=head_dim, num_pages=64, max_context=512)
    for new, decode in [({1: 37, 2: 130}, False), ({1: 70, 3: 5}, False)] + [({1: 1, 2: 1, 3: 1}, True)] * 3:
        assert_close(h.run_step(h.batch(new, decode=decode)), **GPU_TOL)


def test_sliding_window_on_gpu():
    h = Harness("cuda", page_size=16, head_dim=128, num_pages=32, max_context=256,
                layers=[{"sliding_window_size": 31}, {}])
    assert_close(h.run_step(h.batch({1: 90, 2: 17})), **GPU_TOL)
    assert_close(h.run_step(h.batch({1: 1, 2: 1}, decode=True)), **GPU_TOL)


def test_cuda_graph_decode_replay():
    """Capture decode for bs=4 (2 real requests + padding), replay as the sequences grow."""
    h = Harness("cuda", page_size=16, head_dim=128, num_pages=64, max_context=512, scales=((0.004, 0.002),))
    h.run_step(h.batch({1: 40, 2: 75}))
    b, layer = h.backend, h.layers[0]
    b.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    static = h.batch({1: 1, 2: 1}, decode=True, pad_to=4)  # the runner's static input buffers
    q, k, v = h.qkv(static, layer)

    b.init_forward_metadata_out_graph(static, in_capture=True)
    side = torch.cuda.Stream()  # warm up (JIT build, allocator) outside capture, as SGLang does
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        b.init_forward_metadata_in_graph(static)
        warm = b.forward(q, k, v, layer, static)
    torch.cuda.current_stream().wait_stream(side)
    h.record(static, layer, k, v)
    assert_close([(warm[:2].float().cpu(), h.expected(static, layer, q[:2]).float())], **GPU_TOL)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        b.init_forward_metadata_in_graph(static)
        out = b.forward(q, k, v, layer, static)
    for _ in range(3):  # each replay: the runner copies the next step into its static buffers
        step = h.batch({1: 1, 2: 1}, decode=True, pad_to=4)
        for name in ("seq_lens", "req_pool_indices", "out_cache_loc"):
            getattr(static, name).copy_(getattr(step, name))
        nq, nk, nv = h.qkv(step, layer)
        q.copy_(nq), k.copy_(nk), v.copy_(nv)
        b.init_forward_metadata_out_graph(static)
        graph.replay()
        torch.cuda.synchronize()
        h.record(step, layer, nk, nv)
        assert_close([(out[:2].float().cpu(), h.expected(step, layer, nq[:2]).float())], **GPU_TOL)


def test_group_without_decode_kernel_runs_eager_and_refuses_graphs():
    """GQA group 72 > the decode kernel's rows: the core serves it through its dense fallback
    eagerly; a captured graph would need that fallback's host sync, so graphs are refused."""
    h = Harness("cuda", q_heads=72, kv_heads=1, head_dim=128, page_size=16, num_pages=16, max_context=128,
                scales=((0.004, 0.002),))
    assert_close(h.run_step(h.batch({1: 20, 2: 3})), **GPU_TOL)
    assert_close(h.run_step(h.batch({1: 1, 2: 1}, decode=True)), **GPU_TOL)
    with pytest.raises(RuntimeError, match="--cuda-graph-backend-decode disabled"):
        h.backend.init_cuda_graph_state(max_bs=2, max_num_tokens=2)
