"""How many tokens fit in the KV cache with BF16, FP8 and NVFP4, for well-known model shapes.

Assumptions (stated in every row the table returns):

* Shapes (attention layers, KV heads, head dim), from the models' published configs:
  Llama-3.1-8B 32 x 8 x 128 (8.03 B parameters), Qwen3-32B 64 x 8 x 128 (32.8 B),
  Llama-3.1-70B 80 x 8 x 128 (70.6 B).
* Tensor parallel 8: every GPU holds num_kv_heads / 8 = 1 KV head of every layer (a model with
  fewer KV heads than the TP size would replicate them; none of these does) and 1/8 of the weights.
* Memory budget per GPU: ``gpu_memory_gb`` (80 GB, an H100/A100-80GB) x ``utilization`` (0.90,
  vLLM's default ``gpu_memory_utilization``) minus the BF16 weights on that GPU
  (2 bytes x parameters / TP) minus ``reserve_gb`` (4 GB for activations, CUDA graphs and the
  NCCL/CUDA context).  GB = 1e9 bytes.
* KV bytes per token and GPU = 2 (K and V) x layers x KV heads per GPU x bytes per token-head:
  BF16 2 x head_dim, FP8 1 x head_dim (per-tensor scales are negligible), NVFP4 head_dim / 2 +
  head_dim / 16 (E2M1 data + one E4M3 scale per 16: 72 bytes at head_dim 128).
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import format as fmt


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    params_b: float


MODELS = (
    ModelShape("Llama-3.1-8B", 32, 8, 128, 8.03),
    ModelShape("Qwen3-32B", 64, 8, 128, 32.8),
    ModelShape("Llama-3.1-70B", 80, 8, 128, 70.6),
)


def bytes_per_token_head(kv_format: str, head_dim: int) -> int:
    if kv_format == "bf16":
        return 2 * head_dim
    if kv_format == "fp8":
        return head_dim
    if kv_format == "nvfp4":
        return fmt.bytes_per_token_head(head_dim)
    raise ValueError(f"kv_format must be bf16, fp8 or nvfp4, got {kv_format!r}")


def capacity_table(tp: int = 8, gpu_memory_gb: float = 80.0, utilization: float = 0.90,
                   reserve_gb: float = 4.0, models: tuple[ModelShape, ...] = MODELS) -> list[dict]:
    """One dict per model: the assumptions, KV bytes per token per GPU, and tokens that fit per GPU
    (= per replica of the TP group, since every GPU holds its share of every token)."""
    if tp <= 0:
        raise ValueError(f"tp must be positive, got {tp}")
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization}")
    rows = []
    for m in models:
        if m.kv_heads % tp and tp % m.kv_heads:
            raise ValueError(f"tp={tp} neither divides nor is divided by {m.name}'s {m.kv_heads} kv heads")
        heads_per_gpu = max(m.kv_heads // tp, 1)
        weights_gb = 2 * m.params_b / tp
        budget_gb = gpu_memory_gb * utilization - weights_gb - reserve_gb
        row = {"model": m.name, "layers": m.layers, "kv_heads": m.kv_heads, "head_dim": m.head_dim,
               "tp": tp, "kv_heads_per_gpu": heads_per_gpu, "weights_gb_per_gpu": round(weights_gb, 2),
               "kv_budget_gb_per_gpu": round(budget_gb, 2),
               "budget": f"{gpu_memory_gb:g} GB x {utilization:g} - BF16 weights/TP - {reserve_gb:g} GB reserve"}
        for f in ("bf16", "fp8", "nvfp4"):
            per_token = 2 * m.layers * heads_per_gpu * bytes_per_token_head(f, m.head_dim)
            row[f"{f}_bytes_per_token_per_gpu"] = per_token
            row[f"{f}_tokens"] = int(max(budget_gb, 0) * 1e9 // per_token)
        row["nvfp4_vs_bf16"] = round(row["nvfp4_tokens"] / max(row["bf16_tokens"], 1), 2)
        row["nvfp4_vs_fp8"] = round(row["nvfp4_tokens"] / max(row["fp8_tokens"], 1), 2)
        rows.append(row)
    return rows


def model_kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int) -> dict[str, int]:
    """KV bytes per token of a whole (unsharded) model, per format."""
    return {f: 2 * layers * kv_heads * bytes_per_token_head(f, head_dim) for f in ("bf16", "fp8", "nvfp4")}
