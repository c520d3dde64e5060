#pragma once
// Shared by the native kernels' files (one translation unit: decode_step.cpp includes them all).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>
#include <torch/library.h>

namespace {

using at::Tensor;
using at::indexing::Slice;

// this library's ISA (vec.h) is on this CPU: native/__init__.py loads only such a library; the
// kernels check it once more rather than fault
bool isa_supported() {
#if defined(PD_ISA_AVX512)
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                         __builtin_cpu_supports("fma");
#else
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  return ok;
}

bool panel_gemm_supported() { return isa_supported(); }

std::string native_isa() { return ISA_NAME; }

#define PD_UNROLL _Pragma("GCC unroll 16")

// the first `valid` of 16 lanes (all for 16 or more, none for 0 or less): the output columns of
// a panel half that exist (the last panel's padding rows are not written)
inline M16 lane_mask(int64_t valid) {
  return static_cast<M16>(valid >= 16 ? 0xFFFF : valid <= 0 ? 0 : (1u << valid) - 1u);
}

}  // namespace
