/* pagedkv fast CPU cache write: encode K/V rows and write them straight into their pool slots.
 *
 * One entry point (pkv_store) for one side (K or V) of a layer. The codec is described by its
 * properties (store kind, code bits, group, scale kind, sorted value table), not by its name, and
 * every rule is the reference encoder's (pagedkv/codecs/reference.py), computed in the same fp32
 * operations in the same order, so the bytes written equal the reference store's:
 *   SK_BF16         bf16 round-to-nearest-even;
 *   SK_F16          IEEE half round-to-nearest-even of x clamped to +-65504 (f16);
 *   SK_E4M3_TENSOR  E4M3 of x / tensor_scale, saturating at +-448 (fp8);
 *   SK_E5M2_TENSOR  E5M2 of x / tensor_scale, saturating at +-57344 (fp8_e5m2);
 *   SK_E4M3_GROUP   half scale = half(amax / top), codes E4M3 of x / scale (turbo8);
 *   SK_INT8         half d = half(amax / top), q = rint(x / d) clamped to +-top (q8_0);
 *   SK_INT_SIGNED   m = first element of largest |x|, half d = half(m / -lo),
 *                   u = floor(x / d + lo + 0.5) clamped to [0, 2^bits - 1] (q4_0, any width);
 *   SK_TABLE        E4M3 group scale searched over 10 candidates around amax / top (least squared
 *                   error of the group, ties keep the smaller scale), each element the nearest
 *                   level (ties go down) (nvfp4, turbo2/3/4/5, turbo2g64: up to 32 levels, any
 *                   group that is a multiple of 8 up to 64).
 * Codes of any width 1..8 are packed as one LSB-first bit stream along head_dim (packing.py).
 * The squared error of a group is summed in the order of torch's CPU sum over a contiguous row of
 * G floats (`group_sum`: torch's vector width, 4 accumulators), so the scale choice is the
 * reference's even at exact ties.
 *
 * SK_TABLE works on tiles of 16 groups held transposed (tile[element][group]): every candidate,
 * division, level search and error sum is then a plain loop over 16 lanes (one AVX-512 vector
 * or two AVX2 ones; the level search is a binary search through vpermps (AVX-512: vpermt2ps
 * for 32 levels), with AVX2 a count of the midpoints below the value up to 16 levels and a binary
 * search over 32, otherwise a compare chain). The AVX2 path took the C part of a turbo3 store from 86 ns to 14 ns of CPU per value
 * (turbo4 167 -> 19, nvfp4 133 -> 20): the compiler had left the chain scalar. Nothing is
 * allocated: the tile and the row buffer live on the stack.
 *
 * Input rows: float32, bfloat16 or float16 (converted exactly), optional centre [H, D] subtracted
 * in fp32 (keys), rows with a negative slot skipped. Every kept value is checked finite before
 * anything is written (the reference raises on NaN/Inf before its write).
 */

/* d = x - level * scale must round twice, as torch does: no FMA contraction (GCC's ISO C mode
 * -std=c11 already contracts nothing; clang needs the pragma) */
#ifdef __clang__
#pragma STDC FP_CONTRACT OFF
#endif

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PKV_STORE_AVX512 1
#define PKV_STORE_SIMD 1
#include <immintrin.h>
#elif defined(__AVX2__)
#define PKV_STORE_AVX2 1
#define PKV_STORE_SIMD 1
#include <immintrin.h>
#endif

enum { SK_BF16 = 0, SK_E4M3_TENSOR = 1, SK_E4M3_GROUP = 2, SK_INT8 = 3, SK_INT_SIGNED = 4, SK_TABLE = 5,
       SK_F16 = 6, SK_E5M2_TENSOR = 7 };
enum { SS_NONE = 0, SS_E4M3 = 1, SS_BF16 = 2, SS_FP16 = 3 };
enum { XT_F32 = 0, XT_BF16 = 1, XT_F16 = 2 };
enum { PKV_STORE_OK = 0, PKV_STORE_NONFINITE = 1, PKV_STORE_BAD_ARGS = 2, PKV_STORE_BAD_WIDTH = 3 };

#if defined(__GNUC__) || defined(__clang__)
#define PKV_ALWAYS_INLINE static inline __attribute__((always_inline))
#else
#define PKV_ALWAYS_INLINE static inline
#endif

#define MAX_HEAD_DIM 4096
#define TL 16 /* groups per tile (lanes) */
#define MAX_GROUP 64 /* elements per group (a multiple of 8) */
#define MAX_LEVELS 32 /* levels of a table codec (5-bit codes) */

