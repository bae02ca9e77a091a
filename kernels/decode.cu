// Decode kernels over the flat per-layer K/V views of the step API (procmem::kv::KvView):
// `tokens` rows, position-major, each row `kv_heads` heads of `head_dim` elements, `f32`,
// `f16` or `q8_0` (blocks of 32 values: an f16 scale `d`, little-endian, then 32 signed bytes
// `q`; a value is `q * d`; a head is whole blocks; `q8_0` rows may come in page-sized
// groups, see Q8Kv). Compiled to PTX by scripts/gen-ptx.py with NVRTC (no CUDA toolkit needed to build);
// the PTX is checked in (kernels/decode.ptx) and loaded with cuModuleLoadData, so the driver
// compiles it for whatever GPU it finds. No headers: f16 conversions are single PTX `cvt`s.
//
// Split-KV decode, as flash-decoding:
//   gqa_split_<k>_<v> (each of f32, f16, q8_0 for K and for V): grid (splits, kv_heads), block 32 * group threads. Each warp is one
//     query head of the KV head's group; the group's warps read the same K/V rows (one read
//     from memory, the rest from cache). Each warp keeps an online softmax over its split
//     (running max, running sum, weighted values), TILE tokens at a time, and writes it as a
//     partial:
//     partials[(split * q_heads + h) * (head_dim + 2) + {0: max, 1: sum, 2..: values}].
//   gqa_merge: grid q_heads, block up to head_dim threads: merges the splits in order.
//   kv_write_{f32,f16}: writes one token's row (`n` elements, from f32) at `dst`.
//   kv_write_q8_0: quantizes a row (`n` a multiple of 32) one warp a block: the scale is the
//     block's largest magnitude over 127, each value the nearest step (halves away from zero),
//     as the host's row write does.

typedef unsigned short half_bits;

#define MAX_PER_LANE 8  // head_dim <= 256
#define TILE 8          // tokens a warp works on at once
#define NEG_INF (-__int_as_float(0x7f800000))

__device__ __forceinline__ float load_elem(const float* p) { return *p; }

__device__ __forceinline__ float load_elem(const half_bits* p) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(*p));
    return f;
}

