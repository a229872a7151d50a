// CSA2 sparse attention of one query token per row as an XLA FFI handler:
// DeepinferSparseAttentionDecode (decode: every row of the flat batch is one token).
//
// Layout = deepinfer_jax/ops/sparse_attention/reference.py (K = V: single-latent MQA, all heads read
// the same key rows). For token n:
//   window part: rows window[n, i] where window_valid[n, i]
//   global part: for each j = topk[n, i] >= 0: b = block_tables[token_req[n], min(j / E, M - 1)];
//                valid if b >= 0, row pool[min(b, P - 1), j % E]
//   sink:        an extra zero-valued key whose logit is sink[h] (not scaled)
// Each part runs its own online softmax (max m, sum l, weighted sum acc); the two parts and the sink
// are merged by log-sum-exp:  M = max(m_w, m_g, sink),
//   out = (acc_w e^{m_w-M} + acc_g e^{m_g-M}) / (l_w e^{m_w-M} + l_g e^{m_g-M} + e^{sink-M}),
//   lse = M + log(denominator).
//
// q            [N, H, D]  float32 | bfloat16
// window       [N, W, D]  float32 | bfloat16 (the SWA rows, gathered by the caller)
// window_valid [N, W]     bool
// pool         [P, E, D]  window's dtype (global entries, E per block)
// block_tables [R, M]     int32 (-1 = hole)
// token_req    [N]        int32 (clamped to [0, R))
// topk         [N, K]     int32 (request-logical entry ids, -1 = empty)
// sink         [H]        float32
// attr         scale (float32; logits = scale * q.k)
// outputs      out [N, H, D] q's dtype, lse [N, H] float32

#include <cmath>

#include "ffi_common.h"

namespace deepinfer {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxD = 1024;
constexpr int kPerThread = kMaxD / kThreads;

struct Params {
  int N, H, D, W, P, E, R, M, K;
  float scale;
};

// Running softmax state of one part for the channels a thread owns.
struct Part {
  float m = -INFINITY, l = 0.f;
  float acc[kPerThread] = {};
};

template <typename T>
__device__ void Attend(const T* const* rows, const float* scores, int n, int D, Part& st) {
  for (int j = 0; j < n; ++j) {
    const float s = scores[j];
    if (s == -INFINITY) continue;
    const float m_new = fmaxf(st.m, s);
    const float corr = st.m == -INFINITY ? 0.f : expf(st.m - m_new);
    const float p = expf(s - m_new);
    st.l = st.l * corr + p;
#pragma unroll
    for (int c = 0; c < kPerThread; ++c) {
      const int d = threadIdx.x + c * kThreads;
      st.acc[c] = st.acc[c] * corr + (d < D ? p * ToFloat(rows[j][d]) : 0.f);
    }
    st.m = m_new;
  }
}

// Runs one part over its n candidate keys; row_of(i) gives key i's row or nullptr when invalid.
template <typename T, typename RowOf>
__device__ void RunPart(const float* q_s, int n, const Params& p, RowOf row_of, Part& st, const T** rows_s,
                        float* scores_s) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int i0 = 0; i0 < n; i0 += kWarps) {
    const int i = i0 + warp;
    const T* row = i < n ? row_of(i) : nullptr;
    float dot = 0.f;
    if (row != nullptr) {
      for (int d = lane; d < p.D; d += 32) dot += q_s[d] * ToFloat(row[d]);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
    if (lane == 0) {
      rows_s[warp] = row;
      scores_s[warp] = row != nullptr ? dot * p.scale : -INFINITY;
    }
    __syncthreads();
    Attend<T>(rows_s, scores_s, min(kWarps, n - i0), p.D, st);
    __syncthreads();
  }
}