typedef struct {
    const void *x;          /* [T, H, D] rows, element strides below (last dim contiguous) */
    const float *centre;    /* [H, D] subtracted first, or NULL */
    const int64_t *slots;   /* [T], negative = skip */
    uint8_t *pool;          /* [num_blocks, block_stride] bytes */
    const float *levels;    /* SK_TABLE: ascending levels [num_levels] */
    const float *mids;      /* SK_TABLE: (levels[i] + levels[i+1]) / 2, [num_levels - 1] */
    const uint8_t *order;   /* SK_TABLE: code of each ascending level [num_levels] */
    int64_t x_stride_t, x_stride_h, num_tokens, block_stride, scale_offset;
    int32_t x_dtype, block_size, num_heads, head_dim;
    int32_t kind, bits, group, scale_kind;
    int32_t row_data_bytes, row_scale_bytes, num_levels;
    int32_t sum_lanes;      /* SK_TABLE: lanes of torch's CPU float vectors (group_sum) */
    float top;              /* SK_TABLE / E4M3_GROUP / INT8: max |level|; SK_INT_SIGNED: -min level */
    float tensor_scale;     /* SK_E4M3_TENSOR / SK_E5M2_TENSOR */
} pkv_store_args;

/* ---- bit helpers (exact conversions, the rules of c10 / torch) ---------------------------- */

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline float f16_to_f32(uint16_t h) {
    const uint32_t w = (uint32_t)h << 16, sign = w & 0x80000000u, two_w = w + w;
    const float normalized = u2f((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float denormalized = u2f((two_w >> 17) | (126u << 23)) - 0.5f;
    return u2f(sign | (two_w < (1u << 27) ? f2u(denormalized) : f2u(normalized)));
}

static inline uint16_t f32_to_f16(float f) { /* round to nearest even, overflow -> inf */
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = f2u(f), shl1_w = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = u2f((bias >> 1) + 0x07800000u) + base;
    const uint32_t b = f2u(base);
    const uint32_t nonsign = ((b >> 13) & 0x7C00u) + (b & 0x0FFFu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even (inputs are finite) */
    const uint32_t u = f2u(f);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline float bf16_to_f32(uint16_t h) { return u2f((uint32_t)h << 16); }

/* E4M3 (fn) byte of f, round to nearest even; |f| must be <= 448 (callers clamp first). */
static inline uint8_t f32_to_e4m3(float f) {
    uint32_t b = f2u(f);
    const uint32_t sign = b & 0x80000000u;
    b ^= sign;
    const uint32_t den = f2u(u2f(b) + u2f(141u << 23)) - (141u << 23);
    const uint32_t nrm = (b + ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + ((b >> 20) & 1u)) >> 20;
    const uint32_t r = b < (121u << 23) ? den : nrm;
    return (uint8_t)(r | (sign >> 24));
}

/* E5M2 byte of f, round to nearest even (c10's rule); |f| must be <= 57344 (callers clamp first). */
static inline uint8_t f32_to_e5m2(float f) {
    uint32_t b = f2u(f);
    const uint32_t sign = b & 0x80000000u;
    b ^= sign;
    uint32_t r;
    if (b < (113u << 23)) { /* below the smallest normal (2^-14): add 2^7 and keep the low bits */
        r = f2u(u2f(b) + u2f(134u << 23)) - (134u << 23);
    } else {
        r = (b + ((uint32_t)(15 - 127) << 23) + 0xFFFFFu + ((b >> 21) & 1u)) >> 21;
    }
    return (uint8_t)(r | (sign >> 24));
}

/* max of two non-NaN floats (fmaxf is a libm call when NaN semantics must hold) */
static inline float max_f(float a, float b) { return a > b ? a : b; }

static inline float clamp448(float v) { return v < -448.0f ? -448.0f : (v > 448.0f ? 448.0f : v); }

/* E4M3 bytes of clamp448(x[i] / s), i < n: the rule of f32_to_e4m3, 16 lanes at a time. */
static inline void e4m3_div_array(const float *x, float s, uint8_t *out, int n) {
    int i = 0;
#ifdef PKV_STORE_AVX512
    const __m512 vs = _mm512_set1_ps(s), lo = _mm512_set1_ps(-448.0f), hi = _mm512_set1_ps(448.0f);
    const __m512i sign_bit = _mm512_set1_epi32((int)0x80000000u), one = _mm512_set1_epi32(1);
    const __m512i den_bits = _mm512_set1_epi32((int)(141u << 23)), small = _mm512_set1_epi32((int)(121u << 23));
    const __m512i bias = _mm512_set1_epi32((int)(((uint32_t)(7 - 127) << 23) + 0x7FFFFu));
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_div_ps(_mm512_loadu_ps(x + i), vs);
        v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
        const __m512i raw = _mm512_castps_si512(v);
        const __m512i sign = _mm512_and_si512(raw, sign_bit);
        const __m512i b = _mm512_xor_si512(raw, sign);
        const __m512i den = _mm512_sub_epi32(
            _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(b), _mm512_castsi512_ps(den_bits))), den_bits);
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 20), one);
        const __m512i nrm = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, bias), odd), 20);
        __m512i r = _mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(b, small), nrm, den);
        r = _mm512_or_si512(r, _mm512_srli_epi32(sign, 24));
        _mm_storeu_si128((__m128i *)(out + i), _mm512_cvtepi32_epi8(r));
    }
