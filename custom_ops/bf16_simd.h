// bfloat16 <-> float conversions shared by the BF16 kernels (bf16_elementwise.cc, gelu.cc,
// layer_norm.cc, scale_mask_softmax.cc): one scalar pair and, on x86-64, their AVX-512
// forms 16 lanes at a time.  Each kernel chooses the vector loops at run time with
// Bf16UseAvx512() (op_common.h); the functions here only compile for that target.
//
// Rounding is TF's float -> bfloat16 as its vectorised Eigen kernels do it (F32ToBf16):
// round to nearest even on the bit pattern (denormals too), any NaN -> 0x7fc0 (measured:
// TF's BF16 ReluGrad of inf * 0 gives 0x7fc0, not x86's default 0xffc0).  Widening is exact
// (a 16-bit shift).  Integer arithmetic only, so fp-contract settings of the including file
// do not change a bit.
#ifndef NPU_AMP_TF_CUSTOM_OPS_BF16_SIMD_H_
#define NPU_AMP_TF_CUSTOM_OPS_BF16_SIMD_H_

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#include <immintrin.h>
#define NPU_AMP_X86 1  // x86: immintrin.h and the AVX-512 target below
#define NPU_AMP_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))
#endif

namespace npu_amp_tf {

// bfloat16 bit pattern -> float (exact)
inline float Bf16Widen(uint16_t v) {
  const uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// float -> bfloat16 bit pattern: nearest even, NaN -> 0x7fc0
inline uint16_t Bf16Round(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

#ifdef NPU_AMP_X86
// the mask of the first min(left, 16) lanes
NPU_AMP_AVX512 inline __mmask16 Bf16Tail(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1u);
}

// 16 bfloat16 bit patterns -> 16 floats, as Bf16Widen
NPU_AMP_AVX512 inline __m512 Bf16Widen16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// the lanes of m read from p (the others are 0.0f and not read)
NPU_AMP_AVX512 inline __m512 Bf16Load16(const uint16_t* p, __mmask16 m) {
  return Bf16Widen16(_mm256_maskz_loadu_epi16(m, p));
}

// 16 lanes read from p
NPU_AMP_AVX512 inline __m512 Bf16Load16(const uint16_t* p) {
  return Bf16Widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 16 floats -> 16 bfloat16 bit patterns, exactly as Bf16Round
NPU_AMP_AVX512 inline __m256i Bf16Round16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  __m512i t = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  t = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(t, _mm512_set1_epi32(0x7fff)), u), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, t, _mm512_set1_epi32(0x7fc0)));
}
#endif  // NPU_AMP_X86

}  // namespace npu_amp_tf

#endif  // NPU_AMP_TF_CUSTOM_OPS_BF16_SIMD_H_
