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
#define CD_POS_INF (__int_as_float(0x7f800000))
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

// Parameter structs declared as X-macro lists of X(kind, C type, name) entries
// (decode_params.cuh) are packed by the host field after field, with no padding.
// A list in falling alignment (pointers, then 8-byte, then 4-byte fields) pads no field: only the
// struct's tail, to its 8-byte alignment, which the host's buffer of whole 8-byte words covers
// (cupydecode/_kernels.py, StructLaunch). static_assert(cd_falling_alignment({LIST(CD_PARAM_ALIGN)}))
// says so at compile time.
#define CD_PARAM_ALIGN(kind, type, name) (int)alignof(type),
template <int N>
__host__ __device__ constexpr bool cd_falling_alignment(const int (&align)[N]) {
    for (int i = 1; i < N; ++i)
        if (align[i] > align[i - 1]) return false;
    return true;
}

// Merge of two softmax states written in the log2 domain (see docs/DESIGN.md; m in log2 units).
// A state is (m, l, acc) with l = Σ 2^(s2_j − m) and acc = Σ 2^(s2_j − m) v_j. The empty state
// is (−inf, 0, 0). Returns the scale each side must be multiplied by after moving to the new
// maximum; never forms −inf − (−inf). With unit = log2 e the maxima are natural log instead (the
// merge's states, below): the difference is taken first, then moved to the log2 domain.
struct cd_rescale { float m; float a; float b; };
__device__ __forceinline__ cd_rescale cd_merge_scales(float m_a, float m_b, float unit = 1.f) {
    cd_rescale r;
    r.m = fmaxf(m_a, m_b);
    const float ref = (r.m == CD_NEG_INF) ? 0.f : r.m;  // both empty: keep 0 · (anything finite)
    r.a = cd_exp2((m_a - ref) * unit);
    r.b = cd_exp2((m_b - ref) * unit);
    return r;
}

// Loads through L2 only (ld.global.cg). The fused merge in decode_split.cu reads partials that
// other SMs wrote during the same launch, so it must not hit a stale L1 line.
__device__ __forceinline__ float cd_ldcg(const float* p) {
    float x;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(x) : "l"(p));
    return x;
}
__device__ __forceinline__ u16 cd_ldcg(const u16* p) {
    u16 x;
    asm volatile("ld.global.cg.u16 %0, [%1];" : "=h"(x) : "l"(p));
    return x;
}

