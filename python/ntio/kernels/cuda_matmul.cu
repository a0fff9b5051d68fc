// Quantized matrix products on CUDA, straight from GGUF blocks (ntio.kernels.cuda_kernels compiles this with NVRTC).
//
//   out[t, n] = scale * sum_k x[t, k] * W[n, k]     t < n_tokens <= MAXT, x float32 [T, x_stride], W [N, K] encoded
//
// One warp per output row, cuda_kernels.WARPS rows a block. A row is cut into chunks of 32 consecutive elements (a
// sub-block of a K-quant or ternary block, a whole legacy block, 32 floats); lane l decodes chunks l, l + 32, ... into
// registers and multiplies each with the T activation rows, which the block stages in shared memory a tile of chunks
// at a time. So every weight byte is read once per product whatever T is. The lanes' sums meet in a shuffle
// reduction. Compiled with --fmad=false, each weight decodes to gguf-py's float32 value exactly; the sums are explicit
// float32 fused multiply-adds in a fixed order, whatever T.

// With n_groups > 0 the same kernel reads column groups (a sparse FFN's down groups in the store's group-major
// copy): group g is its own [N, group_width] matrix at group_ptrs[g] and multiplies x's columns from group_first[g].
// The result is W times x with every other column zeroed.
//
// No headers: float16 is widened by PTX's cvt (exact), bfloat16 by a shift.

typedef unsigned char u8;
typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ float f16_bits(u32 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)h));
    return f;
}

__device__ __forceinline__ float f16_at(const u8* p) { return f16_bits(p[0] | (p[1] << 8)); }

// N little-endian words from p, which blocks of 18, 22, 34, 54, 66 or 210 bytes leave only 2-byte aligned (and a view
// of a float32 matrix may start anywhere): N + 1 aligned loads and funnel shifts in place of 4N byte loads. The
// extra load holds the span's last byte, so it never leaves the buffer; an aligned p skips it.
template <int N>
__device__ __forceinline__ void load_words(const u8* p, u32* out) {
    const u32* base = (const u32*)((unsigned long long)p & ~3ull);
    const u32 shift = 8 * ((unsigned long long)p & 3);
    u32 w[N + 1];
#pragma unroll
    for (int i = 0; i < N; ++i) w[i] = base[i];
    w[N] = shift ? base[N] : 0;
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = __funnelshift_r(w[i], w[i + 1], shift);
}

// Byte j of words w (j known at compile time once loops unroll).
#define BYTE(w, j) (((w)[(j) >> 2] >> (8 * ((j) & 3))) & 0xFFu)

// Each type: BLOCK elements in BYTES bytes; chunk(block, c, v) writes elements 32c .. 32c + 31 of the block to v.

// F32 / F16 / BF16: 32 floats of BITS bits, each widened exactly by Widen::of(its bits).
template <int BITS, class Widen>
struct FloatBits {
    enum { BLOCK = 32, BYTES = 4 * BITS };
    static __device__ __forceinline__ void chunk(const u8* b, int, float* v) {
        u32 w[BITS];
        load_words<BITS>(b, w);
#pragma unroll
        for (int i = 0; i < 32; ++i) v[i] = Widen::of(w[i * BITS / 32] >> (BITS * i % 32));
    }
};

struct WidenF32 {
    static __device__ __forceinline__ float of(u32 bits) { return __uint_as_float(bits); }
};

struct WidenF16 {
    static __device__ __forceinline__ float of(u32 bits) { return f16_bits(bits & 0xFFFF); }
};

struct WidenBF16 {
    static __device__ __forceinline__ float of(u32 bits) { return __uint_as_float(bits << 16); }
};

typedef FloatBits<32, WidenF32> F32;
typedef FloatBits<16, WidenF16> F16;
typedef FloatBits<16, WidenBF16> BF16;

struct Q8_0 {  // d f16, qs 32 x int8:  d * q
    enum { BLOCK = 32, BYTES = 34 };
    static __device__ __forceinline__ void chunk(const u8* b, int, float* v) {
        const float d = f16_at(b);
        u32 w[8];
        load_words<8>(b + 2, w);
#pragma unroll
        for (int i = 0; i < 32; ++i) v[i] = d * (float)(signed char)BYTE(w, i);
    }
};