__device__ __forceinline__ float half_to_float(half_bits h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// Readers of KV value `i` (counted in values from the view's first row), one per type.
// `f32` and `f16` rows are dense; `q8_0` rows may come in groups (a group's rows one after
// the other, groups `group_bytes` apart: SmolLM2's 204-byte rows 20 to a 4 KiB page), so its
// reader finds a value's row first. Each is made from the view's address, the values in a
// row, and the rows' grouping.
struct F32Kv {
    const float* p;
    __device__ static F32Kv make(const float* p, unsigned long long, unsigned long long,
                                 unsigned long long) {
        return F32Kv{p};
    }
    __device__ __forceinline__ float at(unsigned long long i) const { return p[i]; }
};

struct F16Kv {
    const half_bits* p;
    __device__ static F16Kv make(const half_bits* p, unsigned long long, unsigned long long,
                                 unsigned long long) {
        return F16Kv{p};
    }
    __device__ __forceinline__ float at(unsigned long long i) const { return load_elem(p + i); }
};

struct Q8Kv {
    const unsigned char* p;
    unsigned long long stride;       // values in a row
    unsigned long long row_bytes;    // bytes of a row: stride / 32 blocks of 34
    unsigned long long group_rows;   // rows in a group
    unsigned long long group_bytes;  // bytes from one group to the next
    __device__ static Q8Kv make(const unsigned char* p, unsigned long long stride,
                                unsigned long long group_rows, unsigned long long group_bytes) {
        return Q8Kv{p, stride, stride / 32 * 34, group_rows, group_bytes};
    }
    __device__ __forceinline__ float at(unsigned long long i) const {
        const unsigned long long row = i / stride;
        const unsigned long long w = i - row * stride;
        const unsigned char* b = p + (row / group_rows) * group_bytes +
                                 (row % group_rows) * row_bytes + (w / 32) * 34;
        const half_bits d = (half_bits)(b[0] | (b[1] << 8));
        return (float)(signed char)b[2 + w % 32] * half_to_float(d);
    }
};

__device__ __forceinline__ void store_elem(float* p, float x) { *p = x; }

__device__ __forceinline__ void store_elem(half_bits* p, float x) {
    half_bits h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    *p = h;
}

template <typename RK, typename RV>
__device__ __forceinline__ void split_partial(
    const float* q, RK k, RV v, unsigned tokens, unsigned split_tokens,
    unsigned q_heads, unsigned kv_heads, unsigned head_dim, float scale, float* partials) {
    const unsigned split = blockIdx.x;
    const unsigned g = blockIdx.y;
    const unsigned warp = threadIdx.x / 32;
    const unsigned lane = threadIdx.x % 32;
    const unsigned group = q_heads / kv_heads;
    if (warp >= group) return;
    const unsigned h = g * group + warp;
    const unsigned long long stride = (unsigned long long)kv_heads * head_dim;

    float qr[MAX_PER_LANE];
    float acc[MAX_PER_LANE];
#pragma unroll
    for (unsigned i = 0; i < MAX_PER_LANE; ++i) {
        const unsigned d = lane + 32 * i;
        qr[i] = d < head_dim ? q[h * head_dim + d] : 0.0f;
        acc[i] = 0.0f;
    }
    float m = NEG_INF;
    float l = 0.0f;
    const unsigned first = split * split_tokens;
    const unsigned last = min(first + split_tokens, tokens);
    // TILE tokens at a time: their K rows are loaded together, their dot products reduced
    // together, and their V rows loaded together, so each warp has TILE rows in flight
    // instead of one (one token at a time left the kernel waiting on memory latency).
    for (unsigned t0 = first; t0 < last; t0 += TILE) {
        float s[TILE];
#pragma unroll
        for (unsigned j = 0; j < TILE; ++j) {
            s[j] = 0.0f;
            if (t0 + j < last) {
                const unsigned long long kr = (t0 + j) * stride + g * head_dim;
#pragma unroll
                for (unsigned i = 0; i < MAX_PER_LANE; ++i) {
                    const unsigned d = lane + 32 * i;
                    if (d < head_dim) s[j] = fmaf(qr[i], k.at(kr + d), s[j]);
                }
            }
        }
#pragma unroll
        for (int off = 16; off > 0; off /= 2) {
#pragma unroll
            for (unsigned j = 0; j < TILE; ++j) s[j] += __shfl_xor_sync(0xffffffffu, s[j], off);
        }
        float m_new = m;
#pragma unroll
        for (unsigned j = 0; j < TILE; ++j) {
            s[j] *= scale;
            if (t0 + j < last) m_new = fmaxf(m_new, s[j]);
        }
        const float correction = __expf(m - m_new);
        float p[TILE];
        float p_sum = 0.0f;
#pragma unroll
        for (unsigned j = 0; j < TILE; ++j) {
            p[j] = t0 + j < last ? __expf(s[j] - m_new) : 0.0f;
            p_sum += p[j];
        }
        l = l * correction + p_sum;
#pragma unroll
        for (unsigned i = 0; i < MAX_PER_LANE; ++i) {
            const unsigned d = lane + 32 * i;
            if (d < head_dim) {
                float a = acc[i] * correction;
#pragma unroll
                for (unsigned j = 0; j < TILE; ++j) {
                    if (t0 + j < last) {
                        a = fmaf(p[j], v.at((t0 + j) * stride + g * head_dim + d), a);
                    }
                }
                acc[i] = a;
            }
        }
        m = m_new;
    }
    float* out = partials + ((unsigned long long)split * q_heads + h) * (head_dim + 2);
    if (lane == 0) {
        out[0] = m;
        out[1] = l;
    }
#pragma unroll
    for (unsigned i = 0; i < MAX_PER_LANE; ++i) {
        const unsigned d = lane + 32 * i;
        if (d < head_dim) out[2 + d] = acc[i];
    }
}

// Up to 32 query heads per KV head: blocks of up to 1024 threads must fit the registers.
// One kernel per pair of K and V types: gqa_split_<k>_<v>.
#define GQA_SPLIT(KN, KR, KT, VN, VR, VT)                                                       \
    extern "C" __global__ void __launch_bounds__(1024) gqa_split_##KN##_##VN(                  \
        const float* q, const KT* k, const VT* v, unsigned tokens, unsigned split_tokens,      \
        unsigned q_heads, unsigned kv_heads, unsigned head_dim, float scale, float* partials,  \
        unsigned long long k_group_rows, unsigned long long k_group_bytes,                     \
        unsigned long long v_group_rows, unsigned long long v_group_bytes) {                   \
        const unsigned long long stride = (unsigned long long)kv_heads * head_dim;             \
        split_partial<KR, VR>(q, KR::make(k, stride, k_group_rows, k_group_bytes),             \
                              VR::make(v, stride, v_group_rows, v_group_bytes), tokens,        \
                              split_tokens, q_heads, kv_heads, head_dim, scale, partials);     \
    }