// atomicInc (old >= limit ? 0 : old + 1, returns old) with acquire-release semantics at GPU
// scope: a release for the caller's earlier stores, an acquire for its later loads.
__device__ __forceinline__ unsigned cd_atomic_inc_acq_rel(unsigned* p, unsigned limit) {
    unsigned old;
    asm volatile("atom.acq_rel.gpu.global.inc.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(limit) : "memory");
    return old;
}

// Programmatic dependent launch (Hopper and later; both are no-ops on older GPUs, and for a grid
// launched without the launch attribute). A plan launches its merge kernel with that attribute
// right after the split kernel: the merge grid may then be started, and its blocks made resident,
// once every split block has run cd_launch_dependents — instead of being launched only when the
// split grid has ended — and each merge block waits in cd_wait_prerequisites until the split grid
// has completed and its memory writes are visible, before it reads any partial.
__device__ __forceinline__ void cd_launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void cd_wait_prerequisites() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Kernel 2's math (docs/DESIGN.md, natural-log LSE in and out):
//   LSE = max_i LSE_i + log Σ_i exp(LSE_i − max_i LSE_i),  w_i = exp(LSE_i − LSE),  O = Σ_i w_i Õ_i
// done by warps, each on one PASS of a row: the 32·NV elements [pass·32·NV, +32·NV) of head_dim,
// NV per lane. State i of the row is at o[i·o_stride .. + head_dim) and lse[i·lse_stride]. Empty
// states (LSE_i = −inf) get weight exactly 0 and their Õ_i is never multiplied in (it may hold
// NaN); all empty gives O = 0, LSE = −inf.
// Latency, not bytes, is what this costs (it ends every split decode). States are taken in groups
// of CD_MERGE_GROUP: every lane loads the group's LSEs (one broadcast load each) together with its
// NV elements of each Õ_i, so a group is ONE trip to L2, folded into a running (max, sum, acc) in
// the log2 domain. A warp's trips are serial; more groups than one are spread over several warps
// (merge_states.cu), whose running states are then combined with cd_merge_combine.
// The running maximum m stays in natural-log units and each exponent is formed as (x − m) · log2 e:
// the difference first, so an LSE of any size loses nothing (x · log2 e first would round 1e4 to
// ±5e-4, a weight off by 3e-4). That is the same one add and one multiply per state.
// Used by merge_states.cu and by the fused merge at the end of decode_split.cu.
#define CD_MERGE_GROUP 16
template <int NV>
struct cd_merge_state {  // running state of one lane: m natural log, sum = Σ e^(x_i − m)
    float m, sum, acc[NV];
    __device__ __forceinline__ void clear() {
        m = CD_NEG_INF; sum = 0.f;
#pragma unroll
        for (int e = 0; e < NV; ++e) acc[e] = 0.f;
    }
};

// NV consecutive elements at p, through L2 only (cd_ldcg), as floats: one vector load where NV
// elements make a 16- or 8-byte vector (p must then be aligned to it: the partials workspace always
// is; merge_states copies a misaligned input first).
template <typename EI, int NV>
__device__ __forceinline__ void cd_ldcg_vec(const typename EI::storage* p, float (&v)[NV]) {
    if constexpr (NV == 4 && sizeof(typename EI::storage) == 4) {
        asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];"
                     : "=f"(v[0]), "=f"(v[1]), "=f"(v[2]), "=f"(v[3]) : "l"(p));
    } else if constexpr (NV == 4 && sizeof(typename EI::storage) == 2) {
        u32 a, b;
        asm volatile("ld.global.cg.v2.u32 {%0, %1}, [%2];" : "=r"(a), "=r"(b) : "l"(p));
        v[0] = EI::to_float((u16)(a & 0xffffu)); v[1] = EI::to_float((u16)(a >> 16));
        v[2] = EI::to_float((u16)(b & 0xffffu)); v[3] = EI::to_float((u16)(b >> 16));
    } else {
#pragma unroll
        for (int e = 0; e < NV; ++e) v[e] = EI::to_float(cd_ldcg(p + e));
    }
}

// Fold groups first_group, first_group + group_step, … of the row's num_states states into st.
// The loads are what the merge waits for, so a group's loads are issued back to back, with no
// branch or arithmetic on loaded values between them: pointers walk from state to state (one
// 64-bit add each, instead of forming (base + j) · stride per state) and stop on the group's last
// state, so the loads past it re-read that state (every address stays in bounds) and are masked
// afterwards; lanes past the end of the row read its start. Each lane's NV elements of a state are
// one vector load. (Measured on the H200: the multiply form took ~1000 instructions per warp to
// issue one group's 80 loads; the performance log, v10.)
template <typename EI, int NV>
__device__ __forceinline__ void cd_merge_fold(const typename EI::storage* __restrict__ o,
                                              long long o_stride,
                                              const float* __restrict__ lse, long long lse_stride,
                                              int num_states, int first_group, int group_step,
                                              int d0, bool mine, cd_merge_state<NV>& st) {
    const long long first = (long long)first_group * CD_MERGE_GROUP;
    const long long step = (long long)group_step * CD_MERGE_GROUP;
    const typename EI::storage* og = o + first * o_stride + (mine ? d0 : 0);  // group's first state
    const float* lg = lse + first * lse_stride;
    for (long long base = first; base < num_states; base += step) {
        const int left = num_states - (int)base;  // states of this group that exist (≥ 1)
        float x[CD_MERGE_GROUP], v[CD_MERGE_GROUP][NV];
        const typename EI::storage* op = og;
        const float* lp = lg;
#pragma unroll
        for (int j = 0; j < CD_MERGE_GROUP; ++j) {
            x[j] = cd_ldcg(lp);
            cd_ldcg_vec<EI, NV>(op, v[j]);
            if (j + 1 < left) {
                op += o_stride;
                lp += lse_stride;
            }
        }
        og += step * o_stride;
        lg += step * lse_stride;
#pragma unroll
        // absent states and +inf (empty, as some libraries mark an empty row) weigh 0; a NaN
        // stays NaN: fmaxf skips it in the maximum, and its weight makes the row NaN
        for (int j = 0; j < CD_MERGE_GROUP; ++j)
            x[j] = j < left && x[j] != CD_POS_INF ? x[j] : CD_NEG_INF;
        float mg = st.m;
#pragma unroll
        for (int j = 0; j < CD_MERGE_GROUP; ++j) mg = fmaxf(mg, x[j]);
        const float ref = (mg == CD_NEG_INF) ? 0.f : mg;  // all empty so far: weights stay 0
        const float a = cd_exp2((st.m - ref) * CD_LOG2E);  // m = −inf (nothing yet): 0
        st.sum *= a;
#pragma unroll
        for (int e = 0; e < NV; ++e) st.acc[e] *= a;
#pragma unroll
        for (int j = 0; j < CD_MERGE_GROUP; ++j) {
            const float w = cd_exp2((x[j] - ref) * CD_LOG2E);  // 0 for empty and absent states
            st.sum += w;
#pragma unroll
            for (int e = 0; e < NV; ++e) st.acc[e] = w != 0.f ? fmaf(w, v[j][e], st.acc[e]) : st.acc[e];  // never 0 · NaN
        }
        st.m = mg;
    }
}