template <typename TQ, typename TKV>
__global__ void SparseAttentionDecodeKernel(const TQ* __restrict__ q, const TKV* __restrict__ window,
                                            const bool* __restrict__ window_valid, const TKV* __restrict__ pool,
                                            const int32_t* __restrict__ block_tables,
                                            const int32_t* __restrict__ token_req, const int32_t* __restrict__ topk,
                                            const float* __restrict__ sink, TQ* __restrict__ out,
                                            float* __restrict__ lse, Params p) {
  __shared__ float q_s[kMaxD];
  __shared__ const TKV* rows_s[kWarps];
  __shared__ float scores_s[kWarps];
  const int n = blockIdx.x, h = blockIdx.y;
  const int64_t o_base = (static_cast<int64_t>(n) * p.H + h) * p.D;
  for (int d = threadIdx.x; d < p.D; d += kThreads) q_s[d] = ToFloat(q[o_base + d]);
  __syncthreads();

  const int req = min(max(token_req[n], 0), p.R - 1);
  Part win, glob;
  RunPart<TKV>(
      q_s, p.W, p,
      [&](int i) -> const TKV* {
        const int64_t at = static_cast<int64_t>(n) * p.W + i;
        return window_valid[at] ? window + at * p.D : nullptr;
      },
      win, rows_s, scores_s);
  RunPart<TKV>(
      q_s, p.K, p,
      [&](int i) -> const TKV* {
        const int j = topk[static_cast<int64_t>(n) * p.K + i];
        if (j < 0) return nullptr;
        const int b = block_tables[static_cast<int64_t>(req) * p.M + min(j / p.E, p.M - 1)];
        if (b < 0) return nullptr;
        return pool + (static_cast<int64_t>(min(b, p.P - 1)) * p.E + j % p.E) * p.D;
      },
      glob, rows_s, scores_s);

  // Log-sum-exp merge of the window part, the global part and the sink.
  const float sk = sink[h];
  const float m = fmaxf(fmaxf(win.m, glob.m), sk);
  const float ew = win.m == -INFINITY ? 0.f : expf(win.m - m);
  const float eg = glob.m == -INFINITY ? 0.f : expf(glob.m - m);
  const float den = win.l * ew + glob.l * eg + expf(sk - m);
#pragma unroll
  for (int c = 0; c < kPerThread; ++c) {
    const int d = threadIdx.x + c * kThreads;
    if (d < p.D) FromFloat((win.acc[c] * ew + glob.acc[c] * eg) / den, &out[o_base + d]);
  }
  if (threadIdx.x == 0) lse[static_cast<int64_t>(n) * p.H + h] = m + logf(den);
}

template <typename TQ, typename TKV>
void Launch(cudaStream_t stream, const ffi::AnyBuffer& q, const ffi::AnyBuffer& window,
            const ffi::AnyBuffer& window_valid, const ffi::AnyBuffer& pool, const ffi::AnyBuffer& block_tables,
            const ffi::AnyBuffer& token_req, const ffi::AnyBuffer& topk, const ffi::AnyBuffer& sink,
            ffi::AnyBuffer& out, ffi::AnyBuffer& lse, const Params& p) {
  const dim3 grid(p.N, p.H);
  SparseAttentionDecodeKernel<TQ, TKV><<<grid, kThreads, 0, stream>>>(
      static_cast<const TQ*>(q.untyped_data()), static_cast<const TKV*>(window.untyped_data()),
      static_cast<const bool*>(window_valid.untyped_data()), static_cast<const TKV*>(pool.untyped_data()),
      static_cast<const int32_t*>(block_tables.untyped_data()), static_cast<const int32_t*>(token_req.untyped_data()),
      static_cast<const int32_t*>(topk.untyped_data()), static_cast<const float*>(sink.untyped_data()),
      static_cast<TQ*>(out.untyped_data()), static_cast<float*>(lse.untyped_data()), p);
}

bool IsFloat(ffi::DataType t) { return t == ffi::DataType::F32 || t == ffi::DataType::BF16; }