#define GQA_SPLIT_V(KN, KR, KT)                     \
    GQA_SPLIT(KN, KR, KT, f32, F32Kv, float)        \
    GQA_SPLIT(KN, KR, KT, f16, F16Kv, half_bits)    \
    GQA_SPLIT(KN, KR, KT, q8_0, Q8Kv, unsigned char)
GQA_SPLIT_V(f32, F32Kv, float)
GQA_SPLIT_V(f16, F16Kv, half_bits)
GQA_SPLIT_V(q8_0, Q8Kv, unsigned char)

extern "C" __global__ void gqa_merge(
    const float* partials, unsigned splits, unsigned q_heads, unsigned head_dim, float* out) {
    const unsigned h = blockIdx.x;
    const unsigned long long width = head_dim + 2;
    for (unsigned d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float big = NEG_INF;
        for (unsigned s = 0; s < splits; ++s) {
            big = fmaxf(big, partials[(s * q_heads + h) * width]);
        }
        float sum = 0.0f;
        float o = 0.0f;
        for (unsigned s = 0; s < splits; ++s) {
            const float* p = partials + (s * q_heads + h) * width;
            const float w = __expf(p[0] - big);
            sum = fmaf(w, p[1], sum);
            o = fmaf(w, p[2 + d], o);
        }
        out[h * head_dim + d] = o / sum;
    }
}

template <typename T>
__device__ __forceinline__ void write_row(T* dst, const float* src, unsigned n) {
    const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) store_elem(dst + i, src[i]);
}

extern "C" __global__ void kv_write_f32(float* dst, const float* src, unsigned n) {
    write_row<float>(dst, src, n);
}

extern "C" __global__ void kv_write_f16(half_bits* dst, const float* src, unsigned n) {
    write_row<half_bits>(dst, src, n);
}

// One warp a block of 32 values; `n` is a multiple of 32 (the launch checks it).
extern "C" __global__ void kv_write_q8_0(unsigned char* dst, const float* src, unsigned n) {
    const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned lane = threadIdx.x % 32;
    // Whole warps run past `n` together: the shuffles need every lane of the warp.
    if (i - lane >= n) return;
    const float x = src[i];
    float amax = fabsf(x);
#pragma unroll
    for (int off = 16; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    const float d = __fdiv_rn(amax, 127.0f);
    const float inv = d > 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
    unsigned char* block = dst + (unsigned long long)(i / 32) * 34;
    if (lane == 0) {
        half_bits h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(d));
        block[0] = (unsigned char)(h & 0xff);
        block[1] = (unsigned char)(h >> 8);
    }
    const float r = fminf(fmaxf(roundf(__fmul_rn(x, inv)), -127.0f), 127.0f);
    block[2 + lane] = (unsigned char)(signed char)(int)r;
}