// st ← st ⊕ (m, sum, acc) of another warp's fold of other states of the same elements.
template <int NV>
__device__ __forceinline__ void cd_merge_combine(cd_merge_state<NV>& st, float m, float sum,
                                                 const float* acc) {
    const cd_rescale r = cd_merge_scales(st.m, m, CD_LOG2E);  // both sides' acc are finite sums
    st.m = r.m;
    st.sum = st.sum * r.a + sum * r.b;
#pragma unroll
    for (int e = 0; e < NV; ++e) st.acc[e] = st.acc[e] * r.a + acc[e] * r.b;
}

// A sink (gpt-oss: one logit σ per query head, natural log) joins a finished state once, as a
// key with no value: the denominator gains e^(sink − m) and the output shrinks to match;
// sink = −inf (no sink) leaves the state as it is. An empty state becomes (sink, 1, 0): out 0,
// LSE σ.
template <int NV>
__device__ __forceinline__ void cd_merge_sink(cd_merge_state<NV>& st, float sink) {
    if (sink == CD_NEG_INF) return;
    const cd_rescale r = cd_merge_scales(st.m, sink, CD_LOG2E);
    st.m = r.m;
    st.sum = st.sum * r.a + r.b;
#pragma unroll
    for (int e = 0; e < NV; ++e) st.acc[e] *= r.a;
}

// Write a pass's O elements (and, if lse_dst, the row's LSE from lane 0).
template <typename EO, int NV>
__device__ __forceinline__ void cd_merge_store(const cd_merge_state<NV>& st,
                                               typename EO::storage* __restrict__ dst, int d0,
                                               bool mine, float* __restrict__ lse_dst, int lane) {
    // sum ≥ 1 whenever any state is live, exactly 0 when none is; NaN (a NaN state) stays NaN
    const float inv = st.sum != 0.f ? 1.f / st.sum : 0.f;
    if (mine) {
#pragma unroll
        for (int e = 0; e < NV; ++e) dst[d0 + e] = EO::from_float(st.acc[e] * inv);
    }
    if (lse_dst && lane == 0)
        *lse_dst = st.sum != 0.f ? fmaf(log2f(st.sum), CD_LN2, st.m) : CD_NEG_INF;
}

// One pass of one row by one warp over all its states (every lane runs it: uniform control
// flow; lanes past the end of the row read the row's first elements and skip their stores), then
// the row's sink (natural log, −inf: none). The row's LSE is written by pass 0.
template <typename EI, typename EO, int NV>
__device__ __forceinline__ void cd_merge_row_pass(const typename EI::storage* __restrict__ o,
                                                  long long o_stride,
                                                  const float* __restrict__ lse, long long lse_stride,
                                                  int num_states, int head_dim, int pass,
                                                  typename EO::storage* __restrict__ dst,
                                                  float* __restrict__ lse_dst, int lane,
                                                  float sink) {
    const int d0 = pass * 32 * NV + lane * NV;
    const bool mine = d0 < head_dim;
    cd_merge_state<NV> st;
    st.clear();
    cd_merge_fold<EI, NV>(o, o_stride, lse, lse_stride, num_states, 0, 1, d0, mine, st);
    cd_merge_sink<NV>(st, sink);
    cd_merge_store<EO, NV>(st, dst, d0, mine, pass == 0 ? lse_dst : nullptr, lane);
}
