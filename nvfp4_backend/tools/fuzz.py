"""``nvfp4-backend fuzz``: randomized differential testing of the ops against the fp64 reference.

Each configuration comes from one integer seed (``generate(seed)``), so a failure is replayed with
``nvfp4-backend fuzz --replay SEED``.  A configuration draws batch size, ragged sequence lengths
(log-uniform up to ``--max-context``), page size, head dim, kv heads, GQA group, query tokens per
request (decode, speculative, short extend), layout, window, soft-cap, sinks, query dtype,
global scales over seven decades, CUDA-graph style padding entries and padded query rows, and for
requests past the decode kernel's share the dense prefill path (``dense_prefill``, its workspace
sometimes small enough to take several passes merged by log-sum-exp).

Per configuration it checks, on the chosen device:
  * the new tokens' K/V written by ``ops.write_kv`` equal the CPU reference quantizer bit for bit;
  * attention over the cache (pages in random order; every byte no request owns set to NaN
    scales, so stale bytes that leak show up) is finite and within ``TOLERANCE`` (relative L2,
    per request) of ``reference.paged_attention_ref`` in fp64 on the same bytes;
  * rows past the batch (padding) are left untouched;
  * a second identical call gives bit-identical output.
On a GPU this exercises the CUDA kernels (split-KV, every tile path, the prefill kernel);
on a CPU it exercises the validation and reference path, which is what CI can run.
"""
from __future__ import annotations

import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from .. import capabilities, dense_prefill, ops, planner, reference
from .. import format as fmt
from ..layout import LAYOUTS, PagedKVCache

TOLERANCE = 4e-3
"""Relative L2 error per request vs the fp64 reference: bf16/fp16 P and V inside the kernel."""
POISON_SCALE = fmt.E4M3_NAN_BYTE


@dataclass
class FuzzConfig:
    seed: int
    head_dim: int
    num_kv_heads: int
    group: int
    page_size: int
    layout: str
    dtype: str
    seq_lens: list[int]
    q_lens: list[int]
    pad_rows: int
    sliding_window: int | None
    logits_soft_cap: float | None
    sinks: bool
    k_scale: float
    v_scale: float
    softmax_scale: float
    value_amplitude: float
    heads_per_block: int = 1  # kv heads per decode thread block (the planner packs only big grids)
    fused: bool = False  # the fused kernel (the planner picks it only for grids of about one block per SM)
    dense: bool = False  # the long requests on the dense prefill (where the device offers it), at any size
    dense_rows: int | None = None  # its workspace's K/V rows (None: dense_prefill.WORKSPACE_BYTES)
    extra: dict = field(default_factory=dict)

    @property
    def batch(self) -> int:
        return len(self.seq_lens)

    def summary(self) -> str:
        live = [s for s in self.seq_lens if s]
        return (f"seed={self.seed} B={self.batch} L<={max(live, default=0)} D={self.head_dim} Hkv={self.num_kv_heads} "
                f"G={self.group} q={max(self.q_lens, default=0)} ps={self.page_size} {self.layout} {self.dtype} "
                f"win={self.sliding_window} cap={self.logits_soft_cap} sinks={self.sinks} "
                f"kg={self.k_scale:.3g} vg={self.v_scale:.3g} heads/block={self.heads_per_block}"
                + (" fused" if self.fused else "")
                + (f" dense(rows={self.dense_rows})" if self.dense else ""))


