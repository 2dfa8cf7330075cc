// fp8.cuh — the two 8-bit float formats of low-precision KV caches, as raw codes.
//
// e4m3 (float8_e4m3fn: 4 exponent bits, bias 7, 3 mantissa bits, no infinities, NaN = S.1111.111,
// largest finite 448) and e5m2 (5 exponent bits, bias 15, 2 mantissa bits, IEEE-like: ±inf and
// NaNs, largest finite 57344). A cache holds the codes; a key is code · k_scale.
//
// Encoding (cupydecode/reference.py quantize_kv is the same rule): round to the nearest code,
// ties to even, saturating: every finite value beyond the largest finite code and ±inf become
// ±that code; NaN becomes NaN. Written with integer and float32 operations only, so that it is the
// same on every GPU (sm_89+ have a conversion instruction, sm_80 has none) and can be mirrored
// exactly on the host (tests/test_fp8_cpu.py runs the same steps against ml_dtypes).
#pragma once

typedef unsigned char u8;

template <int EBITS, int MBITS, int BIAS, unsigned MAX_CODE, unsigned NAN_CODE>
struct cd_fp8_format {
    static constexpr int ebits = EBITS, mbits = MBITS, bias = BIAS;
    static constexpr unsigned max_code = MAX_CODE, nan_code = NAN_CODE;
};
typedef cd_fp8_format<4, 3, 7, 0x7Eu, 0x7Fu> cd_e4m3;
typedef cd_fp8_format<5, 2, 15, 0x7Bu, 0x7Eu> cd_e5m2;

// 2^k for a small integer k, exactly (float32 normal range)
__device__ __forceinline__ float cd_pow2(int k) { return __uint_as_float((u32)(k + 127) << 23); }

template <class F>
__device__ __forceinline__ float cd_fp8_max() {  // the largest finite value
    return (1.0f + (float)((F::max_code & ((1u << F::mbits) - 1))) / (float)(1u << F::mbits)) *
           cd_pow2((int)(F::max_code >> F::mbits) - F::bias);
}

template <class F>
__device__ __forceinline__ u8 cd_fp8_encode(float f) {
    const u32 b = __float_as_uint(f);
    const u32 sign = (b >> 24) & 0x80u;
    const float a = fabsf(f);
    if (a != a) return (u8)(sign | F::nan_code);
    if (a >= cd_fp8_max<F>()) return (u8)(sign | F::max_code);  // saturate (±inf too)
    const int e = (int)((b >> 23) & 0xFFu) - 127;                // a's exponent (a < 2^9 here)
    if (e < 1 - F::bias) {
        // below the smallest normal: the nearest multiple of the subnormal step 2^(1-bias-mbits)
        // (the scaling is exact; rintf rounds ties to even; 2^mbits steps is the smallest normal)
        const u32 m = (u32)rintf(a * cd_pow2(F::bias + F::mbits - 1));
        return (u8)(sign | m);
    }
    const u32 mant = b & 0x7FFFFFu;
    u32 keep = mant >> (23 - F::mbits);
    const u32 rest = mant & ((1u << (23 - F::mbits)) - 1u), half = 1u << (22 - F::mbits);
    if (rest > half || (rest == half && (keep & 1u))) ++keep;  // a carry into the exponent is right
    u32 code = ((u32)(e + F::bias) << F::mbits) + keep;
    if (code > F::max_code) code = F::max_code;
    return (u8)(sign | code);
}

template <class F>
__device__ __forceinline__ float cd_fp8_decode(u32 c) {
    const u32 sign = (c & 0x80u) << 24;
    const u32 e = (c >> F::mbits) & ((1u << F::ebits) - 1u), m = c & ((1u << F::mbits) - 1u);
    const u32 emax = (1u << F::ebits) - 1u;
    if (F::ebits == 4 && e == emax && m == 7u) return __uint_as_float(0x7FC00000u);
    if (F::ebits == 5 && e == emax) return __uint_as_float(m ? 0x7FC00000u : (sign | 0x7F800000u));
    if (e == 0) {  // subnormal: m steps of 2^(1-bias-mbits)
        const float v = (float)m * cd_pow2(1 - F::bias - F::mbits);
        return sign ? -v : v;
    }
    return __uint_as_float(sign | ((e - F::bias + 127) << 23) | (m << (23 - F::mbits)));
}