#endif
    for (; i < n; i++) out[i] = f32_to_e4m3(clamp448(x[i] / s));
}

/* Value of a positive E4M3 byte c in 1..126. */
static inline float e4m3_pos_value(uint32_t c) {
    const uint32_t e = c >> 3, m = c & 7u;
    return e ? u2f(((e + 120u) << 23) | (m << 20)) : (float)m * 0x1.0p-9f;
}

/* half (bf16 / fp16) bits of v and its value */
static inline uint16_t half_round(float v, int scale_kind, float *value) {
    if (scale_kind == SS_BF16) {
        const uint16_t h = f32_to_bf16(v);
        *value = bf16_to_f32(h);
        return h;
    }
    const uint16_t h = f32_to_f16(v);
    *value = f16_to_f32(h);
    return h;
}

static inline void put_u16(uint8_t *dst, uint16_t v) { dst[0] = (uint8_t)v; dst[1] = (uint8_t)(v >> 8); }

/* Pack n codes (n a multiple of 8, each < 2^bits, bits 1..8) as one LSB-first bit stream: every
   8 codes fill `bits` bytes (the catalogue's order, packing.py). */
PKV_ALWAYS_INLINE void pack_bits(uint8_t *dst, const uint8_t *c, int n, const int bits) {
    for (int i = 0; i < n / 8; i++) {
        uint64_t w = 0;
        for (int j = 0; j < 8; j++) w |= (uint64_t)c[8 * i + j] << (bits * j);
        for (int b = 0; b < bits; b++) dst[bits * i + b] = (uint8_t)(w >> (8 * b));
    }
}

PKV_ALWAYS_INLINE void pack_codes(uint8_t *dst, const uint8_t *c, int n, int bits) {
    switch (bits) { /* constant widths: the shifts unroll */
    case 8: memcpy(dst, c, (size_t)n); break;
    case 4: pack_bits(dst, c, n, 4); break;
    case 3: pack_bits(dst, c, n, 3); break;
    case 2: pack_bits(dst, c, n, 2); break;
    default: pack_bits(dst, c, n, bits); break;
    }
}

/* ---- input rows ---------------------------------------------------------------------------- */

/* Row (t, h) as fp32 minus the centre into out[D]; returns nonzero if a value is not finite. */
static int load_row(const pkv_store_args *a, int64_t t, int h, float *out) {
    const int D = a->head_dim;
    const int64_t off = t * a->x_stride_t + (int64_t)h * a->x_stride_h;
    if (a->x_dtype == XT_F32) {
        const float *p = (const float *)a->x + off;
        for (int i = 0; i < D; i++) out[i] = p[i];
    } else if (a->x_dtype == XT_BF16) {
        const uint16_t *p = (const uint16_t *)a->x + off;
        for (int i = 0; i < D; i++) out[i] = bf16_to_f32(p[i]);
    } else {
        const uint16_t *p = (const uint16_t *)a->x + off;
        for (int i = 0; i < D; i++) out[i] = f16_to_f32(p[i]);
    }
    if (a->centre) {
        const float *c = a->centre + (int64_t)h * D;
        for (int i = 0; i < D; i++) out[i] = out[i] - c[i];
    }
    uint32_t bad = 0;
    for (int i = 0; i < D; i++) bad |= (f2u(out[i]) & 0x7F800000u) == 0x7F800000u;
    return (int)bad;
}

/* ---- the table codecs: E4M3 scale search on tiles of 16 groups ---------------------------- */

typedef struct {
    float x[MAX_GROUP][TL]; /* x[element][group] */
    uint8_t *data[TL];      /* where each group's packed codes go */
    uint8_t *scale[TL];     /* where each group's scale byte goes */
    int n;
} tile_t;

/* The sum of a group's terms sq[e][lane], e < G, per lane, in the order of torch's CPU sum over a
   contiguous row of G floats (SumKernel.cpp, cascade_sum): with W-lane vectors (W = sum_lanes:
   8, or 16 where torch runs its AVX-512 kernels) and G >= W, vectors v_i = elements W*i..W*i+W-1
   go to four accumulators (acc_k += v_{4j+k}), the leftover vectors into acc_0, then
   acc_0 + acc_1 + acc_2 + acc_3; the leftover elements (G % W) are summed first, then the W lanes
   in order (G = 16, W = 8: lane l = e[l] + e[l+8]). A row shorter than W is the same with
   one-element vectors. Lane-wise operations only, so the compiler vectorises over the 16 groups
   without reordering. (torch's deeper cascade levels start at 64 vectors: never here.) */
