"""An fp64 stand-in for the dense kernel (FlashInfer's FA3 ragged prefill), so the dense prefill path's
planning, passes, merges and sinks are tested on the CPU: the same interface as
``dense_prefill.FlashInferRagged`` and the same semantics (bottom-right causal mask, ``window_left``
keys left of the diagonal, ``cap * tanh(s / cap)`` soft cap, base-2 log-sum-exp)."""
from __future__ import annotations

import math

import torch


class ReferenceRagged:
    def __init__(self):
        self.runs = 0

    def new_wrapper(self):
        return {}

    def plan(self, wrapper, qo_indptr, kv_indptr, *, causal, num_q_heads, num_kv_heads, head_dim, dtype, window_left,
             logits_soft_cap, sm_scale) -> None:
        assert qo_indptr.device.type == "cpu" and kv_indptr.device.type == "cpu", "plans take host lengths"
        wrapper.clear()
        wrapper.update(qo=qo_indptr.tolist(), kv=kv_indptr.tolist(), causal=causal, window_left=window_left,
                       cap=logits_soft_cap, scale=sm_scale, dtype=dtype, heads=(num_q_heads, num_kv_heads, head_dim))

    def run(self, wrapper, q, k, v, out, lse, sm_scale) -> None:
        self.runs += 1
        qo, kv = wrapper["qo"], wrapper["kv"]
        assert q.shape[0] == qo[-1] and k.shape[0] == kv[-1] and q.dtype == wrapper["dtype"] == k.dtype
        assert (q.shape[1], k.shape[1], q.shape[2]) == wrapper["heads"]
        group = q.shape[1] // k.shape[1]
        for i in range(len(qo) - 1):
            qs = q[qo[i]:qo[i + 1]].double()
            ks = k[kv[i]:kv[i + 1]].double().repeat_interleave(group, dim=1)
            vs = v[kv[i]:kv[i + 1]].double().repeat_interleave(group, dim=1)
            nq, nk = qs.shape[0], ks.shape[0]
            s = torch.einsum("qhd,khd->hqk", qs, ks) * sm_scale
            if wrapper["cap"]:
                s = wrapper["cap"] * torch.tanh(s / wrapper["cap"])
            qi = torch.arange(nq)[:, None] + (nk - nq)
            kj = torch.arange(nk)[None, :]
            visible = torch.ones(nq, nk, dtype=torch.bool)
            if wrapper["causal"]:
                visible &= kj <= qi
            if wrapper["window_left"] >= 0:
                visible &= kj >= qi - wrapper["window_left"]
            s = s.masked_fill(~visible, float("-inf"))
            row_lse = torch.logsumexp(s, -1)  # [h, q]
            o = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vs)
            out[qo[i]:qo[i + 1]] = o.to(out.dtype)
            if lse is not None:
                lse[qo[i]:qo[i + 1]] = (row_lse / math.log(2.0)).T.float()

    def merge(self, out, lse, other_out, other_lse) -> None:
        m = torch.maximum(lse, other_lse)
        a, b = torch.exp2(lse.double() - m), torch.exp2(other_lse.double() - m)
        merged = (out.double() * a[..., None] + other_out.double() * b[..., None]) / (a + b)[..., None]
        out.copy_(merged.to(out.dtype))
        lse.copy_((m + torch.log2(a + b)).float())
