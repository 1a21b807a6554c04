"""Argument parsing and the two resolution hooks, run through SGLang's own ``run_hook`` with the
platform stubbed by SGLang's ``override_platform`` (the steps need a CUDA GPU otherwise)."""
import pytest
from sglang.srt.arg_groups.kv_cache_hook import handle_kv4_compatibility, handle_nvfp4_prefill_kv_dequant_dtype
from sglang.srt.arg_groups.overrides import resolved_view
from sglang.srt.arg_groups.resolution_hooks import run_hook
from sglang.srt.runtime_context import override_platform
from sglang.srt.server_args import prepare_server_args

from nvfp4_sglang.registration import DEFAULT_PAGE_SIZE

SM120 = dict(is_cuda=True, is_sm90=False, is_sm100=False, is_sm120=True, is_blackwell=True, device_capability=(12, 0))
SM90 = dict(SM120, is_sm90=True, is_sm120=False, is_blackwell=False, device_capability=(9, 0))
SM89 = dict(SM90, is_sm90=False, device_capability=(8, 9))
CPU = dict(SM120, is_cuda=False, device_capability=(None, None))


def parse(model_dir, *argv, kv="nvfp4"):
    return prepare_server_args(["--model-path", model_dir, "--kv-cache-dtype", kv, *argv])


def resolve(server_args, platform=SM120):
    with override_platform(**platform):
        run_hook(handle_nvfp4_prefill_kv_dequant_dtype, server_args)
        run_hook(handle_kv4_compatibility, server_args)
    v = resolved_view(server_args)
    return (v.prefill_attention_backend, v.decode_attention_backend, v.page_size,
            v.prefill_kv_cache_dequant_dtype)


def test_parse_single_backend(tiny_model_dir):
    args = parse(tiny_model_dir, "--attention-backend", "nvfp4-xqa")
    assert (args.attention_backend, args.kv_cache_dtype) == ("nvfp4-xqa", "nvfp4")


def test_parse_decode_only(tiny_model_dir):
    args = parse(tiny_model_dir, "--prefill-attention-backend", "flashinfer", "--decode-attention-backend",
                 "nvfp4-xqa")
    assert (args.prefill_attention_backend, args.decode_attention_backend) == ("flashinfer", "nvfp4-xqa")


def test_parse_still_rejects_unknown_names(tiny_model_dir):
    with pytest.raises(SystemExit):
        parse(tiny_model_dir, "--attention-backend", "nvfp4-xqa-typo")


def test_sglang_step_alone_rejects_the_backend(tiny_model_dir):
    """Why the hook exists: SGLang's own NVFP4 step names only its backends."""
    with override_platform(**SM120), pytest.raises(ValueError, match="provides neither"):
        handle_nvfp4_prefill_kv_dequant_dtype(parse(tiny_model_dir, "--attention-backend", "nvfp4-xqa"))


@pytest.mark.parametrize("platform", [SM120, SM90, SM89], ids=["sm120", "sm90", "sm89"])
def test_single_backend(tiny_model_dir, platform):
    args = parse(tiny_model_dir, "--attention-backend", "nvfp4-xqa")
    assert resolve(args, platform) == ("nvfp4-xqa", "nvfp4-xqa", DEFAULT_PAGE_SIZE, "auto")


@pytest.mark.parametrize("argv", [
    ["--decode-attention-backend", "nvfp4-xqa"],
    ["--prefill-attention-backend", "flashinfer", "--decode-attention-backend", "nvfp4-xqa"],
    ["--attention-backend", "flashinfer", "--decode-attention-backend", "nvfp4-xqa"],
    ["--decode-attention-backend", "nvfp4-xqa", "--prefill-kv-cache-dequant-dtype", "fp8_e4m3"],
], ids=["default_prefill", "explicit_prefill", "via_attention_backend", "explicit_dtype"])
def test_decode_only(tiny_model_dir, argv):
    assert resolve(parse(tiny_model_dir, *argv), SM90) == ("flashinfer", "nvfp4-xqa", DEFAULT_PAGE_SIZE, "fp8_e4m3")


