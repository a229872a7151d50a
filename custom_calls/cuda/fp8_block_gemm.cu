// FP8 block-scaled GEMM of the dense layers as an XLA FFI handler: DeepinferFp8BlockGemm.
//
//   y[m, n] = sum_k (x[m, k] * x_scale[m, k / block_k]) * (w[n, k] * w_scale[n / block_n, k / block_k])
//
// x        [M, K]                      float8_e4m3fn   activations, one scale per 1 x block_k
// x_scale  [M, K / block_k]            float32
// w        [N, K]                      float8_e4m3fn   the checkpoint's [out, in] weight
// w_scale  [ceil(N / block_n), K / block_k] float32    one scale per block_n x block_k tile
// y        [M, N]                      float32 or bfloat16 (the result buffer's dtype decides)
// attrs    block_n, block_k (int64; V4.1 checkpoints use 32 x 32, DeepSeek-V3 128 x 128)
//
// Each K block is accumulated in fp32 from the raw e4m3 values, then promoted into the output
// accumulator with x_scale * w_scale (DeepSeek's per-block promotion). A plain SIMT tiled kernel:
// correct on sm_90a and sm_100a; tensor-core (wgmma / tcgen05) variants are future work.

#include "ffi_common.h"

namespace deepinfer {
namespace {

constexpr int kTileM = 64;
constexpr int kTileN = 64;
constexpr int kTileK = 32;   // block_k must be a multiple of this
constexpr int kThreads = 256;  // 16 x 16 threads, each owns a 4 x 4 patch of the output tile

template <typename OutT>
__global__ void Fp8BlockGemmKernel(const uint8_t* __restrict__ x, const float* __restrict__ x_scale,
                                   const uint8_t* __restrict__ w, const float* __restrict__ w_scale,
                                   OutT* __restrict__ y, int M, int N, int K, int block_n, int block_k) {
  __shared__ float xs[kTileK][kTileM + 1];
  __shared__ float ws[kTileK][kTileN + 1];
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int m0 = blockIdx.y * kTileM, n0 = blockIdx.x * kTileN;
  const int kb_count = K / block_k;
  float acc[4][4] = {};
  float part[4][4] = {};
  for (int k0 = 0; k0 < K; k0 += kTileK) {
    for (int i = threadIdx.x; i < kTileM * kTileK; i += kThreads) {
      const int r = i / kTileK, c = i % kTileK;
      const int m = m0 + r, n = n0 + r, k = k0 + c;
      xs[c][r] = m < M ? Fp8E4m3ToFloat(x[static_cast<int64_t>(m) * K + k]) : 0.f;
      ws[c][r] = n < N ? Fp8E4m3ToFloat(w[static_cast<int64_t>(n) * K + k]) : 0.f;
    }
    __syncthreads();
#pragma unroll 4
    for (int c = 0; c < kTileK; ++c) {
      float a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = xs[c][ty + 16 * i];
#pragma unroll
      for (int j = 0; j < 4; ++j) b[j] = ws[c][tx + 16 * j];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) part[i][j] += a[i] * b[j];
    }
    __syncthreads();
    if ((k0 + kTileK) % block_k == 0) {  // end of a K block: promote with its scales
      const int kb = k0 / block_k;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int m = m0 + ty + 16 * i;
        const float sx = m < M ? x_scale[static_cast<int64_t>(m) * kb_count + kb] : 0.f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int n = n0 + tx + 16 * j;
          const float sw = n < N ? w_scale[static_cast<int64_t>(n / block_n) * kb_count + kb] : 0.f;
          acc[i][j] += part[i][j] * sx * sw;
          part[i][j] = 0.f;
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int m = m0 + ty + 16 * i;
    if (m >= M) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int n = n0 + tx + 16 * j;
      if (n < N) FromFloat(acc[i][j], &y[static_cast<int64_t>(m) * N + n]);
    }
  }
}

ffi::Error Fp8BlockGemmImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer x_scale, ffi::AnyBuffer w,
                            ffi::AnyBuffer w_scale, ffi::Result<ffi::AnyBuffer> y, int64_t block_n,
                            int64_t block_k) {
  DEEPINFER_RETURN_IF_ERROR(CheckBuffer(x, "x", 2, ffi::DataType::F8E4M3FN, "float8_e4m3fn"));
  DEEPINFER_RETURN_IF_ERROR(CheckBuffer(w, "w", 2, ffi::DataType::F8E4M3FN, "float8_e4m3fn"));
  DEEPINFER_RETURN_IF_ERROR(CheckBuffer(x_scale, "x_scale", 2, ffi::DataType::F32, "float32"));
  DEEPINFER_RETURN_IF_ERROR(CheckBuffer(w_scale, "w_scale", 2, ffi::DataType::F32, "float32"));
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], N = w.dimensions()[0];
  if (block_n <= 0 || block_k <= 0 || block_k % kTileK != 0) {
    return ffi::Error::InvalidArgument("block_n must be > 0 and block_k a positive multiple of 32");
  }
  if (K % block_k != 0) return ffi::Error::InvalidArgument("K must be a multiple of block_k");
  DEEPINFER_RETURN_IF_ERROR(CheckDim(w.dimensions()[1], K, "w.shape[1] (K)"));
  DEEPINFER_RETURN_IF_ERROR(CheckDim(x_scale.dimensions()[0], M, "x_scale.shape[0] (M)"));
  DEEPINFER_RETURN_IF_ERROR(CheckDim(x_scale.dimensions()[1], K / block_k, "x_scale.shape[1] (K / block_k)"));
  DEEPINFER_RETURN_IF_ERROR(CheckDim(w_scale.dimensions()[0], (N + block_n - 1) / block_n,
                                     "w_scale.shape[0] (ceil(N / block_n))"));
  DEEPINFER_RETURN_IF_ERROR(CheckDim(w_scale.dimensions()[1], K / block_k, "w_scale.shape[1] (K / block_k)"));
  if (y->dimensions().size() != 2 || y->dimensions()[0] != M || y->dimensions()[1] != N) {
    return ffi::Error::InvalidArgument("y: expected shape [M, N]");
  }
  if (M == 0 || N == 0) return ffi::Error::Success();
  const dim3 grid((N + kTileN - 1) / kTileN, (M + kTileM - 1) / kTileM);
  const auto* xp = static_cast<const uint8_t*>(x.untyped_data());
  const auto* wp = static_cast<const uint8_t*>(w.untyped_data());
  const auto* xsp = static_cast<const float*>(x_scale.untyped_data());
  const auto* wsp = static_cast<const float*>(w_scale.untyped_data());
  const int m = static_cast<int>(M), n = static_cast<int>(N), k = static_cast<int>(K);
  const int bn = static_cast<int>(block_n), bk = static_cast<int>(block_k);
  switch (y->element_type()) {
    case ffi::DataType::F32:
      Fp8BlockGemmKernel<float><<<grid, kThreads, 0, stream>>>(xp, xsp, wp, wsp,
                                                                static_cast<float*>(y->untyped_data()), m, n, k,
                                                                bn, bk);
      break;
    case ffi::DataType::BF16:
      Fp8BlockGemmKernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(
          xp, xsp, wp, wsp, static_cast<__nv_bfloat16*>(y->untyped_data()), m, n, k, bn, bk);
      break;
    default:
      return ffi::Error::InvalidArgument("y: expected dtype float32 or bfloat16");
  }
  return LaunchStatus("Fp8BlockGemmKernel");
}

}  // namespace
}  // namespace deepinfer

DEEPINFER_FFI_EXPORT XLA_FFI_Error* DeepinferFp8BlockGemm(XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(DeepinferFp8BlockGemm, deepinfer::Fp8BlockGemmImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x
                                  .Arg<xla::ffi::AnyBuffer>()  // x_scale
                                  .Arg<xla::ffi::AnyBuffer>()  // w
                                  .Arg<xla::ffi::AnyBuffer>()  // w_scale
                                  .Ret<xla::ffi::AnyBuffer>()  // y
                                  .Attr<int64_t>("block_n")
                                  .Attr<int64_t>("block_k"));