struct Q4_0 {  // d f16, qs 16 B (element j: low nibble of qs[j], j + 16: its high nibble):  d * (q - 8)
    enum { BLOCK = 32, BYTES = 18 };
    static __device__ __forceinline__ void chunk(const u8* b, int, float* v) {
        const float d = f16_at(b);
        u32 w[4];
        load_words<4>(b + 2, w);
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            v[j] = d * (float)((int)(BYTE(w, j) & 15) - 8);
            v[j + 16] = d * (float)((int)(BYTE(w, j) >> 4) - 8);
        }
    }
};

struct Q4_1 {  // d f16, m f16, qs 16 B (as Q4_0):  d * q + m
    enum { BLOCK = 32, BYTES = 20 };
    static __device__ __forceinline__ void chunk(const u8* b, int, float* v) {
        const float d = f16_at(b), m = f16_at(b + 2);
        u32 w[4];
        load_words<4>(b + 4, w);
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            v[j] = d * (float)(BYTE(w, j) & 15) + m;
            v[j + 16] = d * (float)(BYTE(w, j) >> 4) + m;
        }
    }
};

// Q5_0 / Q5_1 codes from qh (4 B) then qs (16 B): low 4 bits as Q4_0, bit 4 of element j is bit j of the
// little-endian u32 qh.
__device__ __forceinline__ void q5_codes(const u8* qh_at, float* v) {
    u32 w[5];
    load_words<5>(qh_at, w);
    const u32 qh = w[0];
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        v[j] = (float)((BYTE(w, 4 + j) & 15) | (((qh >> j) & 1) << 4));
        v[j + 16] = (float)((BYTE(w, 4 + j) >> 4) | (((qh >> (j + 16)) & 1) << 4));
    }
}

struct Q5_0 {  // d f16, qh 4 B, qs 16 B:  d * (q - 16)
    enum { BLOCK = 32, BYTES = 22 };
    static __device__ __forceinline__ void chunk(const u8* b, int, float* v) {
        const float d = f16_at(b);
        q5_codes(b + 2, v);
#pragma unroll
        for (int i = 0; i < 32; ++i) v[i] = d * (v[i] - 16.0f);
    }
};

struct Q5_1 {  // d f16, m f16, qh 4 B, qs 16 B:  d * q + m
    enum { BLOCK = 32, BYTES = 24 };
    static __device__ __forceinline__ void chunk(const u8* b, int, float* v) {
        const float d = f16_at(b), m = f16_at(b + 2);
        q5_codes(b + 4, v);
#pragma unroll
        for (int i = 0; i < 32; ++i) v[i] = d * v[i] + m;
    }
};

// Q4_K / Q5_K: d f16, dmin f16, 12 B of 6-bit (scale, min) pairs for 8 sub-blocks; sub-block s's codes are the low
// (s even) or high (s odd) nibbles of qs[32 (s / 2) ..], Q5_K's bit 4 is bit s of qh[j].  (d sc) q - (dmin m)
__device__ __forceinline__ void k_scale_min(const u8* b, int s, float* dl, float* ml) {
    const u8* scales = b + 4;
    int sc, m;
    if (s < 4) {
        sc = scales[s] & 63;
        m = scales[s + 4] & 63;
    } else {
        sc = (scales[s + 4] & 15) | ((scales[s - 4] >> 6) << 4);
        m = (scales[s + 4] >> 4) | ((scales[s] >> 6) << 4);
    }
    *dl = f16_at(b) * (float)sc;
    *ml = f16_at(b + 2) * (float)m;
}

struct Q4_K {
    enum { BLOCK = 256, BYTES = 144 };
    static __device__ __forceinline__ void chunk(const u8* b, int s, float* v) {
        float dl, ml;
        k_scale_min(b, s, &dl, &ml);
        u32 qs[8];
        load_words<8>(b + 16 + 32 * (s >> 1), qs);
        const int shift = 4 * (s & 1);
#pragma unroll
        for (int j = 0; j < 32; ++j) v[j] = dl * (float)((BYTE(qs, j) >> shift) & 15) - ml;
    }
};

struct Q5_K {
    enum { BLOCK = 256, BYTES = 176 };
    static __device__ __forceinline__ void chunk(const u8* b, int s, float* v) {
        float dl, ml;
        k_scale_min(b, s, &dl, &ml);
        u32 qh[8], qs[8];
        load_words<8>(b + 16, qh);
        load_words<8>(b + 48 + 32 * (s >> 1), qs);
        const int shift = 4 * (s & 1);
#pragma unroll
        for (int j = 0; j < 32; ++j)
            v[j] = dl * (float)(((BYTE(qs, j) >> shift) & 15) | (((BYTE(qh, j) >> s) & 1) << 4)) - ml;
    }
};