// Decoding into the tensor cores' 16-bit types, two codes at a time. Every fp8 value is exact in
// float16 and in bfloat16 (e4m3: 4 significant bits, 2^-9 … 448; e5m2: 3 bits, 2^-16 … 57344 and
// ±inf), so these conversions never round; NaN codes give NaN, e5m2's infinities ±inf.
// ``two``: codes c0 (bits 0–7) and c1 (bits 8–15); the result holds c0's value in its low half.
// FP8_BY_BITS = 1 takes the pre-sm_89 path everywhere (so that the tests run it on any GPU).
#ifndef FP8_BY_BITS
#define FP8_BY_BITS 0
#endif
template <class F>
__device__ __forceinline__ u32 cd_fp8x2_to_f16x2(u32 two) {
    u32 r;
    if (F::ebits == 5) {
        // e5m2 is float16's top byte: c0 << 8 and c1 << 24
        asm("prmt.b32 %0, %1, 0, 0x1404;" : "=r"(r) : "r"(two));
        return r;
    }
#if __CUDA_ARCH__ >= 890 && !FP8_BY_BITS
    asm("{ .reg .b16 c; cvt.u16.u32 c, %1; cvt.rn.f16x2.e4m3x2 %0, c; }" : "=r"(r) : "r"(two));
#else
    // e4m3 by its bits (no conversion instruction before sm_89): in each half, code c as
    // sign << 15 | (c & 0x7F) << 7 is the float16 of value · 2^-8 (subnormals too: float16's
    // exponent bias 15 is e4m3's 7 + 8), then an exact multiply by 2^8; the NaN codes (S.1111.111)
    // would be finite that way, so their halves are set to a NaN.
    u32 h;
    asm("prmt.b32 %0, %1, 0, 0x1404;" : "=r"(h) : "r"(two));  // c0 << 8, c1 << 24
    r = (h & 0x80008000u) | ((h >> 1) & 0x3F803F80u);
    asm("{ .reg .b32 k; mov.b32 k, 0x5C005C00; mul.rn.f16x2 %0, %1, k; }"  // × 256 in both halves
        : "=r"(r) : "r"(r));
    if ((h & 0x7F00u) == 0x7F00u) r |= 0x7FFFu;
    if ((h & 0x7F000000u) == 0x7F000000u) r |= 0x7FFF0000u;
#endif
    return r;
}

// float16 pair → bfloat16 pair (exact for fp8 values: through float32, so ±inf and NaN too)
__device__ __forceinline__ u32 cd_f16x2_to_bf16x2(u32 x) {
    u32 r;
    asm("{ .reg .b16 lo, hi; .reg .f32 a, b; mov.b32 {lo, hi}, %1; cvt.f32.f16 a, lo; "
        "cvt.f32.f16 b, hi; cvt.rn.bf16x2.f32 %0, b, a; }" : "=r"(r) : "r"(x));
    return r;
}

// Four codes (bytes 0–3 of ``four``) → two registers of 16-bit pairs of OUT_ID's type (0
// float16, 1 bfloat16): ``lo`` codes 0 and 1, ``hi`` codes 2 and 3, the lower code in the low half.
template <class F, int OUT_ID>
__device__ __forceinline__ void cd_fp8x4_to_16x2(u32 four, u32& lo, u32& hi) {
    lo = cd_fp8x2_to_f16x2<F>(four & 0xFFFFu);
    hi = cd_fp8x2_to_f16x2<F>(four >> 16);
    if (OUT_ID == 1) {
        lo = cd_f16x2_to_bf16x2(lo);
        hi = cd_f16x2_to_bf16x2(hi);
    }
}