PKV_ALWAYS_INLINE void group_sum(const float (*sq)[TL], const int G, const int sum_lanes, float *err) {
    const int w = G < sum_lanes ? 1 : sum_lanes, nv = G / w, ilp = nv / 4;
    for (int l = 0; l < TL; l++) err[l] = 0.0f;
    for (int e = nv * w; e < G; e++)
        for (int l = 0; l < TL; l++) err[l] = err[l] + sq[e][l];
    for (int e = 0; e < w; e++) { /* the lanes of torch's vector, in order */
        float p[TL];
        for (int l = 0; l < TL; l++) p[l] = sq[e][l];
        if (ilp) {
            float acc[3][TL];
            for (int k = 1; k < 4; k++)
                for (int l = 0; l < TL; l++) acc[k - 1][l] = sq[w * k + e][l];
            for (int j = 1; j < ilp; j++) {
                for (int l = 0; l < TL; l++) p[l] = p[l] + sq[w * 4 * j + e][l];
                for (int k = 1; k < 4; k++)
                    for (int l = 0; l < TL; l++) acc[k - 1][l] = acc[k - 1][l] + sq[w * (4 * j + k) + e][l];
            }
            for (int i = 4 * ilp; i < nv; i++)
                for (int l = 0; l < TL; l++) p[l] = p[l] + sq[w * i + e][l];
            for (int k = 0; k < 3; k++)
                for (int l = 0; l < TL; l++) p[l] = p[l] + acc[k][l];
        } else {
            for (int i = 1; i < nv; i++)
                for (int l = 0; l < TL; l++) p[l] = p[l] + sq[w * i + e][l];
        }
        for (int l = 0; l < TL; l++) err[l] = err[l] + p[l];
    }
}

/* For tests: out[i] = the sum group_sum takes of x[i*G .. i*G + G - 1], i < n <= 16. */
int pkv_store_group_sums(const float *x, int G, int n, int sum_lanes, float *out) {
    float sq[MAX_GROUP][TL], err[TL];
    if (G <= 0 || G > MAX_GROUP || n <= 0 || n > TL || sum_lanes <= 0) return PKV_STORE_BAD_ARGS;
    memset(sq, 0, sizeof sq);
    for (int i = 0; i < n; i++)
        for (int e = 0; e < G; e++) sq[e][i] = x[i * G + e];
    group_sum((const float (*)[TL])sq, G, sum_lanes, err);
    for (int i = 0; i < n; i++) out[i] = err[i];
    return PKV_STORE_OK;
}

#if defined(PKV_STORE_AVX512)
/* n: the binary search's steps (log2 of the level count, rounded up); levels and midpoints in
   two 16-lane halves (the second used by 5-step searches, through vpermt2ps) */
typedef struct { __m512 mids[2], levels[2]; int n; } lut_t;

static inline void lut_init(lut_t *L, const pkv_store_args *a) {
    float m[MAX_LEVELS], l[MAX_LEVELS];
    for (int i = 0; i < MAX_LEVELS; i++) {
        m[i] = i < a->num_levels - 1 ? a->mids[i] : INFINITY;
        l[i] = i < a->num_levels ? a->levels[i] : 0.0f;
    }
    for (int h = 0; h < 2; h++) {
        L->mids[h] = _mm512_loadu_ps(m + 16 * h);
        L->levels[h] = _mm512_loadu_ps(l + 16 * h);
    }
    L->n = 0;
    while ((1 << L->n) < a->num_levels) L->n++;
}

PKV_ALWAYS_INLINE __m512 lut_get(const __m512 *half, __m512i idx, const int nsteps) {
    return nsteps > 4 ? _mm512_permutex2var_ps(half[0], idx, half[1]) : _mm512_permutexvar_ps(idx, half[0]);
}
#elif defined(PKV_STORE_AVX2)
/* n: log2 of the level count, rounded up. Up to 16 levels the search counts the midpoints below
   the value (mids, broadcast; one compare each: independent, the fastest there); 32 levels take a
   binary search: step s compares with mids[c * 2^(s+1) + 2^s - 1], c = k >> (s+1) one of
   2^(n-1-s) candidates, held in cand[s] (two 8-lane halves for 16; a single candidate in every
   lane). The levels in four 8-lane quarters. */
typedef struct { __m256 mids[15]; __m256 cand[5][2]; __m256 lev[4]; int n; } lut_t;

static inline void lut_init(lut_t *L, const pkv_store_args *a) {
    float lv[MAX_LEVELS];
    const int nm = a->num_levels - 1;
    L->n = 0;
    while ((1 << L->n) < a->num_levels) L->n++;
    for (int i = 0; i < 15; i++) L->mids[i] = _mm256_set1_ps(i < nm ? a->mids[i] : INFINITY);
    for (int st = 0; st < L->n; st++) {
        const int ncand = 1 << (L->n - 1 - st);
        float c[16];
        for (int i = 0; i < 16; i++) {
            const int idx = (i % ncand) * (2 << st) + (1 << st) - 1;
            c[i] = idx < nm ? a->mids[idx] : INFINITY;
        }
        L->cand[st][0] = _mm256_loadu_ps(c);
        L->cand[st][1] = _mm256_loadu_ps(c + 8);
    }
    for (int i = 0; i < MAX_LEVELS; i++) lv[i] = i < a->num_levels ? a->levels[i] : 0.0f;
    for (int q = 0; q < 4; q++) L->lev[q] = _mm256_loadu_ps(lv + 8 * q);
}
#endif

