"""The Ascend bridge: the kernels' JAX signatures run by torch_npu's fused operators.

Each function takes JAX arrays in the layout of its jnp reference (``ops/sparse_attention``,
``ops/grouped_matmul``), hands them to torch through DLPack, moves them to the NPU (``ops.to_device``),
calls the operator table (``backend.NpuOps``), and returns the result as a JAX array. Eagerly the
hand-off is zero-copy DLPack; under ``jax.jit`` the same host function runs in a ``jax.pure_callback``
(arrays arrive as numpy, bfloat16 through a uint16 view).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.ops.ascend import backend
from deepinfer_jax.ops.ascend.dlpack import to_jax, to_torch

_Tracer = jax.core.Tracer  # public in jax 0.10-0.12


def _check(cond: bool, field: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{field}: {msg}")


def _np_to_torch(a: np.ndarray):
    import torch

    if a.dtype == jnp.bfloat16:
        return torch.from_numpy(np.array(a).view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(np.array(a))  # a writable copy: torch rejects read-only buffers


def _torch_to_np(t) -> np.ndarray:
    import torch

    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.uint16).numpy().view(jnp.bfloat16)
    return t.numpy()


def _run(host_fn, out: jax.ShapeDtypeStruct, *arrays):
    """Run ``host_fn(*torch tensors) -> torch tensor`` on JAX arrays: eagerly via DLPack, traced via a callback."""
    if any(isinstance(a, _Tracer) for a in arrays):

        def callback(*host):
            return _torch_to_np(host_fn(*map(_np_to_torch, host))).astype(out.dtype, copy=False)

        return jax.pure_callback(callback, out, *arrays)
    return to_jax(host_fn(*map(to_torch, arrays)))


def sparse_attention(q_NHD, window_NWD, window_valid_NW, pool_PED, block_tables_RM, token_req_N, topk_NK, sink_H,
                     *, ops: backend.NpuOps | None = None) -> jax.Array:
    """o [N, H, D] in q's dtype, as ``ops.sparse_attention.reference.sparse_attention`` (same inputs).

    On the NPU: the token's keys (window rows + the top-k global rows gathered through the block table)
    go to ``npu_fused_infer_attention_score`` (BNSD, one query per batch row, MQA: one KV head, invalid
    keys masked, ``softmax_lse_flag``); the sink joins by log-sum-exp on the returned lse:
    ``o = o_keys * exp(lse - logaddexp(lse, sink))``. Tokens with no valid key give 0.
    """
    n, h, d = q_NHD.shape
    _check(window_NWD.shape[::2] == (n, d), "window_NWD", f"expected [{n}, W, {d}], got {window_NWD.shape}")
    _check(window_valid_NW.shape == window_NWD.shape[:2], "window_valid_NW", f"expected {window_NWD.shape[:2]}")
    _check(pool_PED.ndim == 3 and pool_PED.shape[2] == d, "pool_PED", f"expected [P, E, {d}], got {pool_PED.shape}")
    _check(token_req_N.shape == (n,) and topk_NK.shape[0] == n, "token_req_N/topk_NK", f"expected leading dim {n}")
    _check(sink_H.shape == (h,), "sink_H", f"expected [{h}], got {sink_H.shape}")
    table = backend.get_ops(ops)

    def host(q, win, win_ok, pool, tables, req, topk, sink):
        import torch

        dev = table.to_device
        q, win, win_ok, pool, tables, req, topk, sink = map(dev, (q, win, win_ok, pool, tables, req, topk, sink))
        e = pool.shape[1]
        j = topk.long().clamp(min=0)
        rq = req.long().clamp(0, tables.shape[0] - 1)[:, None]
        blk = tables[rq, (j // e).clamp(max=tables.shape[1] - 1)].long()
        ok_g = (topk >= 0) & (blk >= 0)
        rows = pool[blk.clamp(0, pool.shape[0] - 1), j % e]
        cdt = q.dtype if q.dtype in table.attention_dtypes else torch.bfloat16
        keys = torch.cat([win.to(cdt), rows.to(cdt)], dim=1)  # [N, S, D]
        ok = torch.cat([win_ok.bool(), ok_g], dim=1)  # [N, S]
        keys = keys.masked_fill(~ok[..., None], 0)
        kv = keys[:, None].contiguous()  # [N, 1, S, D]: one KV head
        o, lse = table.fused_infer_attention_score(
            q.to(cdt)[:, :, None].contiguous(), kv, kv, atten_mask=~ok[:, None, None, :], num_heads=h,
            num_key_value_heads=1, scale=d**-0.5, input_layout="BNSD", softmax_lse_flag=True)
        any_ok = ok.any(dim=1)[:, None]  # [N, 1]
        lse = torch.where(any_ok, lse.reshape(n, h).float(), -torch.inf)
        total = torch.logaddexp(lse, sink.float()[None, :])
        o = torch.where(any_ok[..., None], o.reshape(n, h, d).float(), 0.0) * torch.exp(lse - total)[..., None]
        return table.to_host(o.to(q.dtype))

    return _run(host, jax.ShapeDtypeStruct((n, h, d), q_NHD.dtype), q_NHD, window_NWD, window_valid_NW, pool_PED,
                block_tables_RM, token_req_N, topk_NK, sink_H)


def grouped_matmul(x_MK, w_GNK, group_sizes_G, *, ops: backend.NpuOps | None = None) -> jax.Array:
    """[M, N] in x's dtype, as ``ops.grouped_matmul.reference.grouped_matmul``: rows sorted by group,
    ``y[m] = x[m] @ w[g(m)].T`` (weights [out, in]), rows past ``sum(group_sizes)`` zero.

    On the NPU: ``npu_grouped_matmul([x], [w_g.T for g], group_list=cumsum(sizes), split_item=3,
    group_type=0, group_list_type=0)``.
    """
    m, k = x_MK.shape
    _check(w_GNK.ndim == 3 and w_GNK.shape[2] == k, "w_GNK", f"expected [G, N, {k}], got {w_GNK.shape}")
    _check(group_sizes_G.shape == (w_GNK.shape[0],), "group_sizes_G", f"expected [{w_GNK.shape[0]}]")
    _check(jnp.issubdtype(group_sizes_G.dtype, jnp.integer), "group_sizes_G", f"expected integers, got "
           f"{group_sizes_G.dtype}")
    table = backend.get_ops(ops)

    def host(x, w, sizes):
        import torch

        x, w, sizes = map(table.to_device, (x, w, sizes))
        ends = torch.cumsum(sizes.long(), dim=0)
        weights = [wg.to(x.dtype).t().contiguous() for wg in w.unbind(0)]  # [K, N] each
        (y,) = table.grouped_matmul([x.contiguous()], weights, group_list=ends, split_item=3, group_type=0,
                                    group_list_type=0)
        live = torch.arange(x.shape[0], device=y.device) < ends[-1]
        return table.to_host(torch.where(live[:, None], y, torch.zeros((), dtype=y.dtype, device=y.device)))

    return _run(host, jax.ShapeDtypeStruct((m, w_GNK.shape[1]), x_MK.dtype), x_MK, w_GNK, group_sizes_G)