// Q6_K: ql 128 B, qh 64 B, 16 int8 scales, d f16 at 208. Chunk c is quarter u = c % 4 of half h = c / 4: element j
// has low bits nibble u / 2 of ql[64h + 32 (u % 2) + j], bits 4-5 (qh[32h + j] >> 2u) & 3, scale scales[8h + 2u
// + j / 16].  (d scale) (q - 32)
struct Q6_K {
    enum { BLOCK = 256, BYTES = 210 };
    static __device__ __forceinline__ void chunk(const u8* b, int c, float* v) {
        const int h = c >> 2, u = c & 3;
        u32 ql[8], qh[8];
        load_words<8>(b + 64 * h + 32 * (u & 1), ql);
        load_words<8>(b + 128 + 32 * h, qh);
        const signed char* sc = (const signed char*)(b + 192) + 8 * h + 2 * u;
        const float d = f16_at(b + 208);
        const float d0 = d * (float)sc[0], d1 = d * (float)sc[1];
        const int shift = 4 * (u >> 1);
#pragma unroll
        for (int j = 0; j < 32; ++j) {
            const int q = ((BYTE(ql, j) >> shift) & 15) | (((BYTE(qh, j) >> (2 * u)) & 3) << 4);
            v[j] = (j < 16 ? d0 : d1) * (float)(q - 32);
        }
    }
};

// TQ2_0: qs 64 B, d f16 at 64. Element 32l + j of half h is bits 2l..2l+1 of qs[32h + j].  d (q - 1)
struct TQ2_0 {
    enum { BLOCK = 256, BYTES = 66 };
    static __device__ __forceinline__ void chunk(const u8* b, int c, float* v) {
        u32 qs[8];
        load_words<8>(b + 32 * (c >> 2), qs);
        const int shift = 2 * (c & 3);
        const float d = f16_at(b + 64);
#pragma unroll
        for (int j = 0; j < 32; ++j) v[j] = d * (float)((int)((BYTE(qs, j) >> shift) & 3) - 1);
    }
};

// TQ1_0: qs 48 B (5 trits a byte), qh 4 B (4 trits a byte), d f16 at 52. Element 32n + j (n < 5) is trit n of qs[j];
// 160 + 16n + j trit n of qs[32 + j]; 240 + 4n + j trit n of qh[j] (= byte 48 + j). Trit n of a byte is
// ((byte 3^n mod 256) 3) >> 8.  d (q - 1)
__device__ __forceinline__ int trit(u32 byte, int n) {
    const u32 pow3 = (u32)((0x511B090301ull >> (8 * n)) & 0xFF);  // 3^n for n < 5, one byte each
    return (int)((((byte * pow3) & 0xFF) * 3) >> 8);
}

struct TQ1_0 {
    enum { BLOCK = 256, BYTES = 54 };
    static __device__ __forceinline__ void chunk(const u8* b, int c, float* v) {
        const float d = f16_at(b + 52);
        if (c < 5) {  // elements 32c + j: trit c of qs[j]
            u32 w[8];
            load_words<8>(b, w);
#pragma unroll
            for (int j = 0; j < 32; ++j) v[j] = d * (float)(trit(BYTE(w, j), c) - 1);
            return;
        }
        u32 w[5];  // bytes 32..51: the last 16 of qs, then qh
        load_words<5>(b + 32, w);
        if (c < 7) {  // elements 160 + 32 (c - 5) + j: trit 2 (c - 5) + j / 16 of qs[32 + j % 16]
#pragma unroll
            for (int j = 0; j < 32; ++j) v[j] = d * (float)(trit(BYTE(w, j % 16), 2 * (c - 5) + j / 16) - 1);
            return;
        }
#pragma unroll
        for (int j = 0; j < 16; ++j) v[j] = d * (float)(trit(BYTE(w, j), 4) - 1);  // 224 + j: trit 4 of qs[32 + j]
#pragma unroll
        for (int j = 0; j < 16; ++j) v[16 + j] = d * (float)(trit(BYTE(w, 16 + j % 4), j / 4) - 1);  // 240 + j
    }
};