/* Nearest level of y (count of mids below y: ties go down) for 16 lanes (8 with AVX2): index
   and value. */
#if defined(PKV_STORE_AVX512)
PKV_ALWAYS_INLINE __m512i nearest_level(__m512 y, const lut_t *L, __m512 *value, const int nsteps) {
    __m512i k = _mm512_setzero_si512();
    for (int s = nsteps - 1; s >= 0; s--) {
        const __m512 m = lut_get(L->mids, _mm512_add_epi32(k, _mm512_set1_epi32((1 << s) - 1)), nsteps);
        k = _mm512_mask_add_epi32(k, _mm512_cmp_ps_mask(y, m, _CMP_GT_OQ), k, _mm512_set1_epi32(1 << s));
    }
    *value = lut_get(L->levels, k, nsteps);
    return k;
}
#elif defined(PKV_STORE_AVX2)
PKV_ALWAYS_INLINE __m256i nearest_level(__m256 y, const lut_t *L, __m256 *value, const int nsteps) {
    __m256i k = _mm256_setzero_si256();
    if (nsteps <= 4) /* a true compare is -1: subtracting it counts the mids below y */
        for (int m = 0; m < (1 << nsteps) - 1; m++)
            k = _mm256_sub_epi32(k, _mm256_castps_si256(_mm256_cmp_ps(y, L->mids[m], _CMP_GT_OQ)));
    for (int s = nsteps <= 4 ? -1 : nsteps - 1; s >= 0; s--) {
        const int ncand = 1 << (nsteps - 1 - s);
        const __m256i c = _mm256_srli_epi32(k, s + 1);
        __m256 m = ncand == 1 ? L->cand[s][0] : _mm256_permutevar8x32_ps(L->cand[s][0], c);
        if (ncand > 8)
            m = _mm256_blendv_ps(m, _mm256_permutevar8x32_ps(L->cand[s][1], c),
                                 _mm256_castsi256_ps(_mm256_cmpgt_epi32(c, _mm256_set1_epi32(7))));
        const __m256i gt = _mm256_castps_si256(_mm256_cmp_ps(y, m, _CMP_GT_OQ));
        k = _mm256_add_epi32(k, _mm256_and_si256(gt, _mm256_set1_epi32(1 << s)));
    }
    __m256 v = _mm256_permutevar8x32_ps(L->lev[0], k); /* uses k's low 3 bits */
    for (int q = 1; q < 4 && 8 * q < (1 << nsteps); q++) {
        const __m256 vq = _mm256_permutevar8x32_ps(L->lev[q], k);
        v = _mm256_blendv_ps(v, vq, _mm256_castsi256_ps(_mm256_cmpgt_epi32(k, _mm256_set1_epi32(8 * q - 1))));
    }
    *value = v;
    return k;
}
#else
static inline void nearest_level(const float *y, const pkv_store_args *a, uint8_t *k, float *value) {
    const int nm = a->num_levels - 1;
    for (int l = 0; l < TL; l++) {
        k[l] = 0;
        value[l] = a->levels[0];
    }
    for (int m = 0; m < nm; m++) {
        const float mv = a->mids[m], nv = a->levels[m + 1];
        for (int l = 0; l < TL; l++) {
            const int gt = y[l] > mv;
            k[l] = gt ? (uint8_t)(m + 1) : k[l];
            value[l] = gt ? nv : value[l];
        }
    }
}
#endif

/* The squared error of element j of each lane's group for the scales vc (x - level * scale). */
#if defined(PKV_STORE_AVX512)
PKV_ALWAYS_INLINE __m512 square_error(const tile_t *tl, int j, __m512 vc, const lut_t *L, const int nsteps) {
    const __m512 xv = _mm512_loadu_ps(tl->x[j]);
    __m512 lv;
    (void)nearest_level(_mm512_div_ps(xv, vc), L, &lv, nsteps);
    const __m512 d = _mm512_sub_ps(xv, _mm512_mul_ps(lv, vc));
    return _mm512_mul_ps(d, d);
}
#elif defined(PKV_STORE_AVX2)
PKV_ALWAYS_INLINE __m256 square_error(const tile_t *tl, int j, int h, __m256 vc, const lut_t *L, const int nsteps) {
    const __m256 xv = _mm256_loadu_ps(tl->x[j] + h);
    __m256 lv;
    (void)nearest_level(_mm256_div_ps(xv, vc), L, &lv, nsteps);
    const __m256 d = _mm256_sub_ps(xv, _mm256_mul_ps(lv, vc));
    return _mm256_mul_ps(d, d);
}
#endif

