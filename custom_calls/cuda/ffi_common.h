// Shared helpers of the deepinfer-jax XLA FFI handlers: export macro, shape checks, dtype loads.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

// Handlers are the only symbols the library exports (it is built with -fvisibility=hidden).
#define DEEPINFER_FFI_EXPORT extern "C" __attribute__((visibility("default")))

namespace deepinfer {

namespace ffi = xla::ffi;

// Error naming `what` unless `buf` has rank `rank` and element type `dtype`.
inline ffi::Error CheckBuffer(const ffi::AnyBuffer& buf, const char* what, size_t rank, ffi::DataType dtype,
                              const char* dtype_name) {
  if (buf.dimensions().size() != rank) {
    return ffi::Error::InvalidArgument(std::string(what) + ": expected rank " + std::to_string(rank) + ", got " +
                                       std::to_string(buf.dimensions().size()));
  }
  if (buf.element_type() != dtype) {
    return ffi::Error::InvalidArgument(std::string(what) + ": expected dtype " + dtype_name);
  }
  return ffi::Error::Success();
}

inline ffi::Error CheckDim(int64_t got, int64_t want, const char* what) {
  if (got != want) {
    return ffi::Error::InvalidArgument(std::string(what) + ": expected " + std::to_string(want) + ", got " +
                                       std::to_string(got));
  }
  return ffi::Error::Success();
}

// The last CUDA error after a launch, as an FFI error.
inline ffi::Error LaunchStatus(const char* kernel) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string(kernel) + ": " + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

// Element loads/stores in fp32 for the storage dtypes the handlers accept.
__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float Fp8E4m3ToFloat(uint8_t bits) {
  __nv_fp8_e4m3 v;
  v.__x = bits;
  return static_cast<float>(v);
}
__device__ __forceinline__ void FromFloat(float v, float* out) { *out = v; }
__device__ __forceinline__ void FromFloat(float v, __nv_bfloat16* out) { *out = __float2bfloat16(v); }

}  // namespace deepinfer

#define DEEPINFER_RETURN_IF_ERROR(expr)  \
  do {                                   \
    ::xla::ffi::Error _err = (expr);     \
    if (_err.failure()) return _err;     \
  } while (0)
