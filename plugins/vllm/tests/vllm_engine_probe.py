"""Runs vLLM's real offline engine (``vllm.LLM``) on a model and writes what it did as JSON.

A script for ``test_engine.py``, not a test: vLLM's CPU platform always spawns its engine core
and worker, and each configuration needs its own process (the platform is chosen once per
process), so every run is ``python vllm_engine_probe.py ...`` in a subprocess.

It records, from the engine itself:
  * ``attention_impls``: the attention implementation classes the worker's layers hold (asked
    through ``collective_rpc`` and the ``AttentionImplProbe`` worker extension);
  * ``kv_cache_tokens``: the KV cache capacity the engine sized (blocks x block size);
  * ``perplexity``: teacher-forced, from ``prompt_logprobs``, over the same windows of the same
    text and tokenizer as ``nvfp4-backend eval --window W --tokens T``;
  * ``generations``: greedy continuations of ``nvfp4-backend eval``'s first chat prompts, with the
    log-probabilities of the FIRST_TOKEN_CANDIDATES likeliest first tokens.
"""
from __future__ import annotations

import argparse
import json
import math
import time

FIRST_TOKEN_CANDIDATES = 5


class AttentionImplProbe:
    """vLLM worker extension (``worker_extension_cls``): what the worker's attention layers run."""

    def attention_impl_classes(self) -> list[str]:
        layers = self.vllm_config.compilation_config.static_forward_context.values()
        return sorted({f"{type(layer.impl).__module__}.{type(layer.impl).__qualname__}"
                       for layer in layers if hasattr(layer, "impl")})


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="Hugging Face model directory")
    p.add_argument("out", help="JSON file to write")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--max-model-len", type=int, required=True)
    p.add_argument("--gpu-memory-utilization", type=float, required=True)
    p.add_argument("--tokens", type=int, required=True, help="as nvfp4-backend eval --tokens")
    p.add_argument("--window", type=int, required=True, help="as nvfp4-backend eval --window")
    p.add_argument("--prompts", type=int, required=True, help="as nvfp4-backend eval --prompts")
    p.add_argument("--gen-tokens", type=int, required=True, help="as nvfp4-backend eval --gen-tokens")
    return p.parse_args(argv)


def eval_windows(model: str, tokens: int, window: int) -> list[list[int]]:
    """The token windows ``nvfp4-backend eval`` scores (its default text, its tokenizer call)."""
    from transformers import AutoTokenizer

    from nvfp4_backend.eval.evaluation import load_text
    text, _ = load_text(None)
    ids = AutoTokenizer.from_pretrained(model, local_files_only=True)(text, add_special_tokens=False)["input_ids"]
    return [ids[i * window:(i + 1) * window] for i in range(tokens // window)]


def main(argv=None) -> None:
    args = parse_args(argv)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from nvfp4_backend.eval.evaluation import PROMPTS, chat_prompt_ids

    t0 = time.time()
    llm = LLM(model=args.model, dtype="bfloat16", kv_cache_dtype=args.kv_cache_dtype,
              attention_backend=args.attention_backend, enforce_eager=True, max_model_len=args.max_model_len,
              gpu_memory_utilization=args.gpu_memory_utilization, seed=0,
              # The worker imports this file as a module from the parent's sys.path (spawn copies it).
              worker_extension_cls="vllm_engine_probe.AttentionImplProbe")
    startup_s = time.time() - t0
    cache = llm.llm_engine.vllm_config.cache_config

    t0 = time.time()
    windows = eval_windows(args.model, args.tokens, args.window)
    scored = llm.generate([TokensPrompt(prompt_token_ids=w) for w in windows],
                          SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0), use_tqdm=False)
    nll, count = 0.0, 0
    for window, out in zip(windows, scored):
        for token, logprobs in zip(window[1:], out.prompt_logprobs[1:]):  # position 0 has none
            nll -= logprobs[token].logprob
            count += 1
    score_s = time.time() - t0

    t0 = time.time()
    tokenizer = llm.get_tokenizer()
    prompts = list(PROMPTS[:args.prompts])
    greedy = llm.generate([TokensPrompt(prompt_token_ids=chat_prompt_ids(tokenizer, p)) for p in prompts],
                          SamplingParams(max_tokens=args.gen_tokens, temperature=0.0, logprobs=FIRST_TOKEN_CANDIDATES),
                          use_tqdm=False)
    generate_s = time.time() - t0

    result = {
        "attention_impls": llm.collective_rpc("attention_impl_classes"),
        "kv_cache_tokens": cache.num_gpu_blocks * cache.block_size,
        "block_size": cache.block_size,
        "perplexity": math.exp(nll / count),
        "scored_tokens": count,
        "generations": [{"prompt": p, "tokens": list(o.outputs[0].token_ids), "text": o.outputs[0].text,
                         "first_candidates": {str(t): lp.logprob for t, lp in o.outputs[0].logprobs[0].items()}}
                        for p, o in zip(prompts, greedy)],
        "seconds": {"startup": startup_s, "score": score_s, "generate": generate_s},
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