/* The squared error of each lane's group for the scales cand[16], summed by group_sum; groups of
   16 with torch's 8 lanes (lane l = e[l] + e[l+8], then the lanes in order) stay in registers. */
PKV_ALWAYS_INLINE void group_errors(const pkv_store_args *a, const tile_t *tl, const int G, const int lanes,
                                const float *cand, float *err
#ifdef PKV_STORE_SIMD
                                , const lut_t *L, const int nsteps
#endif
) {
    float sq[MAX_GROUP][TL];
#if defined(PKV_STORE_AVX512)
    const __m512 vc = _mm512_loadu_ps(cand);
    if (G == 16 && lanes == 8) {
        __m512 verr = _mm512_setzero_ps();
        for (int j = 0; j < 8; j++)
            verr = _mm512_add_ps(verr, _mm512_add_ps(square_error(tl, j, vc, L, nsteps),
                                                     square_error(tl, j + 8, vc, L, nsteps)));
        _mm512_storeu_ps(err, verr);
        return;
    }
    for (int j = 0; j < G; j++) _mm512_storeu_ps(sq[j], square_error(tl, j, vc, L, nsteps));
#elif defined(PKV_STORE_AVX2)
    for (int h = 0; h < TL; h += 8) { /* lanes h..h+7 */
        const __m256 vc = _mm256_loadu_ps(cand + h);
        if (G == 16 && lanes == 8) {
            __m256 verr = _mm256_setzero_ps();
            for (int j = 0; j < 8; j++)
                verr = _mm256_add_ps(verr, _mm256_add_ps(square_error(tl, j, h, vc, L, nsteps),
                                                         square_error(tl, j + 8, h, vc, L, nsteps)));
            _mm256_storeu_ps(err + h, verr);
            continue;
        }
        for (int j = 0; j < G; j++) _mm256_storeu_ps(sq[j] + h, square_error(tl, j, h, vc, L, nsteps));
    }
    if (G == 16 && lanes == 8) return;
#else
    for (int j = 0; j < G; j++) {
        const float *xe = tl->x[j];
        float y[TL], lv[TL];
        uint8_t k[TL];
        for (int l = 0; l < TL; l++) y[l] = xe[l] / cand[l];
        nearest_level(y, a, k, lv);
        for (int l = 0; l < TL; l++) {
            const float q = lv[l] * cand[l];
            const float d = xe[l] - q;
            sq[j][l] = d * d;
        }
    }
#endif
    (void)a;
    group_sum((const float (*)[TL])sq, G, lanes, err);
}

PKV_ALWAYS_INLINE void search_tile_n(const pkv_store_args *a, tile_t *tl, const int G, const int lanes
#ifdef PKV_STORE_SIMD
                        , const lut_t *L, const int nsteps
#endif
) {
    float amax[TL], best_err[TL], best_scale[TL], cand[TL], err[TL];
    int base[TL], best_c[TL];

    for (int l = 0; l < TL; l++) amax[l] = 0.0f;
    for (int j = 0; j < G; j++)
        for (int l = 0; l < TL; l++) amax[l] = max_f(amax[l], fabsf(tl->x[j][l]));
    for (int l = 0; l < TL; l++) {
        base[l] = f32_to_e4m3(clamp448(amax[l] / a->top));
        best_err[l] = INFINITY;
        best_c[l] = 0;
        best_scale[l] = 1.0f; /* any value: lanes never improved keep code index 0 (below) */
    }
    for (int off = -5; off < 5; off++) {
        int c[TL];
        for (int l = 0; l < TL; l++) {
            c[l] = base[l] + off < 1 ? 1 : (base[l] + off > 0x7E ? 0x7E : base[l] + off);
            cand[l] = e4m3_pos_value((uint32_t)c[l]);
        }
#ifdef PKV_STORE_SIMD
        group_errors(a, tl, G, lanes, cand, err, L, nsteps);
#else
        group_errors(a, tl, G, lanes, cand, err);
#endif
        for (int l = 0; l < TL; l++)
            if (err[l] < best_err[l]) { /* strict: ties keep the smaller scale */
                best_err[l] = err[l];
                best_c[l] = c[l];
                best_scale[l] = cand[l];
            }
    }

    /* the codes of the winning scale: the same division and search again (deterministic) */
    uint8_t codes[MAX_GROUP][TL];
    for (int j = 0; j < G; j++) {
#if defined(PKV_STORE_AVX512)
        __m512 lv;
        const __m512i k = nearest_level(_mm512_div_ps(_mm512_loadu_ps(tl->x[j]), _mm512_loadu_ps(best_scale)), L, &lv, nsteps);
        _mm_storeu_si128((__m128i *)codes[j], _mm512_cvtepi32_epi8(k));
#elif defined(PKV_STORE_AVX2)
        for (int h = 0; h < TL; h += 8) {
            __m256 lv;
            int32_t k32[8];
            const __m256i k = nearest_level(_mm256_div_ps(_mm256_loadu_ps(tl->x[j] + h), _mm256_loadu_ps(best_scale + h)),
                                            L, &lv, nsteps);
            _mm256_storeu_si256((__m256i *)k32, k);
            for (int l = 0; l < 8; l++) codes[j][h + l] = (uint8_t)k32[l];
        }
#else
        float y[TL], lv[TL];
        for (int l = 0; l < TL; l++) y[l] = tl->x[j][l] / best_scale[l];
        nearest_level(y, a, codes[j], lv);
#endif
        for (int l = 0; l < TL; l++) codes[j][l] = best_c[l] ? codes[j][l] : 0;
    }
    for (int l = 0; l < tl->n; l++) {
        uint8_t g[MAX_GROUP];
        for (int j = 0; j < G; j++) g[j] = a->order[codes[j][l]];
        pack_codes(tl->data[l], g, G, a->bits);
        *tl->scale[l] = amax[l] == 0.0f ? 0 : (uint8_t)best_c[l];
    }
    tl->n = 0;
}

