// common.cuh — small device helpers shared by the decode kernels.
//
// The kernels include no CUDA headers at all: element types are handled as raw bits and
// converted with single PTX instructions. That keeps them compilable by NVRTC alone (no CUDA
// runtime headers needed on the user's machine) and makes every conversion explicit.
//
// Element type codes (DTYPE_ID and friends, set by cupydecode/_kernels.py):
//   0 = float16, 1 = bfloat16, 2 = float32
#pragma once

typedef unsigned short u16;
typedef unsigned int u32;

#define CD_NEG_INF (__int_as_float(0xff800000))
#define CD_LN2 0.693147180559945309f
#define CD_LOG2E 1.442695040888963407f

// 2^x with the SFU instruction: ~2 ulp, and ex2(-inf) = +0, which is what every masked score
// relies on.
__device__ __forceinline__ float cd_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ float cd_half_to_float(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ u16 cd_float_to_half(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
// bfloat16 is the top half of a float32: widening is exact, narrowing rounds to nearest even.
__device__ __forceinline__ float cd_bf16_to_float(u16 h) {
    return __uint_as_float(((u32)h) << 16);
}
__device__ __forceinline__ u16 cd_float_to_bf16(float f) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Element access by type code: the storage type and its float conversions.
template <int ID> struct cd_elem;
template <> struct cd_elem<0> {
    typedef u16 storage;
    static __device__ __forceinline__ float to_float(u16 x) { return cd_half_to_float(x); }
    static __device__ __forceinline__ u16 from_float(float x) { return cd_float_to_half(x); }
};
template <> struct cd_elem<1> {
    typedef u16 storage;
    static __device__ __forceinline__ float to_float(u16 x) { return cd_bf16_to_float(x); }
    static __device__ __forceinline__ u16 from_float(float x) { return cd_float_to_bf16(x); }
};
template <> struct cd_elem<2> {
    typedef float storage;
    static __device__ __forceinline__ float to_float(float x) { return x; }
    static __device__ __forceinline__ float from_float(float x) { return x; }
};

// Merge of two softmax states written in the log2 domain (see DESIGN.md; m in log2 units).
// A state is (m, l, acc) with l = Σ 2^(s2_j − m) and acc = Σ 2^(s2_j − m) v_j. The empty state
// is (−inf, 0, 0). Returns the scale each side must be multiplied by after moving to the new
// maximum; never forms −inf − (−inf).
struct cd_rescale { float m; float a; float b; };
__device__ __forceinline__ cd_rescale cd_merge_scales(float m_a, float m_b) {
    cd_rescale r;
    r.m = fmaxf(m_a, m_b);
    const float ref = (r.m == CD_NEG_INF) ? 0.f : r.m;  // both empty: keep 0 · (anything finite)
    r.a = cd_exp2(m_a - ref);
    r.b = cd_exp2(m_b - ref);
    return r;
}