def _log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def generate(seed: int, max_context: int = 262144, max_elements: int = 1 << 28) -> FuzzConfig:
    """A valid configuration from one seed (the same on every machine).  The cache holds at most
    ``max_elements`` K (and as many V) elements, which bounds the fp64 reference's memory."""
    rng = random.Random(seed)
    head_dim = rng.choice(capabilities.SUPPORTED_HEAD_DIMS)
    max_token_heads = max_elements // head_dim
    group = rng.choice([1, 2, 4, 8, 16])
    kind = rng.choices(["decode", "spec", "extend"], [6, 3, 1])[0]
    max_rows = capabilities.decode_max_rows(head_dim)
    batch = rng.choice([1, 1, 2, 3, 4, 7, 8, 16, 33, 64])
    longest = max(1, int(_log_uniform(rng, 1, max_context)))
    num_kv_heads = rng.choice([1, 2, 4, 8])
    # keep the cache (and the fp64 reference over it) within a budget
    while batch > 1 and batch * longest * num_kv_heads > max_token_heads:
        batch //= 2
    while num_kv_heads > 1 and batch * longest * num_kv_heads > max_token_heads:
        num_kv_heads //= 2
    longest = min(longest, max(1, max_token_heads // (batch * num_kv_heads)))
    q_lens = []
    for _ in range(batch):
        if kind == "decode":
            q_lens.append(1)
        elif kind == "spec":
            q_lens.append(rng.randint(1, 8))
        else:  # short extends: up to the decode kernel's rows, sometimes past them (the prefill kernel)
            q_lens.append(rng.randint(1, max(1, 2 * max_rows // group)))
    seq_lens = [rng.randint(min(q, longest), longest) if q <= longest else q for q in q_lens]
    seq_lens[0] = max(seq_lens[0], min(longest, max_context))  # one request at the drawn length
    padding = rng.random() < 0.2
    if padding:  # CUDA-graph padding: requests with no tokens at the end of the batch
        for _ in range(rng.randint(1, 3)):
            seq_lens.append(0)
            q_lens.append(0)
    cfg = FuzzConfig(
        seed=seed, head_dim=head_dim, num_kv_heads=num_kv_heads, group=group,
        page_size=rng.choice([1, 16, 16, 32, 64, 128]), layout=rng.choice(LAYOUTS),
        dtype=rng.choice(["bfloat16", "float16"]), seq_lens=seq_lens, q_lens=q_lens,
        pad_rows=rng.choice([0, 0, 3]),
        sliding_window=rng.randint(1, max(seq_lens) + 8) if rng.random() < 0.3 else None,
        logits_soft_cap=rng.uniform(5, 50) if rng.random() < 0.2 else None,
        sinks=rng.random() < 0.2,
        k_scale=_log_uniform(rng, 1e-4, 1e3), v_scale=_log_uniform(rng, 1e-4, 1e3),
        softmax_scale=rng.uniform(0.5, 2.0) / math.sqrt(head_dim),
        value_amplitude=_log_uniform(rng, 1e-3, 1e3),  # outputs stay inside fp16 (|x| <~ 6e3)
        # drawn last, so the draws above (and each seed's configuration) are what they were; forced,
        # since the grids here are too small for the planner to pack
        heads_per_block=_heads_per_block(rng.choice([1, 2, 4]), group, max(q_lens)))
    # drawn after all the above for the same reason: the fused kernel, with its own heads per block
    fused_heads = rng.choice([1, 2, 4, 8])
    if rng.random() < 0.3 and capabilities.fused_allowed(head_dim, group, max(q_lens), fused_heads):
        cfg.fused, cfg.heads_per_block = True, fused_heads
    # and then the dense prefill, for configurations with requests past the decode kernel's share (long
    # extends or spec rows): a workspace of the queries plus a random share of the longest context
    # takes several passes
    dense, small_workspace = rng.random() < 0.5, rng.random() < 0.5
    extra_rows = rng.randint(0, max(seq_lens))
    if dense and max(q_lens) > capabilities.decode_query_len(group, head_dim):
        cfg.dense, cfg.dense_rows = True, sum(q_lens) + extra_rows if small_workspace else None
    return cfg


def _heads_per_block(drawn: int, group: int, max_query_len: int) -> int:
    """The drawn kv heads per block where the configuration allows it (plain decode, rows fit), else 1."""
    return drawn if capabilities.heads_per_block_allowed(group, max_query_len, drawn) else 1


def fp16_weight_allowance(q, k, v, seq_lens, query_start_loc, cfg) -> torch.Tensor:
    """[rows, q_heads, D]: per output element, the most the kernel's fp16 softmax weights can move
    it through rounding in fp16's subnormal range (see run_config); k, v: the dense fp64 K/V."""
    scores, rows, q_live = reference.attention_scores_ref(q, k, seq_lens, query_start_loc, cfg.softmax_scale,
                                                          cfg.sliding_window, cfg.logits_soft_cap, torch.float64)
    row_max = scores.amax(-1, keepdim=True)
    w = torch.exp(scores - torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)))
    err = torch.where(w < 2.0 ** -29, w.clamp(max=2.0 ** -40), torch.zeros_like(w))
    per_row = torch.einsum("bhgql,blhd->bqhgd", err, v.abs()).flatten(2, 3)  # [B, Q, Hq, D]
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    out[rows[q_live]] = per_row[q_live]
    return out.cpu()


def run_config(cfg: FuzzConfig, device: torch.device) -> dict:
    """Run one configuration; returns a record with 'ok' and, if not, 'failure'."""
    gen = torch.Generator().manual_seed(cfg.seed)
    dtype = getattr(torch, cfg.dtype)
    hkv, d, ps = cfg.num_kv_heads, cfg.head_dim, cfg.page_size
    pages_per_req = [math.ceil(s / ps) for s in cfg.seq_lens]
    num_pages = sum(pages_per_req) + 2  # page 0 held back, one spare page nobody owns
    cache = PagedKVCache.allocate(num_pages, ps, hkv, d, cfg.layout, device)
    for t in (cache.k_data, cache.v_data):
        t.copy_(torch.randint(0, 256, t.shape, generator=gen, dtype=torch.uint8))
    for t in (cache.k_block_scales, cache.v_block_scales):
        t.fill_(POISON_SCALE)  # every slot no request owns reads as NaN
    perm = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    width = max(max(pages_per_req), 1)
    table = torch.zeros(cfg.batch, width, dtype=torch.int32)
    owned_slots, new_slots, at = [], [], 0
    for b, (s, q) in enumerate(zip(cfg.seq_lens, cfg.q_lens)):
        pages = perm[at:at + pages_per_req[b]]
        at += pages_per_req[b]
        table[b, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
        slots = [pages[p // ps] * ps + p % ps for p in range(s)]
        owned_slots += slots[: s - q]
        new_slots += slots[s - q:]
    # context tokens: random codes with finite scales (as if written earlier)
    owned = torch.tensor(owned_slots, dtype=torch.long)
    if owned.numel():
        for t in (cache.k_block_scales, cache.v_block_scales):
            flat_page, flat_tok = owned // ps, owned % ps
            t[flat_page.to(device), flat_tok.to(device)] = torch.randint(
                0x20, 0x50, (owned.numel(), hkv, d // fmt.BLOCK_SIZE), generator=gen, dtype=torch.uint8).to(device)
    # this step's tokens: written by the op under test
    n_new = len(new_slots)
    kv = torch.randn(2, n_new, hkv, d, generator=gen) * cfg.value_amplitude
    kv *= torch.rand(2, n_new, hkv, 1, generator=gen)  # varied block maxima
    key, value = kv[0].to(dtype).to(device), kv[1].to(dtype).to(device)
    slot_mapping = torch.tensor(new_slots, dtype=torch.long)
    if cfg.pad_rows:  # padded K/V rows, skipped through slot -1
        key = torch.cat([key, torch.randn(cfg.pad_rows, hkv, d, dtype=dtype, device=device)])
        value = torch.cat([value, torch.randn(cfg.pad_rows, hkv, d, dtype=dtype, device=device)])
        slot_mapping = torch.cat([slot_mapping, torch.full((cfg.pad_rows,), -1, dtype=torch.long)])
    kg = torch.tensor(cfg.k_scale, dtype=torch.float32, device=device)
    vg = torch.tensor(cfg.v_scale, dtype=torch.float32, device=device)
    before = [t.cpu() for t in cache.tensors()]
    ops.write_kv(key, value, slot_mapping.to(device), cache, kg, vg)
    want = PagedKVCache(*[t.clone() for t in before])  # the CPU reference on the CPU copy
    reference.write_kv_ref(key.cpu(), value.cpu(), slot_mapping, want, kg.cpu(), vg.cpu())
    rec = dict(seed=cfg.seed, summary=cfg.summary())
    for name, got, exp in zip(("k_data", "k_block_scales", "v_data", "v_block_scales"), cache.tensors(), want.tensors()):
        diff = int((got.cpu() != exp).sum())
        if diff:
            return dict(rec, ok=False, failure=f"write_kv: {diff} bytes of {name} differ from the reference")

    rows = sum(cfg.q_lens)
    hq = hkv * cfg.group
    q = (torch.randn(rows + cfg.pad_rows, hq, d, generator=gen)).to(dtype).to(device)
    qsl = torch.tensor([0] + torch.tensor(cfg.q_lens).cumsum(0).tolist(), dtype=torch.int32)
    seq = torch.tensor(cfg.seq_lens, dtype=torch.int32)
    sinks = torch.randn(hq, generator=gen).to(device) if cfg.sinks else None
    table, seq, qsl_dev = table.to(device), seq.to(device), qsl.to(device)
    args = (q, cache, table, seq, qsl_dev, kg, vg, cfg.softmax_scale)
    # the plan the op would make itself, made here so the record says which one ran
    plan = planner.plan_attention(cfg.batch, hkv, cfg.group, max(cfg.q_lens), max(cfg.seq_lens), d, planner.num_sms(device),
                                  heads_per_block=cfg.heads_per_block, fused=cfg.fused, sliding_window=cfg.sliding_window)
    dense_reason = None if device.type == "cpu" else dense_prefill.unavailable_reason(device)
    if cfg.dense and dense_reason is None:
        plan = _dense_plan(cfg, plan, device, dtype)
        args = args[:5] + (float(kg.cpu()),) + args[6:]  # the dense path takes the K scale on the host
    kw = dict(max_query_len=max(cfg.q_lens), sliding_window=cfg.sliding_window,
              logits_soft_cap=cfg.logits_soft_cap, sinks=sinks, plan=plan)
    out = torch.full_like(q, float("nan"))
    ops.paged_attention(*args, out=out, **kw)
    again = torch.full_like(q, float("nan"))
    ops.paged_attention(*args, out=again, **kw)
    path = _path(cfg, plan, cache, device)
    if cfg.dense and "dense" not in path:
        rec["dense_off"] = dense_reason or "the step does not fit the dense plan (DensePrefill.plan)"
    rec.update(path=path, splits=plan.num_splits, heads_per_block=plan.heads_per_block, fused=plan.fused)
    got = out[:rows]
    if not torch.isfinite(got).all():
        bad = torch.nonzero(~torch.isfinite(got).all(-1).all(-1)).flatten()[:5].tolist()
        return dict(rec, ok=False, failure=f"non-finite output rows {bad} (stale or poisoned bytes leaked?)")
    if not torch.equal(got, again[:rows]):
        return dict(rec, ok=False, failure="two identical calls gave different outputs")
    if cfg.pad_rows and not torch.isnan(out[rows:]).all():
        return dict(rec, ok=False, failure="rows past the batch were written")
    # reference.paged_attention_ref, with its dense fp64 K/V kept for the fp16 allowance below
    k, v = reference.gather_kv_ref(cache, table, seq, kg, vg, torch.float64)
    ref = reference.attention_ref(q[:rows], k, v, seq, qsl_dev, cfg.softmax_scale, cfg.sliding_window,
                                  cfg.logits_soft_cap, sinks, torch.float64)
    # The kernel rounds its softmax weights to fp16 for the P.V product (its MMAs are fp16 for both
    # query dtypes), computed times 2^15.  A weight below 2^-29 of the running row maximum is then
    # an fp16 subnormal: rounded to a multiple of 2^-39 (or flushed), an error of at most
    # min(w, 2^-40) relative to the final maximum (later rescales only shrink it; the row sum is
    # >= 1).  Normal weights round relatively (2^-11), inside TOLERANCE.  So per output element
    # allow sum_j min(w_j, 2^-40) |v_j| over the keys with w_j < 2^-29, w from the fp64 scores:
    # about 0 unless the attention is extremely peaked.
    floor_allowance = fp16_weight_allowance(q[:rows], k, v, seq, qsl_dev, cfg)
    del k, v
    worst, worst_excess = 0.0, 0.0
    for b in range(cfg.batch):
        r0, r1 = int(qsl[b]), int(qsl[b + 1])
        if r1 > r0:
            g, r = got[r0:r1].double(), ref[r0:r1]
            err, norm = float((g - r).norm()), float(r.norm())
            # allowed: TOLERANCE relative, plus the output dtype's own rounding of the exact
            # result (outputs in fp16's subnormal range carry large relative rounding), plus the
            # fp16 weight floor above
            bound = (TOLERANCE * norm + float((r.to(dtype).double() - r).norm())
                     + float(floor_allowance[r0:r1].norm()))
            worst = max(worst, err / max(norm, 1e-300))
            worst_excess = max(worst_excess, err / bound if bound > 0 else (0.0 if err == 0 else math.inf))
    rec["rel_err"] = worst
    rec["bound_used"] = worst_excess  # error / allowed error of the worst request: <= 1 passes
    if not worst_excess <= 1.0:
        return dict(rec, ok=False, failure=f"relative L2 error {worst:.3g} is past {TOLERANCE} (+ output rounding) "
                                           "vs the fp64 reference (+ the fp16 subnormal-weight allowance)")
    return dict(rec, ok=True)


def _path(cfg: FuzzConfig, plan: planner.AttentionPlan, cache: PagedKVCache, device: torch.device) -> str:
    """Which kernels served the call, as ops.paged_attention chooses them ("reference" off CUDA)."""
    dense = plan.prefill
    decode_reads = device.type != "cuda" or capabilities.decode_kernel_serves(cache.k_data, cache.k_block_scales,
                                                                               cache.v_data)
    if not decode_reads:  # a layout the decode kernel cannot read: the prefill kernel serves every request
        return "prefill"
    dense_part = [f"dense({len(dense.passes)} passes)"] if dense is not None else []
    if device.type != "cuda":
        return "+".join(["reference"] + dense_part)
    if dense is not None:  # the decode kernel for the short requests (none: no launch), the dense path the rest
        return "+".join((["decode"] if not dense.covers_all else []) + dense_part)
    return "decode" if capabilities.decode_supports(cfg.group, max(cfg.q_lens), cfg.head_dim) else "decode+prefill"


def _dense_plan(cfg: FuzzConfig, plan: planner.AttentionPlan, device: torch.device, dtype: torch.dtype):
    """``plan`` with the long requests on the dense prefill, planned whatever their work (min_flops 0),
    in a workspace of ``cfg.dense_rows`` K/V rows (None: the engines' default bound, allocated per
    configuration); unchanged where the step does not fit it."""
    hq, rows = cfg.num_kv_heads * cfg.group, sum(cfg.q_lens)
    row_bytes = 2 * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
    workspace = dense_prefill.WORKSPACE_BYTES if cfg.dense_rows is None else cfg.dense_rows * row_bytes
    engine = dense_prefill.DensePrefill(device, hq, cfg.num_kv_heads, cfg.head_dim, dtype, rows, workspace)
    engine.min_flops = 0
    return engine.plan(plan, cfg.q_lens, cfg.seq_lens, softmax_scale=cfg.softmax_scale,
                       sliding_window=cfg.sliding_window, logits_soft_cap=cfg.logits_soft_cap)


def add_arguments(p) -> None:
    p.add_argument("--configs", type=int, default=1000, help="configurations to run (default %(default)s)")
    p.add_argument("--seed", type=int, default=None, help="first seed (default: random, printed)")
    p.add_argument("--replay", type=int, default=None, help="run the one configuration of this seed, verbosely")
    p.add_argument("--max-context", type=int, default=262144)
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--out", default=None, help="write the run (settings, every record) as JSON")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds: start no configuration after this, and report how many ran")


def run(args) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.replay is not None:
        cfg = generate(args.replay, args.max_context)
        print(json.dumps(asdict(cfg), indent=1))
        rec = run_config(cfg, device)
        print(json.dumps(rec, indent=1))
        return 0 if rec["ok"] else 1
    first = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    print(f"fuzzing {args.configs} configurations from seed {first} on {device} "
          f"(kernels: {device.type == 'cuda' and capabilities.kernels_available(device)})", flush=True)
    from tqdm import tqdm
    records, t0 = [], time.time()
    for seed in tqdm(range(first, first + args.configs), file=sys.stderr, mininterval=5):
        cfg = generate(seed, args.max_context)
        try:
            rec = run_config(cfg, device)
        except Exception as exc:  # a crash is a failure of that seed, reported like the others
            rec = dict(seed=seed, summary=cfg.summary(), ok=False, failure=f"{type(exc).__name__}: {exc}")
        records.append(rec)
        if not rec["ok"]:
            tqdm.write(f"FAIL {rec['summary']}: {rec['failure']}", file=sys.stdout)
        if args.time_limit is not None and time.time() - t0 > args.time_limit:
            tqdm.write(f"time limit {args.time_limit:.0f} s reached after {len(records)} configurations",
                       file=sys.stdout)
            break
    failures = [r for r in records if not r["ok"]]
    errs = [r["rel_err"] for r in records if "rel_err" in r]
    used = [r["bound_used"] for r in records if "bound_used" in r]
    print(f"{len(records)} configurations, {len(failures)} failures, {time.time() - t0:.0f} s; "
          f"worst relative error {max(errs, default=float('nan')):.2e}; "
          f"most of the error bound used {max(used, default=float('nan')):.2f}; "
          f"paths: decode kernel {sum(r.get('path') == 'decode' for r in records)}, "
          f"with the prefill kernel {sum(r.get('path') in ('decode+prefill', 'prefill') for r in records)}, "
          f"with the dense prefill {sum('dense(' in r.get('path', '') for r in records)}; "
          f"split-KV {sum(r.get('splits', 1) > 1 for r in records)}")
    if failures:
        print(f"first failing seed: {failures[0]['seed']} (replay: nvfp4-backend fuzz --replay "
              f"{failures[0]['seed']} --max-context {args.max_context})")
    if args.out:
        meta = dict(date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), device=str(device),
                    gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                    torch=torch.__version__, first_seed=first, configs=len(records), requested=args.configs,
                    max_context=args.max_context, tolerance=TOLERANCE, command=" ".join(sys.argv))
        with open(args.out, "w") as fh:
            json.dump(dict(meta=meta, failures=len(failures), records=records), fh, indent=1)
    return 1 if failures else 0