/* search_tile_n with the level search unrolled for the table's size (2 to 32 levels); one copy
   for groups of 16 summed with torch's 8 lanes (every group-16 table codec under AVX2 torch),
   one for any other group (apart: one function holding both slowed the first) */
#if defined(PKV_STORE_SIMD)
#define PKV_SEARCH_TILE(G, LANES)                                   \
    switch (L->n) {                                                 \
    case 1: search_tile_n(a, tl, G, LANES, L, 1); break;            \
    case 2: search_tile_n(a, tl, G, LANES, L, 2); break;            \
    case 3: search_tile_n(a, tl, G, LANES, L, 3); break;            \
    case 4: search_tile_n(a, tl, G, LANES, L, 4); break;            \
    default: search_tile_n(a, tl, G, LANES, L, 5); break;           \
    }
#else
#define PKV_SEARCH_TILE(G, LANES) search_tile_n(a, tl, G, LANES);
#endif

#ifdef PKV_STORE_SIMD
#define PKV_LUT_PARAM , const lut_t *L
#else
#define PKV_LUT_PARAM
#endif
static void search_tile_g16(const pkv_store_args *a, tile_t *tl PKV_LUT_PARAM) { PKV_SEARCH_TILE(16, 8) }
static void search_tile_any(const pkv_store_args *a, tile_t *tl PKV_LUT_PARAM) { PKV_SEARCH_TILE(a->group, a->sum_lanes) }

/* ---- the other kinds: one row at a time --------------------------------------------------- */

static void encode_row(const pkv_store_args *a, const float *x, uint8_t *data, uint8_t *sdst) {
    const int D = a->head_dim;
    if (a->kind == SK_BF16) {
        for (int i = 0; i < D; i++) put_u16(data + 2 * i, f32_to_bf16(x[i]));
        return;
    }
    if (a->kind == SK_F16) {
        for (int i = 0; i < D; i++) {
            const float v = x[i] < -65504.0f ? -65504.0f : (x[i] > 65504.0f ? 65504.0f : x[i]);
            put_u16(data + 2 * i, f32_to_f16(v));
        }
        return;
    }
    if (a->kind == SK_E4M3_TENSOR) {
        e4m3_div_array(x, a->tensor_scale, data, D);
        return;
    }
    if (a->kind == SK_E5M2_TENSOR) {
        for (int i = 0; i < D; i++) {
            float v = x[i] / a->tensor_scale;
            v = v < -57344.0f ? -57344.0f : (v > 57344.0f ? 57344.0f : v);
            data[i] = f32_to_e5m2(v);
        }
        return;
    }
    const int G = a->group;
    uint8_t codes[MAX_GROUP];
    for (int g0 = 0; g0 < D; g0 += G) {
        const float *xg = x + g0;
        float amax = 0.0f;
        for (int j = 0; j < G; j++) amax = max_f(amax, fabsf(xg[j]));
        float dq;
        uint16_t hb;
        if (a->kind == SK_E4M3_GROUP) {
            hb = half_round(amax / a->top, a->scale_kind, &dq);
            const float safe = dq > 0.0f ? dq : 1.0f;
            e4m3_div_array(xg, safe, codes, G);
        } else if (a->kind == SK_INT8) {
            hb = half_round(amax / a->top, a->scale_kind, &dq);
            const float safe = dq > 0.0f ? dq : 1.0f, hi = a->top;
            for (int j = 0; j < G; j++) {
                float q = rintf(xg[j] / safe);
                q = q < -hi ? -hi : (q > hi ? hi : q);
                codes[j] = (uint8_t)(int8_t)q;
            }
        } else { /* SK_INT_SIGNED */
            int pos = 0;
            float best = fabsf(xg[0]);
            for (int j = 1; j < G; j++)
                if (fabsf(xg[j]) > best) { best = fabsf(xg[j]); pos = j; }
            hb = half_round(xg[pos] / -a->top, a->scale_kind, &dq);
            const float safe = dq != 0.0f ? dq : 1.0f, off = a->top + 0.5f;
            const float hi = (float)((1 << a->bits) - 1);
            for (int j = 0; j < G; j++) {
                float u = floorf(xg[j] / safe + off);
                u = u < 0.0f ? 0.0f : (u > hi ? hi : u);
                codes[j] = (uint8_t)u;
            }
        }
        pack_codes(data + (int64_t)g0 * a->bits / 8, codes, G, a->bits);
        put_u16(sdst + (g0 / G) * 2, hb);
    }
}

