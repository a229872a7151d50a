"""The Ascend bridge (deepinfer_jax.ops.ascend) on a fake NPU: plain CPU torch implementing the operator
table with torch_npu's conventions. Proves the DLPack data path (shapes, dtypes, zero copy), the
results against the jnp references (eager and under jit), and the error naming the missing CANN library.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.ops import ascend
from deepinfer_jax.ops.ascend import backend
from deepinfer_jax.ops.grouped_matmul import reference as gm_ref
from deepinfer_jax.ops.sparse_attention import reference as sa_ref


class FakeNpu:
    """CPU-torch stand-ins for npu_fused_infer_attention_score / npu_grouped_matmul; records what they get."""

    def __init__(self, torch):
        self.torch, self.calls, self.moved = torch, [], []

    def fia(self, query, key, value, *, atten_mask, num_heads, num_key_value_heads, scale, input_layout,
            softmax_lse_flag):
        t = self.torch
        assert input_layout == "BNSD" and softmax_lse_flag and atten_mask.dtype == t.bool
        assert query.shape[1] == num_heads and key.shape[1] == num_key_value_heads and key.shape == value.shape
        self.calls.append(("fia", query.dtype, tuple(query.shape), tuple(key.shape), tuple(atten_mask.shape)))
        rep = num_heads // num_key_value_heads
        k, v = key.repeat_interleave(rep, dim=1).float(), value.repeat_interleave(rep, dim=1).float()
        logits = (query.float() @ k.transpose(-1, -2)) * scale  # [B, N, S, Skv]
        logits = logits.masked_fill(atten_mask, -t.inf)
        lse = t.logsumexp(logits, dim=-1, keepdim=True)  # [B, N, S, 1]; -inf on fully masked rows
        out = t.softmax(logits, dim=-1) @ v  # NaN on fully masked rows, as a real kernel may give garbage
        return out.to(query.dtype), lse

    def gmm(self, x, weight, *, group_list, split_item, group_type, group_list_type):
        t = self.torch
        assert len(x) == 1 and split_item == 3 and group_type == 0 and group_list_type == 0
        assert group_list.dtype == t.int64 and len(weight) == len(group_list)
        x = x[0]
        self.calls.append(("gmm", x.dtype, tuple(x.shape), tuple(weight[0].shape)))
        y = t.full((x.shape[0], weight[0].shape[1]), float("nan"), dtype=x.dtype)  # rows past the groups: garbage
        start = 0
        for g, end in enumerate(group_list.tolist()):
            y[start:end] = (x[start:end].float() @ weight[g].float()).to(x.dtype)
            start = end
        return [y]

    def to_device(self, tensor):
        assert isinstance(tensor, self.torch.Tensor)
        self.moved.append(tensor.dtype)
        return tensor

    def ops(self) -> ascend.NpuOps:
        t = self.torch
        return ascend.NpuOps(name="fake-cpu-torch", fused_infer_attention_score=self.fia, grouped_matmul=self.gmm,
                             to_device=self.to_device, to_host=lambda x: x,
                             attention_dtypes=(t.float32, t.bfloat16))


@pytest.fixture
def fake():
    torch = pytest.importorskip("torch", reason="torch is not importable: the fake NPU backend is plain CPU torch")
    return FakeNpu(torch)


def _attention_inputs(rng, q_dtype, kv_dtype, n=6, h=4, d=16, w=5, p=7, e=4, r=3, m=3, k=5):
    """Random inputs with ragged windows, holes in the block tables, empty top-k slots, one token with nothing."""
    tables = jnp.asarray(rng.integers(0, p, (r, m)), jnp.int32).at[1, 1].set(-1).at[2, 0].set(-1)
    topk = jnp.asarray(rng.integers(-1, m * e, (n, k)), jnp.int32).at[4].set(-1)
    valid = jnp.asarray(rng.random((n, w)) < 0.6).at[0].set(True).at[4].set(False)
    return (jnp.asarray(rng.normal(size=(n, h, d)), q_dtype), jnp.asarray(rng.normal(size=(n, w, d)), kv_dtype), valid,
            jnp.asarray(rng.normal(size=(p, e, d)), kv_dtype), tables, jnp.asarray(rng.integers(0, r, n), jnp.int32),
            topk, jnp.asarray(rng.normal(size=(h,)), jnp.float32))


def test_dlpack_hand_off_keeps_shape_dtype_and_buffer(fake):
    from deepinfer_jax.ops.ascend.dlpack import to_jax, to_torch

    torch = fake.torch
    for dt, tdt in ((jnp.float32, torch.float32), (jnp.bfloat16, torch.bfloat16), (jnp.int32, torch.int32),
                    (jnp.bool_, torch.bool)):
        x = jnp.asarray(np.arange(12).reshape(3, 4) % 5 - 2, dt)
        t = to_torch(x)
        assert t.dtype == tdt and tuple(t.shape) == (3, 4)
        assert t.data_ptr() == x.unsafe_buffer_pointer()  # zero copy into torch
        back = to_jax(t.t())  # a non-contiguous view comes back contiguous
        assert back.dtype == dt and back.shape == (4, 3)
        np.testing.assert_array_equal(np.asarray(back), np.asarray(x).T)
    with pytest.raises(TypeError, match="jax.Array"):
        to_torch(np.zeros(3))


@pytest.mark.parametrize(("q_dtype", "kv_dtype", "tol"), [(jnp.float32, jnp.float32, 1e-5),
                                                          (jnp.bfloat16, jnp.float32, 3e-2),
                                                          (jnp.bfloat16, jnp.bfloat16, 3e-2)])
def test_sparse_attention_matches_reference(fake, q_dtype, kv_dtype, tol):
    args = _attention_inputs(np.random.default_rng(0), q_dtype, kv_dtype)
    got = ascend.sparse_attention(*args, ops=fake.ops())
    want = sa_ref.sparse_attention(*args)
    assert got.dtype == q_dtype and got.shape == want.shape == args[0].shape
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)
    assert np.all(np.asarray(got[4], np.float32) == 0)  # the token with no valid key: only the sink
    n, h, d = args[0].shape
    s = args[1].shape[1] + args[6].shape[1]
    name, dt, q_shape, k_shape, mask_shape = fake.calls[0]
    assert (name, q_shape, k_shape, mask_shape) == ("fia", (n, h, 1, d), (n, 1, s, d), (n, 1, 1, s))
    assert dt == (fake.torch.float32 if q_dtype == jnp.float32 else fake.torch.bfloat16)
    assert len(fake.moved) == 8  # every input went through the table's to_device


def test_grouped_matmul_matches_reference(fake):
    rng = np.random.default_rng(1)
    sizes = jnp.asarray([3, 0, 4, 2], jnp.int32)  # an empty group; 9 of 11 rows used, the rest must be zero
    for dt, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)):
        x = jnp.asarray(rng.normal(size=(11, 8)), dt)
        w = jnp.asarray(rng.normal(size=(4, 6, 8)), dt)
        got = ascend.grouped_matmul(x, w, sizes, ops=fake.ops())
        want = gm_ref.grouped_matmul(x, w, sizes)
        assert got.dtype == dt and got.shape == (11, 6)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)
        assert np.all(np.asarray(got[9:], np.float32) == 0)
    assert [c[3] for c in fake.calls] == [(8, 6), (8, 6)]  # weights handed over as [K, N] per group
    with pytest.raises(ValueError, match="^w_GNK:"):
        ascend.grouped_matmul(x, w[:, :, :5], sizes, ops=fake.ops())


def test_bridge_runs_under_jit_through_a_callback(fake):
    args = _attention_inputs(np.random.default_rng(2), jnp.bfloat16, jnp.float32)
    with ascend.use_ops(fake.ops()):
        got = jax.jit(ascend.sparse_attention)(*args)
        x, w, sizes = args[1][:, 0], jnp.ones((2, 3, args[1].shape[2]), jnp.float32), jnp.asarray([2, 3], jnp.int32)
        y = jax.jit(ascend.grouped_matmul)(x, w, sizes)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(sa_ref.sparse_attention(*args), np.float32),
                               rtol=3e-2, atol=3e-2)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y), np.asarray(gm_ref.grouped_matmul(x, w, sizes)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("exc", "lib"), [
    (OSError("libhccl.so: cannot open shared object file: No such file or directory"), "libhccl.so"),
    (ImportError("libascendcl.so: cannot open shared object file: No such file or directory"), "libascendcl.so"),
    (ModuleNotFoundError("No module named 'torch_npu'", name="torch_npu"), None),
])
def test_torch_npu_load_failure_names_the_cann_library(monkeypatch, exc, lib):
    real_import = backend.importlib.import_module

    def fake_import(name, *a, **kw):
        if name == "torch_npu":
            raise exc
        return real_import(name, *a, **kw)

    monkeypatch.setattr(backend.importlib, "import_module", fake_import)
    monkeypatch.setattr(backend, "_default", None)
    monkeypatch.delenv("TORCH_DEVICE_BACKEND_AUTOLOAD", raising=False)
    with pytest.raises(ascend.AscendUnavailableError) as err:
        ascend.grouped_matmul(jnp.ones((2, 4)), jnp.ones((1, 3, 4)), jnp.asarray([2], jnp.int32))  # default table
    assert err.value.missing_library == lib
    msg = str(err.value)
    assert "set_env.sh" in msg and "deepinfer-jax[ascend]" in msg
    assert (lib in msg) if lib else ("not installed" in msg)
    assert isinstance(err.value, ImportError) and err.value.__cause__ is exc
    import os

    assert os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] == "0"  # set before torch_npu is imported
    with pytest.raises(TypeError, match="NpuOps"), ascend.use_ops("torch_npu"):
        pass