// The activation tile a block shares: TILE_CHUNKS chunks (one a lane) of every token's x, in shared memory, each chunk
// padded to PADDED floats so that the lanes' float4 loads of their chunks fall in distinct banks (read from global
// memory, lane l's chunk is 128 bytes from lane l + 1's: a load instruction then touched 32 cache lines; staging cut
// a one-token Q4_K 14336 x 4096 product on an H200 from 153 to 36-50 us). Tiles of 128 chunks (4 a lane between
// two barriers) measured no faster at T = 1, 8 or 16.
#define TILE_CHUNKS 32
#define PADDED 36
#define TILE_FLOATS (TILE_CHUNKS * PADDED)

// The x column where chunk c of a row starts: 32c, or with column groups, in group c / per_group from its first.
__device__ __forceinline__ int chunk_column(int c, const int* group_first, int n_groups, int per_group) {
    return n_groups > 0 ? group_first[c / per_group] + 32 * (c % per_group) : 32 * c;
}

// out[t * out_stride + n] for rows n of W; x rows are x_stride floats apart (16-byte aligned, as chunk columns).
// Dynamic shared memory: n_tokens * TILE_FLOATS floats.
template <class Q, int MAXT>
__global__ void quantized_matmul(const u8* __restrict__ w, long long row_bytes, int n_rows, int k,
                                 const float* __restrict__ x, long long x_stride, int n_tokens,
                                 float* __restrict__ out, long long out_stride, float scale,
                                 const u64* __restrict__ group_ptrs, const int* __restrict__ group_first,
                                 int n_groups, int group_width) {
    extern __shared__ float4 tile4[];
    float* tile = (float*)tile4;
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int subs = Q::BLOCK / 32;
    const int per_group = group_width / 32;
    const long long group_row_bytes = (long long)(group_width / Q::BLOCK) * Q::BYTES;
    const int chunks = n_groups > 0 ? n_groups * per_group : k / 32;
    float acc[MAXT];
#pragma unroll
    for (int t = 0; t < MAXT; ++t) acc[t] = 0.0f;
    for (int base = 0; base < chunks; base += TILE_CHUNKS) {
        __syncthreads();  // the last tile's reads are done
        for (int i = threadIdx.x; i < n_tokens * TILE_CHUNKS * 8; i += blockDim.x) {  // float4s, coalesced
            const int t = i / (TILE_CHUNKS * 8), c = (i / 8) % TILE_CHUNKS, q = i % 8;
            float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (base + c < chunks) {
                const int col = chunk_column(base + c, group_first, n_groups, per_group);
                v = *(const float4*)(x + t * x_stride + col + 4 * q);
            }
            *(float4*)(tile + t * TILE_FLOATS + c * PADDED + 4 * q) = v;
        }
        __syncthreads();
        const int c = base + lane;
        if (row >= n_rows || c >= chunks) continue;
        const u8* block;
        int sub;
        if (n_groups > 0) {
            const int within = c % per_group;
            block = (const u8*)group_ptrs[c / per_group] + row * group_row_bytes + (long long)(within / subs) * Q::BYTES;
            sub = within % subs;
        } else {
            block = w + row * row_bytes + (long long)(c / subs) * Q::BYTES;
            sub = c % subs;
        }
        float v[32];
        Q::chunk(block, sub, v);
#pragma unroll
        for (int t = 0; t < MAXT; ++t) {
            if (t < n_tokens) {
                const float4* xr = (const float4*)(tile + t * TILE_FLOATS + lane * PADDED);
                float s = 0.0f;
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    const float4 xv = xr[i];
                    s = fmaf(v[4 * i], xv.x, s);
                    s = fmaf(v[4 * i + 1], xv.y, s);
                    s = fmaf(v[4 * i + 2], xv.z, s);
                    s = fmaf(v[4 * i + 3], xv.w, s);
                }
                acc[t] += s;
            }
        }
    }
    if (row >= n_rows) return;
#pragma unroll
    for (int t = 0; t < MAXT; ++t) {
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) acc[t] += __shfl_xor_sync(0xffffffffu, acc[t], offset);
    }
    if (lane == 0) {
#pragma unroll
        for (int t = 0; t < MAXT; ++t) {
            if (t < n_tokens) out[t * out_stride + row] = scale * acc[t];
        }
    }
}