/* ---- entry point --------------------------------------------------------------------------- */

int pkv_store_abi(void) { return 2; }

int pkv_store(const pkv_store_args *a) {
    const int D = a->head_dim, H = a->num_heads, bs = a->block_size;
    if (D <= 0 || D > MAX_HEAD_DIM || H <= 0 || bs <= 0) return PKV_STORE_BAD_ARGS;
    if (a->kind < SK_BF16 || a->kind > SK_E5M2_TENSOR) return PKV_STORE_BAD_ARGS;
    const int tensor_kind = a->kind == SK_BF16 || a->kind == SK_F16 || a->kind == SK_E4M3_TENSOR
                            || a->kind == SK_E5M2_TENSOR;
    if (!tensor_kind) {
        if (a->group <= 0 || a->group > MAX_GROUP || D % a->group || a->group % 8) return PKV_STORE_BAD_ARGS;
    }
    if (a->kind == SK_TABLE && (a->num_levels < 2 || a->num_levels > MAX_LEVELS || a->sum_lanes <= 0))
        return PKV_STORE_BAD_ARGS;
    /* every (kind, code width) below has its own rule and packing: refuse any other width */
    switch (a->kind) {
    case SK_BF16: case SK_F16: if (a->bits != 16) return PKV_STORE_BAD_WIDTH; break;
    case SK_E4M3_TENSOR: case SK_E5M2_TENSOR: case SK_E4M3_GROUP: case SK_INT8:
        if (a->bits != 8) return PKV_STORE_BAD_WIDTH;
        break;
    case SK_INT_SIGNED: if (a->bits < 2 || a->bits > 7) return PKV_STORE_BAD_WIDTH; break;
    default: /* SK_TABLE */
        if (a->bits < 1 || a->bits > 5) return PKV_STORE_BAD_WIDTH;
        if (a->num_levels > (1 << a->bits)) return PKV_STORE_BAD_ARGS;
    }
    float row[MAX_HEAD_DIM];

    /* every kept value finite before the first write */
    for (int64_t t = 0; t < a->num_tokens; t++) {
        if (a->slots[t] < 0) continue;
        for (int h = 0; h < H; h++)
            if (load_row(a, t, h, row)) return PKV_STORE_NONFINITE;
    }

#ifdef PKV_STORE_SIMD
    lut_t lut;
    if (a->kind == SK_TABLE) lut_init(&lut, a);
#define PKV_LUT_ARG , &lut
#else
#define PKV_LUT_ARG
#endif
    void (*const search_tile)(const pkv_store_args *, tile_t * PKV_LUT_PARAM) =
        a->group == 16 && a->sum_lanes == 8 ? search_tile_g16 : search_tile_any;
    const int G = a->group;
    tile_t tile;
    tile.n = 0;
    for (int64_t t = 0; t < a->num_tokens; t++) {
        const int64_t slot = a->slots[t];
        if (slot < 0) continue;
        uint8_t *block = a->pool + (slot / bs) * a->block_stride;
        const int64_t row0 = (slot % bs) * H;
        for (int h = 0; h < H; h++) {
            load_row(a, t, h, row);
            uint8_t *data = block + (row0 + h) * a->row_data_bytes;
            uint8_t *sdst = block + a->scale_offset + (row0 + h) * a->row_scale_bytes;
            if (a->kind != SK_TABLE) {
                encode_row(a, row, data, sdst);
                continue;
            }
            for (int g0 = 0; g0 < D; g0 += G) {
                const int l = tile.n++;
                for (int j = 0; j < G; j++) tile.x[j][l] = row[g0 + j];
                tile.data[l] = data + g0 * a->bits / 8;
                tile.scale[l] = sdst + g0 / G;
                if (tile.n == TL) search_tile(a, &tile PKV_LUT_ARG);
            }
        }
    }
    if (tile.n) { /* the unused lanes hold zeros: their (unwritten) results stay finite */
        for (int l = tile.n; l < TL; l++)
            for (int j = 0; j < G; j++) tile.x[j][l] = 0.0f;
        search_tile(a, &tile PKV_LUT_ARG);
    }
    return PKV_STORE_OK;
}