def test_page_size_given_is_kept(tiny_model_dir):
    args = parse(tiny_model_dir, "--attention-backend", "nvfp4-xqa", "--page-size", "16")
    assert resolve(args)[2] == 16


@pytest.mark.parametrize("argv,platform,error,match", [
    (["--attention-backend", "nvfp4-xqa", "--prefill-kv-cache-dequant-dtype", "fp8_e4m3"], SM120, ValueError,
     "--prefill-kv-cache-dequant-dtype=fp8_e4m3 does not apply"),
    (["--prefill-attention-backend", "nvfp4-xqa", "--decode-attention-backend", "trtllm_mha"], SM120, ValueError,
     "needs decode backend 'nvfp4-xqa'"),
    (["--prefill-attention-backend", "triton", "--decode-attention-backend", "nvfp4-xqa"], SM120, ValueError,
     "pairs with prefill backend flashinfer or nvfp4-xqa, got 'triton'"),
    (["--decode-attention-backend", "nvfp4-xqa", "--prefill-kv-cache-dequant-dtype", "nvfp4"], SM120, ValueError,
     "not served by prefill backend 'flashinfer'"),
    (["--attention-backend", "nvfp4-xqa"], CPU, RuntimeError, "needs a CUDA GPU"),
    (["--decode-attention-backend", "nvfp4-xqa"], SM89, RuntimeError, r"needs compute capability >= 9.0"),
    (["--attention-backend", "nvfp4-xqa", "--enable-unified-memory"], SM120, ValueError, "unified-memory"),
    (["--attention-backend", "nvfp4-xqa", "--page-size", "24"], SM120, ValueError, "power-of-two --page-size"),
], ids=["dequant_dtype_single", "prefill_only", "other_prefill", "native_prefill", "cpu", "sm89_decode_only",
        "unified_memory", "page_size_24"])
def test_rejections_name_the_argument(tiny_model_dir, argv, platform, error, match):
    with pytest.raises(error, match=match):
        resolve(parse(tiny_model_dir, *argv), platform)


def test_rotated_mode_needs_both_phases(tiny_model_dir, monkeypatch):
    """A prefill backend other than ours writes unrotated K/V: a rotating mode is refused there."""
    monkeypatch.setenv("NVFP4_BACKEND_KV_MODE", "hadamard-6or4")
    with pytest.raises(ValueError, match=r"NVFP4_BACKEND_KV_MODE=hadamard-6or4 rotates the cache"):
        resolve(parse(tiny_model_dir, "--decode-attention-backend", "nvfp4-xqa"), SM90)
    args = parse(tiny_model_dir, "--attention-backend", "nvfp4-xqa")
    assert resolve(args, SM90)[:2] == ("nvfp4-xqa", "nvfp4-xqa")
    monkeypatch.setenv("NVFP4_BACKEND_KV_MODE", "6or4")  # standard bytes: fine with any reader
    assert resolve(parse(tiny_model_dir, "--decode-attention-backend", "nvfp4-xqa"), SM90)[:2] == \
        ("flashinfer", "nvfp4-xqa")


def test_backend_without_nvfp4_cache_is_rejected(tiny_model_dir):
    with pytest.raises(ValueError, match="add --kv-cache-dtype nvfp4"):
        resolve(parse(tiny_model_dir, "--attention-backend", "nvfp4-xqa", kv="auto"))


def test_other_configurations_go_to_sglang_unchanged(tiny_model_dir):
    """flashinfer prefill + trtllm_mha decode: SGLang's own resolution, untouched by the hooks."""
    args = parse(tiny_model_dir, "--prefill-attention-backend", "flashinfer", "--decode-attention-backend",
                 "trtllm_mha")
    assert resolve(args) == ("flashinfer", "trtllm_mha", None, "fp8_e4m3")