ffi::Error SparseAttentionDecodeImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer window,
                                     ffi::AnyBuffer window_valid, ffi::AnyBuffer pool, ffi::AnyBuffer block_tables,
                                     ffi::AnyBuffer token_req, ffi::AnyBuffer topk, ffi::AnyBuffer sink,
                                     ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse, float scale) {
  const ffi::DataType tq = q.element_type(), tkv = window.element_type();
  if (!IsFloat(tq)) return ffi::Error::InvalidArgument("q: expected dtype float32 or bfloat16");
  if (!IsFloat(tkv)) return ffi::Error::InvalidArgument("window: expected dtype float32 or bfloat16");
  const char* kvn = tkv == ffi::DataType::F32 ? "float32 (window's dtype)" : "bfloat16 (window's dtype)";
  DEEPINFER_RETURN_IF_ERROR(CheckBuffer(q, "q", 3, tq, "float32 or bfloat16"));
  DEEPINFER_RETURN_IF_ERROR(CheckBuffer(window, "window", 3, tkv, kvn));
  DEEPINFER_RETURN_IF_ERROR(CheckBuffer(window_valid, "window_valid", 2, ffi::DataType::PRED, "bool"));
  DEEPINFER_RETURN_IF_ERROR(CheckBuffer(pool, "pool", 3, tkv, kvn));
  DEEPINFER_RETURN_IF_ERROR(CheckBuffer(block_tables, "block_tables", 2, ffi::DataType::S32, "int32"));
  DEEPINFER_RETURN_IF_ERROR(CheckBuffer(token_req, "token_req", 1, ffi::DataType::S32, "int32"));
  DEEPINFER_RETURN_IF_ERROR(CheckBuffer(topk, "topk", 2, ffi::DataType::S32, "int32"));
  DEEPINFER_RETURN_IF_ERROR(CheckBuffer(sink, "sink", 1, ffi::DataType::F32, "float32"));
  Params p;
  p.N = static_cast<int>(q.dimensions()[0]);
  p.H = static_cast<int>(q.dimensions()[1]);
  p.D = static_cast<int>(q.dimensions()[2]);
  p.W = static_cast<int>(window.dimensions()[1]);
  p.P = static_cast<int>(pool.dimensions()[0]);
  p.E = static_cast<int>(pool.dimensions()[1]);
  p.R = static_cast<int>(block_tables.dimensions()[0]);
  p.M = static_cast<int>(block_tables.dimensions()[1]);
  p.K = static_cast<int>(topk.dimensions()[1]);
  p.scale = scale;
  if (p.D > kMaxD) return ffi::Error::InvalidArgument("q: head dim must be <= 1024");
  DEEPINFER_RETURN_IF_ERROR(CheckDim(window.dimensions()[0], p.N, "window.shape[0] (N)"));
  DEEPINFER_RETURN_IF_ERROR(CheckDim(window.dimensions()[2], p.D, "window.shape[2] (D)"));
  DEEPINFER_RETURN_IF_ERROR(CheckDim(window_valid.dimensions()[0], p.N, "window_valid.shape[0] (N)"));
  DEEPINFER_RETURN_IF_ERROR(CheckDim(window_valid.dimensions()[1], p.W, "window_valid.shape[1] (W)"));
  DEEPINFER_RETURN_IF_ERROR(CheckDim(pool.dimensions()[2], p.D, "pool.shape[2] (D)"));
  DEEPINFER_RETURN_IF_ERROR(CheckDim(token_req.dimensions()[0], p.N, "token_req.shape[0] (N)"));
  DEEPINFER_RETURN_IF_ERROR(CheckDim(topk.dimensions()[0], p.N, "topk.shape[0] (N)"));
  DEEPINFER_RETURN_IF_ERROR(CheckDim(sink.dimensions()[0], p.H, "sink.shape[0] (H)"));
  if (out->element_type() != tq) return ffi::Error::InvalidArgument("out: expected q's dtype");
  if (lse->element_type() != ffi::DataType::F32) return ffi::Error::InvalidArgument("lse: expected float32");
  if (p.N == 0 || p.H == 0) return ffi::Error::Success();
  if (p.K > 0 && (p.R == 0 || p.M == 0 || p.P == 0 || p.E == 0)) {
    return ffi::Error::InvalidArgument("block_tables and pool must be non-empty when topk has entries");
  }
  using B = __nv_bfloat16;
  const bool q32 = tq == ffi::DataType::F32, kv32 = tkv == ffi::DataType::F32;
  if (q32 && kv32) Launch<float, float>(stream, q, window, window_valid, pool, block_tables, token_req, topk, sink, *out, *lse, p);
  if (q32 && !kv32) Launch<float, B>(stream, q, window, window_valid, pool, block_tables, token_req, topk, sink, *out, *lse, p);
  if (!q32 && kv32) Launch<B, float>(stream, q, window, window_valid, pool, block_tables, token_req, topk, sink, *out, *lse, p);
  if (!q32 && !kv32) Launch<B, B>(stream, q, window, window_valid, pool, block_tables, token_req, topk, sink, *out, *lse, p);
  return LaunchStatus("SparseAttentionDecodeKernel");
}

}  // namespace
}  // namespace deepinfer

DEEPINFER_FFI_EXPORT XLA_FFI_Error* DeepinferSparseAttentionDecode(XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(DeepinferSparseAttentionDecode, deepinfer::SparseAttentionDecodeImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // q
                                  .Arg<xla::ffi::AnyBuffer>()  // window
                                  .Arg<xla::ffi::AnyBuffer>()  // window_valid
                                  .Arg<xla::ffi::AnyBuffer>()  // pool
                                  .Arg<xla::ffi::AnyBuffer>()  // block_tables
                                  .Arg<xla::ffi::AnyBuffer>()  // token_req
                                  .Arg<xla::ffi::AnyBuffer>()  // topk
                                  .Arg<xla::ffi::AnyBuffer>()  // sink
                                  .Ret<xla::ffi::AnyBuffer>()  // out
                                  .Ret<xla::ffi::AnyBuffer>()  // lse
                                  .Attr<float>("scale"));
