/* pagedkv fast CPU attention over the paged, compressed KV cache.
 *
 * One kernel for every (K codec, V codec) pair of the catalogue: a side (K or V) is described by
 * its properties (code bits, how a code becomes a value, group size, scale type, byte layout), not
 * by its name. Every non-bf16 codec decodes as value_table[code] * group_scale; bf16 is raw.
 *
 * Shape of the work (flash-decoding style, fp32 accumulation, online softmax):
 *   task = (sequence, group of kv heads, tile of query rows, range of blocks)
 *   for each block of the range (one block = block_size tokens, read once while hot in L1):
 *     for each kv head of the task:
 *       decode the block's K rows (rotated basis, group scales applied) into an fp32 tile,
 *       transpose it to [head_dim][16 tokens], compute the scores of ALL query vectors that
 *       share this kv head (GQA group x query rows) as broadcast-FMAs, soft-cap, mask (causal,
 *       sliding window), online-softmax update, decode the V rows that some query still needs
 *       (sparse V) and accumulate p * v.
 *   partial results of block ranges (split-K, used when there are fewer tasks than threads) are
 *   merged at the end; sinks join the denominator at the merge.
 *
 * The caller (ops/cpu/attention.py) rotates q (rotated K), folds scale * k tensor scale into q,
 * passes the k_centre term as a per-query bias, and un-rotates the output (rotated V).
 *
 * Code paths: compiled with AVX-512 F/BW/VL/VBMI the decode uses byte permutes (vpermb) to move
 * each code into a 32-bit lane, a variable shift, and vpermps as a 16-entry table lookup
 * (vpermt2ps over 32 entries for 5-bit codes); with AVX2 + FMA + F16C the same technique on 8
 * lanes (a broadcast word + variable shift per 8 codes, vpermps as an 8-entry table, two for 4-bit
 * codes; 5-bit codes, 8 in 5 bytes: a broadcast qword, a byte shuffle, the shift, four tables);
 * otherwise portable C.
 * Opt-in approximate integer scores for the AVX2 and AVX-512 decode (args int8_scores): attention_i8.h.
 * Opt-in bf16 scores for the AVX-512 BF16 decode (args bf16_dots, K sides whose values are exact in
 * bf16 and carry no group scale: bf16, E4M3): scores_bf16_t.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VBMI__)
#define PKV_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PKV_AVX2 1
#include <immintrin.h>
#endif
#if defined(PKV_AVX512) || defined(PKV_AVX2)
#define PKV_SIMD 1
#endif

#define PKV_ABI_VERSION 6
#define SMALL_M 8
#ifndef PKV_LAZY_T
#define PKV_LAZY_T 8.0f  /* AVX-512 online softmax: the running max moves when exceeded by more than this */
#endif


enum { EK_BF16 = 0, EK_LUT = 1, EK_E4M3 = 2, EK_I8 = 3 };
enum { SC_NONE = 0, SC_E4M3 = 1, SC_BF16 = 2, SC_FP16 = 3 };

typedef struct {
    const uint8_t *pool;      /* [num_blocks, block_stride] */
    int64_t block_stride;     /* bytes between consecutive blocks */
    int64_t scale_offset;     /* bytes of the data section (scales start here) */
    int32_t bits;             /* 16, 8, 5, 4, 3, 2 */
    int32_t kind;             /* EK_* */
    int32_t group;            /* elements per scale; 0 = no per-group scale */
    int32_t scale_kind;       /* SC_* */
    int32_t row_data_bytes;   /* bytes of one (token, head) row of codes */
    int32_t row_scale_bytes;  /* bytes of one (token, head) row of scales */
    const float *table;       /* value of each code: 256 entries (< 8 bits: replicated, entry e = code e mod 2^bits) */
    const float *e4m3;        /* 256-entry E4M3 table for scales */
} pkv_side;

typedef struct {
    int32_t num_seqs, num_q_heads, num_kv_heads, head_dim, block_size;
    int32_t bt_stride;            /* elements between block-table rows */
    const float *q;               /* [Tq, Hq, D] fp32, already rotated/scaled */
    const float *bias;            /* [Tq, Hq] or NULL: added to every score (k_centre term) */
    const int32_t *block_tables;  /* [B, bt_stride] */
    const int32_t *seq_lens;      /* [B] */
    const int32_t *query_start;   /* [B+1] */
    int32_t window;               /* 0 = none */
    float soft_cap;               /* 0 = none */
    const float *sinks;           /* [Hq] or NULL */
    float sparse_thr;             /* 0 = exact */
    float out_scale;              /* multiplies the output (v tensor scale) */
    float *out;                   /* [Tq, Hq, D] fp32 */
    int32_t num_threads;
    int32_t rows_per_tile;        /* query rows per task tile (>= 1) */
    int32_t heads_per_task;       /* kv heads per task (divides num_kv_heads) */
    int32_t num_splits;           /* block ranges per (seq, head group, tile) */
    int64_t *stats;               /* [2] or NULL: V rows decoded, V rows skipped (sparse) */
    int32_t int8_scores;          /* 1: approximate integer q.k where implemented (attention_i8.h) */
    float *lse;                   /* [Tq, Hq] or NULL: log-sum-exp of each row's logits (+ its sink) */
    int32_t key_start;            /* keys j < key_start are not read (0 = all) */
    int32_t bf16_dots;            /* 1: bf16 products where implemented (decode scores: scores_bf16_t;
                                     prefill tile: pkv_prefill_bf16 is its own entry point) */
} pkv_args;

/* Rows of one chunk: row i of kv head h has its codes at data[i] + h * row_data_bytes; with
   per-group scales, chunk c (16 elements) of that row is scaled by scl[i * sstride + h * nc + c]. */
typedef struct {
    const uint8_t **data;    /* [nt] block base + (j % BS) * H * row_data_bytes */
    const uint8_t **sraw;    /* [nt] block base + scale_offset + (j % BS) * H * row_scale_bytes */
    float *scl;              /* [nt][H * nc] decoded scales, one per 16-element chunk */
    const uint8_t **pf_data; /* the next chunk's rows, prefetched one row per row processed */
    const uint8_t **pf_sraw;
    int pf_nt;
    float *sclt;             /* or NULL; [H * nc][sclt_ld] the same scales transposed (AVX-512
                                integer scores: one aligned load per 16 tokens, i8_scales_t) */
    int sclt_ld;
} pkv_rows;

/* While row i of kv head h is processed, fetch row i of the next chunk (same head) and its scales:
   random block order defeats the hardware prefetchers, and bursts of software prefetches into L1
   at chunk starts overflow the miss buffers; one row per row keeps the stream steady. Besides,
   AVX-512 builds fetch the whole K and V blocks PKV_PF_AHEAD chunks ahead into L2 at each chunk
   start (run_task; one prefetcht1 per line), so that these row prefetches find their lines in L2
   rather than DRAM (measured with benchmarks/perf/ab_decode_kernel.py: docs/performance.md). */
#ifndef PKV_PF_AHEAD
#ifdef PKV_AVX512
#define PKV_PF_AHEAD 2
#else
#define PKV_PF_AHEAD 0
#endif
#endif
static inline void prefetch_next(const pkv_rows *rw, int i, int64_t hoff, int rdb) {
    if (i < rw->pf_nt) {
        const uint8_t *d = rw->pf_data[i] + hoff;
        __builtin_prefetch(d, 0, 3);
        __builtin_prefetch(d + rdb - 1, 0, 3);
        __builtin_prefetch(rw->pf_sraw[i], 0, 3);
    }
}

/* prefetch_next for the 16 rows g0 .. g0+15 (the tokens-in-lanes score paths): one range test per
   group instead of one per row. */
static inline __attribute__((always_inline)) void prefetch16(const pkv_rows *rw, int g0, int64_t hoff, int rdb) {
    const int npf = rw->pf_nt - g0 < 16 ? rw->pf_nt - g0 : 16;
    const uint8_t *const *pd = rw->pf_data + g0, *const *ps = rw->pf_sraw + g0;
    if (npf == 16) {
#pragma GCC unroll 16
        for (int t = 0; t < 16; t++) {
            const uint8_t *d = pd[t] + hoff;
            __builtin_prefetch(d, 0, 3);
            __builtin_prefetch(d + rdb - 1, 0, 3);
            __builtin_prefetch(ps[t], 0, 3);
        }
    } else {
        for (int t = 0; t < npf; t++) {
            const uint8_t *d = pd[t] + hoff;
            __builtin_prefetch(d, 0, 3);
            __builtin_prefetch(d + rdb - 1, 0, 3);
            __builtin_prefetch(ps[t], 0, 3);
        }
    }
}

/* Factor the fast decode leaves out of a side's values (folded elsewhere): 2^8 for E4M3 values. */
static inline float value_mult(const pkv_side *sd) {
#ifdef PKV_SIMD
    return sd->kind == EK_E4M3 ? 256.0f : 1.0f;
#else
    (void)sd;
    return 1.0f;
#endif
}

int pkv_abi_version(void) { return PKV_ABI_VERSION; }

int pkv_has_avx512(void) {
#ifdef PKV_AVX512
    return 1;
#else
    return 0;
#endif
}

/* 1 when decode scores honour args bf16_dots (AVX-512 BF16 builds; scores_bf16_t), else 0 (exact). */
int pkv_decode_bf16_available(void) {
#if defined(PKV_AVX512) && defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

int pkv_has_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* ---------------------------------------------------------------- scalar helpers */
static inline int imin(int a, int b) { return a < b ? a : b; }
static inline int imax(int a, int b) { return a > b ? a : b; }

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float fp16_to_f32(uint16_t h) {
    uint32_t s = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 31, m = h & 1023, u;
    if (e == 0) {
        float f = ldexpf((float)m, -24);
        return s ? -f : f;
    }
    if (e == 31) u = s | 0x7f800000u | (m << 13);
    else u = s | ((e + 112) << 23) | (m << 13);
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float group_scale(const pkv_side *sd, const uint8_t *srow, int g) {
    switch (sd->scale_kind) {
    case SC_E4M3: return sd->e4m3[srow[g]];
    case SC_BF16: return bf16_to_f32((uint16_t)(srow[2 * g] | (srow[2 * g + 1] << 8)));
    case SC_FP16: return fp16_to_f32((uint16_t)(srow[2 * g] | (srow[2 * g + 1] << 8)));
    default: return 1.0f;
    }
}

/* The 8 codes that fill `bits` (3, 5) bytes at p as one little-endian word: code k is bits
   bits * k .. bits * k + bits - 1 (the row's LSB-first bit stream, codecs/packing.py). */
static inline uint64_t word8(const uint8_t *p, int bits) {
    uint64_t w = 0;
    for (int k = 0; k < bits; k++) w |= (uint64_t)p[k] << (8 * k);
    return w;
}

static inline uint32_t code_at(const uint8_t *row, int bits, int j) {
    switch (bits) {
    case 8: return row[j];
    case 4: return (row[j >> 1] >> ((j & 1) * 4)) & 15;
    case 2: return (row[j >> 2] >> ((j & 3) * 2)) & 3;
    case 3: case 5: return (word8(row + bits * (j >> 3), bits) >> (bits * (j & 7))) & ((1u << bits) - 1u);
    default: return 0;
    }
}

/* Portable decode of one (token, head) row into fp32 dst[D] (values times group scales). */
__attribute__((unused)) static void decode_row_scalar(const pkv_side *sd, const uint8_t *drow, const uint8_t *srow, int D,
                              float *dst) {
    if (sd->kind == EK_BF16) {
        for (int j = 0; j < D; j++) dst[j] = bf16_to_f32((uint16_t)(drow[2 * j] | (drow[2 * j + 1] << 8)));
        return;
    }
    const float *t = sd->table;
    switch (sd->bits) {  /* one loop per code width (a switch per element would not vectorise) */
    case 8:
        for (int j = 0; j < D; j++) dst[j] = t[drow[j]];
        break;
    case 4:
        for (int i = 0; i < D / 2; i++) {
            dst[2 * i] = t[drow[i] & 15];
            dst[2 * i + 1] = t[drow[i] >> 4];
        }
        break;
    case 2:
        for (int i = 0; i < D / 4; i++)
            for (int k = 0; k < 4; k++) dst[4 * i + k] = t[(drow[i] >> (2 * k)) & 3];
        break;
    case 3:
        for (int i = 0; i < D / 8; i++) {
            const uint64_t w = word8(drow + 3 * i, 3);
            for (int k = 0; k < 8; k++) dst[8 * i + k] = t[(w >> (3 * k)) & 7];
        }
        break;
    case 5:
        for (int i = 0; i < D / 8; i++) {
            const uint64_t w = word8(drow + 5 * i, 5);
            for (int k = 0; k < 8; k++) dst[8 * i + k] = t[(w >> (5 * k)) & 31];
        }
        break;
    default:
        for (int j = 0; j < D; j++) dst[j] = t[code_at(drow, sd->bits, j)];
    }
    if (sd->group) {
        for (int g = 0; g < D / sd->group; g++) {
            float s = group_scale(sd, srow, g);
            for (int j = g * sd->group; j < (g + 1) * sd->group; j++) dst[j] *= s;
        }
    }
}

/* Call CALL(kind, bits) with compile-time constants for a side (one instance per decode);
   exhaustive: pkv_attention refuses every other (kind, width) before any work (side_ok). */
#define PKV_DISPATCH(sd, CALL)                                                   \
    switch ((sd)->kind) {                                                        \
    case EK_BF16: CALL(EK_BF16, 16); break;                                      \
    case EK_E4M3: CALL(EK_E4M3, 8); break;                                       \
    case EK_I8: CALL(EK_I8, 8); break;                                           \
    case EK_LUT:                                                                 \
        switch ((sd)->bits) {                                                    \
        case 8: CALL(EK_LUT, 8); break;                                          \
        case 5: CALL(EK_LUT, 5); break;                                          \
        case 4: CALL(EK_LUT, 4); break;                                          \
        case 3: CALL(EK_LUT, 3); break;                                          \
        case 2: CALL(EK_LUT, 2); break;                                          \
        default: break; /* unreachable: pkv_attention refuses it (side_ok) */   \
        }                                                                        \
        break;                                                                   \
    default: break;                                                              \
    }

#ifdef PKV_AVX512
/* ---------------------------------------------------------------- AVX-512 decode */
typedef struct {
    __m512i idx;    /* vpermb index: lane j <- bytes (j*bits)/8 .. +3 */
    __m512i shift;  /* lane j >> (j*bits)%8 */
    __m512 table;   /* 16-entry table (codes < 16) */
    __m512 table_hi; /* entries 16-31: with `table`, the 32-entry table of 5-bit codes (lut16) */
    __mmask16 load_mask;
    __m512i idx4[4]; /* decode64: vpermb index of chunk z of a 64-value pass held in one register
                        (2/3/4/5-bit: idx + 2 * bits * z; E4M3: byte 16z + j into the high byte of word j) */
} lut_ctx;

static void lut_ctx_init(lut_ctx *c, const pkv_side *sd) {
    uint8_t idx[64], idx4[4][64];
    int32_t sh[16];
    int bits = sd->bits < 8 ? sd->bits : 4;
    for (int j = 0; j < 16; j++) {
        int b = (j * bits) / 8;
        for (int k = 0; k < 4; k++) idx[4 * j + k] = (uint8_t)((b + k) < 16 ? b + k : 15);
        for (int z = 0; z < 4; z++)
            for (int k = 0; k < 4; k++) idx4[z][4 * j + k] = (uint8_t)(2 * bits * z + b + k);
        sh[j] = (j * bits) % 8;
    }
    if (sd->kind == EK_E4M3)  /* word j of chunk z <- (byte 16z + j) << 8 (the low byte zeroed by the mask) */
        for (int z = 0; z < 4; z++)
            for (int j = 0; j < 32; j++) idx4[z][2 * j] = 0, idx4[z][2 * j + 1] = (uint8_t)(16 * z + (j & 15));
    c->idx = _mm512_loadu_si512(idx);
    c->shift = _mm512_loadu_si512(sh);
    c->table = _mm512_loadu_ps(sd->table);
    c->table_hi = _mm512_loadu_ps(sd->table + 16);
    c->load_mask = (__mmask16)((1u << (2 * bits)) - 1u);
    for (int z = 0; z < 4; z++) c->idx4[z] = _mm512_loadu_si512(idx4[z]);
}

#define PKV_INLINE static inline __attribute__((always_inline))
PKV_INLINE int imin4(int a, int b) { return a < b ? a : b; }

/* 16 E4M3 bytes -> fp32 values times 2^-8: the bits move into an fp16 (sign to bit 15, exponent and
   mantissa to bits 7..13), which vcvtph2ps converts exactly, subnormals included, whatever MXCSR
   says (no denormal arithmetic: multiplying fp32 denormals costs a microcode assist each). */
PKV_INLINE __m512 e4m3x16(__m128i bytes) {
    __m256i w = _mm256_cvtepu8_epi16(bytes);
    __m256i mag = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7f)), 7);
    __m256i sgn = _mm256_slli_epi16(w, 8);
    return _mm512_cvtph_ps(_mm256_ternarylogic_epi32(mag, sgn, _mm256_set1_epi16((short)0x8000), 0xD8));
}

/* The table values of 16 codes held in the low bits of each lane, whatever bits lie above them:
   vpermps reads 4 index bits (tables of up to 16 entries, replicated); 5-bit codes take vpermt2ps,
   which reads 5 over the table's two halves. */
PKV_INLINE __m512 lut16(const int bits, __m512i w, __m512 lo, __m512 hi) {
    return bits == 5 ? _mm512_permutex2var_ps(lo, w, hi) : _mm512_permutexvar_ps(w, lo);
}

/* 16 values (chunk c of a row) for a compile-time (kind, bits): see the file comment. */
PKV_INLINE __m512 decode16(const int kind, const int bits, const pkv_side *sd, const lut_ctx *lc,
                           const uint8_t *drow, int c) {
    if (kind == EK_BF16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)(drow + 32 * c));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    if (kind == EK_E4M3) return e4m3x16(_mm_loadu_si128((const __m128i *)(drow + 16 * c)));
    if (kind == EK_I8) {
        __m512i u = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(drow + 16 * c)));
        return _mm512_cvtepi32_ps(u);
    }
    if (bits == 8) {
        __m512i u = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(drow + 16 * c)));
        return _mm512_i32gather_ps(u, sd->table, 4);
    }
    /* 2/3/4/5-bit codes: vpermb puts the bytes holding code j in lane j, a variable shift aligns
       it, vpermps (vpermt2ps) looks it up (upper bits are harmless: lut16) */
    __m128i x = _mm_maskz_loadu_epi8((__mmask16)((1u << (2 * bits)) - 1u), drow + 2 * bits * c);
    __m512i w = _mm512_permutexvar_epi8(lc->idx, _mm512_zextsi128_si512(x));
    w = _mm512_srlv_epi32(w, lc->shift);
    return lut16(bits, w, lc->table, lc->table_hi);
}

/* The n (<= 8 * bits) bytes of sub-byte codes at p in one register, the bytes above zero (a masked
   load: nothing past them is read); a ymm load up to 4 bits (32 bytes), a zmm load for 5 (40). */
PKV_INLINE __m512i load_codes(const int bits, int n, const uint8_t *p) {
    if (bits > 4) return _mm512_maskz_loadu_epi8((__mmask64)((1ull << n) - 1u), p);
    return _mm512_zextsi256_si512(_mm256_maskz_loadu_epi8((__mmask32)((1ull << n) - 1u), p));
}

/* Chunks c0 .. c0+3 (64 values) of a row into v[0..3]: for 2/3/4/5-bit tables and E4M3 the pass's
   code bytes are loaded once (one masked load of 8 * bits, or 64, bytes) and each chunk is a
   vpermb from that register (then the shift and vpermps table of decode16, or E4M3's fp16 bits:
   the permute leaves byte j in the high half of word j, an arithmetic shift and an and give
   (b & 0x80) << 8 | (b & 0x7f) << 7): 3-4 ops per 16 values instead of 5-6. Other kinds: decode16. */
PKV_INLINE void decode64(const int kind, const int bits, const pkv_side *sd, const lut_ctx *lc,
                         const uint8_t *drow, int c0, __m512 v[4]) {
    if (kind == EK_LUT && bits < 8) {
        const __m512i x = load_codes(bits, 8 * bits, drow + 2 * bits * c0);
        for (int z = 0; z < 4; z++)
            v[z] = lut16(bits, _mm512_srlv_epi32(_mm512_permutexvar_epi8(lc->idx4[z], x), lc->shift), lc->table,
                         lc->table_hi);
    } else if (kind == EK_E4M3) {
        const __m512i x = _mm512_loadu_si512(drow + 16 * c0);
        for (int z = 0; z < 4; z++) {
            const __m256i w = _mm512_castsi512_si256(_mm512_maskz_permutexvar_epi8((__mmask64)0xAAAAAAAAAAAAAAAAull, lc->idx4[z], x));
            const __m256i h = _mm256_and_si256(_mm256_srai_epi16(w, 1), _mm256_set1_epi16((short)0xbfff));
            v[z] = _mm512_cvtph_ps(h);
        }
    } else {
        for (int z = 0; z < 4; z++) v[z] = decode16(kind, bits, sd, lc, drow, c0 + z);
    }
}

/* Decode the scales of every kv head of `nt` tokens into rows->scl (vectorised per token). */
PKV_INLINE __m512 scales16(const pkv_side *sd, const uint8_t *s, __mmask16 k) {
    __m512 v;
    if (sd->scale_kind == SC_E4M3) {
        v = _mm512_mul_ps(e4m3x16(_mm_maskz_loadu_epi8(k, s)), _mm512_set1_ps(256.0f));
    } else if (sd->scale_kind == SC_BF16) {
        __m256i hbits = _mm256_maskz_loadu_epi16(k, s);
        v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hbits), 16));
    } else {
        v = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, s));
    }
    if (sd->kind == EK_E4M3) v = _mm512_mul_ps(v, _mm512_set1_ps(value_mult(sd)));
    return v;
}

static void decode_scales(const pkv_side *sd, pkv_rows *rows, int nt, int H, int D) {
    if (!sd->group) return;
    const int nc = D >> 4, ng = D / sd->group, per = nc / ng;
    const int n = per == 1 ? H * ng : ng;  /* entries decoded per vector pass */
    if (per == 1) {
        /* tokens of one block have their scales back to back (n entries each), as their decoded
           scales: each run of such tokens is one vectorised pass (16 scales at a time) */
        const int eb = sd->scale_kind == SC_E4M3 ? 1 : 2;
        for (int i = 0; i < nt;) {
            int r = 1;
            while (i + r < nt && rows->sraw[i + r] == rows->sraw[i] + (int64_t)r * n * eb) r++;
            const uint8_t *s = rows->sraw[i];
            float *dst = rows->scl + (int64_t)i * n;
            const int tot = r * n;
            int e = 0;
            for (; e + 16 <= tot; e += 16) _mm512_storeu_ps(dst + e, scales16(sd, s + eb * e, (__mmask16)0xffff));
            if (e < tot) {
                const __mmask16 k = (__mmask16)((1u << (tot - e)) - 1u);
                _mm512_mask_storeu_ps(dst + e, k, scales16(sd, s + eb * e, k));
            }
            i += r;
        }
        return;
    }
    float tmp[64];  /* one scale per `per` chunks: decoded per (token, head), expanded to one per chunk */
    const int eb = sd->scale_kind == SC_E4M3 ? 1 : 2;
    for (int i = 0; i < nt; i++)
        for (int hh = 0; hh < H; hh++) {
            const uint8_t *s = rows->sraw[i] + (int64_t)hh * sd->row_scale_bytes;
            for (int e = 0; e < n; e += 16) {
                const __mmask16 k = (__mmask16)(n - e >= 16 ? 0xffff : ((1u << (n - e)) - 1u));
                _mm512_mask_storeu_ps(tmp + e, k, scales16(sd, s + eb * e, k));
            }
            float *dst = rows->scl + ((int64_t)i * H + hh) * nc;
            for (int c = 0; c < nc; c++) dst[c] = tmp[c / per];
        }
}

PKV_INLINE void decode_rows_t(const int kind, const int bits, const pkv_side *sd, const lut_ctx *lc,
                              const pkv_rows *rw, int h, int nt, int H, int D, float *dst,
                              const uint8_t *need) {
    const int nc = D >> 4;
    const int64_t hoff = (int64_t)h * sd->row_data_bytes;
    for (int i = 0; i < nt; i++) {
        prefetch_next(rw, i, hoff, sd->row_data_bytes);
        if (need && !need[i]) continue;
        const uint8_t *drow = rw->data[i] + hoff;
        float *out = dst + (int64_t)i * D;
        if (sd->group) {
            const float *scl = rw->scl + ((int64_t)i * H + h) * nc;
            for (int c = 0; c < nc; c++)
                _mm512_store_ps(out + 16 * c, _mm512_mul_ps(decode16(kind, bits, sd, lc, drow, c), _mm512_set1_ps(scl[c])));
        } else {
            for (int c = 0; c < nc; c++) _mm512_store_ps(out + 16 * c, decode16(kind, bits, sd, lc, drow, c));
        }
    }
}

/* Decode the rows of kv head h (rows with need[i] == 0 skipped when given) into dst[nt][D]. */
static void decode_rows(const pkv_side *sd, const lut_ctx *lc, const pkv_rows *rw, int h, int nt, int H,
                        int D, float *dst, const uint8_t *need) {
#define PKV_CALL_DECODE(K, B) decode_rows_t(K, B, sd, lc, rw, h, nt, H, D, dst, need)
    PKV_DISPATCH(sd, PKV_CALL_DECODE)
#undef PKV_CALL_DECODE
}

/* 16x16 transpose in registers: r[k] lane i <- r[i] lane k (also integer data, cast: attention_i8.h). */
PKV_INLINE void transpose16_regs(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i + 0] = _mm512_shuffle_ps(t[4 * i + 0], t[4 * i + 2], 0x44);
        r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i + 0], t[4 * i + 2], 0xEE);
        r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    /* r[4i+k] holds, for rows 4i..4i+3, column k of every 4-column chunk (per 128-bit lane) */
    for (int i = 0; i < 2; i++)
        for (int k = 0; k < 4; k++) {
            __m512 a = r[8 * i + k], b = r[8 * i + 4 + k];
            t[8 * i + k] = _mm512_shuffle_f32x4(a, b, 0x88);
            t[8 * i + 4 + k] = _mm512_shuffle_f32x4(a, b, 0xDD);
        }
    for (int k = 0; k < 8; k++) {
        __m512 a = t[k], b = t[8 + k];
        r[k] = _mm512_shuffle_f32x4(a, b, 0x88);
        r[8 + k] = _mm512_shuffle_f32x4(a, b, 0xDD);
    }
    /* now r[k] holds column k (rows 0..15) */
}

/* 16x16 transpose: in rows r[i] (16 floats each, stride `ld`), out[j*16 + i] = in[i][j]. */
static inline void transpose16(const float *in, int ld, float *out, int ostride) {
    __m512 r[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_load_ps(in + i * ld);
    transpose16_regs(r);
    for (int k = 0; k < 16; k++) _mm512_store_ps(out + k * ostride, r[k]);
}

/* 16 vectors v[0..15] (stride 16 floats) -> one vector of their horizontal sums. */
PKV_INLINE __m512 hsum16(const float *v) {
    __m512 t[8], u[4], w[2];
    for (int i = 0; i < 8; i++) {
        __m512 a = _mm512_load_ps(v + 32 * i), b = _mm512_load_ps(v + 32 * i + 16);
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    }
    /* t[i] lane-wise (per 128-bit lane L): [a0+a2, b0+b2, a1+a3, b1+b3] of rows 2i, 2i+1 */
    for (int i = 0; i < 4; i++)
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
    /* u[i] per 128-bit lane: partial sums of rows 4i, 4i+1, 4i+2, 4i+3 */
    for (int i = 0; i < 2; i++)
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

/* Raw scores S[m][i] = q_m . k_i for the nt rows of a chunk (MM, compile-time, query vectors):
   each K row is decoded into registers once per 64 dims (decode64) and dotted with every q;
   partial vectors go to `part` [MM][BSP][16] and are reduced 16 tokens at a time. */
PKV_INLINE void scores_dot_t(const int kind, const int bits, const int MM, const pkv_side *sd, const lut_ctx *lc,
                             const pkv_rows *rw, int h, int nt, int H, int D,
                             const float *qv, float *part, float *S, int BSP) {
    const lut_ctx L = *lc;  /* a local copy: stores through `part` cannot alias it (kept in registers) */
    lc = &L;
    const int nc = D >> 4;
    const int64_t hoff = (int64_t)h * sd->row_data_bytes;
    for (int i = 0; i < nt; i++) {
        prefetch_next(rw, i, hoff, sd->row_data_bytes);
        const uint8_t *drow = rw->data[i] + hoff;
        const float *scl = sd->group ? rw->scl + ((int64_t)i * H + h) * nc : NULL;
        int c0 = 0;
        for (; c0 + 4 <= nc; c0 += 4) {  /* 4 chunks (64 dims) at a time, fully unrolled */
            __m512 k[4];
            decode64(kind, bits, sd, lc, drow, c0, k);
            if (scl)
                for (int z = 0; z < 4; z++) k[z] = _mm512_mul_ps(k[z], _mm512_set1_ps(scl[c0 + z]));
            for (int m = 0; m < MM; m++) {
                const float *q = qv + (int64_t)m * D + 16 * c0;
                __m512 a0 = _mm512_mul_ps(k[0], _mm512_loadu_ps(q)), a1 = _mm512_mul_ps(k[1], _mm512_loadu_ps(q + 16));
                a0 = _mm512_fmadd_ps(k[2], _mm512_loadu_ps(q + 32), a0);
                a1 = _mm512_fmadd_ps(k[3], _mm512_loadu_ps(q + 48), a1);
                __m512 acc = _mm512_add_ps(a0, a1);
                float *dst = part + ((int64_t)m * BSP + i) * 16;
                if (c0) acc = _mm512_add_ps(acc, _mm512_load_ps(dst));
                _mm512_store_ps(dst, acc);
            }
        }
        for (; c0 < nc; c0++) {  /* remaining chunks (head_dim not a multiple of 64) */
            __m512 k0 = decode16(kind, bits, sd, lc, drow, c0);
            if (scl) k0 = _mm512_mul_ps(k0, _mm512_set1_ps(scl[c0]));
            for (int m = 0; m < MM; m++) {
                __m512 acc = _mm512_mul_ps(k0, _mm512_loadu_ps(qv + (int64_t)m * D + 16 * c0));
                float *dst = part + ((int64_t)m * BSP + i) * 16;
                if (c0) acc = _mm512_add_ps(acc, _mm512_load_ps(dst));
                _mm512_store_ps(dst, acc);
            }
        }
    }
    for (int m = 0; m < MM; m++) {
        float *pm = part + (int64_t)m * BSP * 16;
        for (int i = nt; i < BSP; i++) _mm512_store_ps(pm + 16 * i, _mm512_setzero_ps());
        for (int g = 0; g < BSP / 16; g++) _mm512_store_ps(S + (int64_t)m * BSP + 16 * g, hsum16(pm + 256 * g));
    }
}

static void scores_dot(const pkv_side *sd, const lut_ctx *lc, const pkv_rows *rw, int h, int nt, int H,
                       int D, int M, const float *qv, float *part, float *S, int BSP) {
#define PKV_CALL_DOT(K, B)                                                                        \
    switch (M) {                                                                                  \
    case 1: scores_dot_t(K, B, 1, sd, lc, rw, h, nt, H, D, qv, part, S, BSP); break;              \
    case 2: scores_dot_t(K, B, 2, sd, lc, rw, h, nt, H, D, qv, part, S, BSP); break;              \
    case 3: scores_dot_t(K, B, 3, sd, lc, rw, h, nt, H, D, qv, part, S, BSP); break;              \
    case 4: scores_dot_t(K, B, 4, sd, lc, rw, h, nt, H, D, qv, part, S, BSP); break;              \
    default:                                                                                      \
        for (int m0 = 0; m0 < M; m0 += 4) {                                                       \
            const int mm = imin(4, M - m0);                                                       \
            float *pp = part + (int64_t)m0 * BSP * 16;                                            \
            const float *qq = qv + (int64_t)m0 * D;                                               \
            float *ss = S + (int64_t)m0 * BSP;                                                    \
            if (mm == 4) scores_dot_t(K, B, 4, sd, lc, rw, h, nt, H, D, qq, pp, ss, BSP);        \
            else if (mm == 3) scores_dot_t(K, B, 3, sd, lc, rw, h, nt, H, D, qq, pp, ss, BSP);   \
            else if (mm == 2) scores_dot_t(K, B, 2, sd, lc, rw, h, nt, H, D, qq, pp, ss, BSP);   \
            else scores_dot_t(K, B, 1, sd, lc, rw, h, nt, H, D, qq, pp, ss, BSP);                \
        }                                                                                         \
        break;                                                                                    \
    }
    PKV_DISPATCH(sd, PKV_CALL_DOT)
#undef PKV_CALL_DOT
}

/* EXACT fp32 scores over E4M3 keys without group scales (fp8; head_dim a multiple of 64, MM <= 4
   query vectors), tokens in lanes: the 16 tokens' 64-byte rows of a 64-dim pass are transposed as
   dwords (register k: dims 4k .. 4k+3 of every token), then per two dims one vpermb puts byte j of
   each lane in the high byte of word t (dim j: words 0-15, dim j': words 16-31, low bytes zeroed
   by the mask), an arithmetic shift and an and give the fp16 bits of the value times 2^-8 (e4m3x16's
   way; subnormals exact) and two vcvtph2ps give the 16 tokens' values of each dim; one FMA per query
   (even / odd dims in two accumulators) adds them against the query's value broadcast. Against
   scores_dot_t (a 4-vector decode per row, partial vectors per token, a 16-token reduction tree):
   no horizontal sums and no partial stores. The 2^8 is folded into q as for scores_dot_t. */
static const uint8_t E4M3T_IDX[2][64] = {
#define PKV_E4T(j0, j1)                                                                            \
    {0, 4 * 0 + j0, 0, 4 * 1 + j0, 0, 4 * 2 + j0, 0, 4 * 3 + j0, 0, 4 * 4 + j0, 0, 4 * 5 + j0,        \
     0, 4 * 6 + j0, 0, 4 * 7 + j0, 0, 4 * 8 + j0, 0, 4 * 9 + j0, 0, 4 * 10 + j0, 0, 4 * 11 + j0,      \
     0, 4 * 12 + j0, 0, 4 * 13 + j0, 0, 4 * 14 + j0, 0, 4 * 15 + j0,                                 \
     0, 4 * 0 + j1, 0, 4 * 1 + j1, 0, 4 * 2 + j1, 0, 4 * 3 + j1, 0, 4 * 4 + j1, 0, 4 * 5 + j1,        \
     0, 4 * 6 + j1, 0, 4 * 7 + j1, 0, 4 * 8 + j1, 0, 4 * 9 + j1, 0, 4 * 10 + j1, 0, 4 * 11 + j1,      \
     0, 4 * 12 + j1, 0, 4 * 13 + j1, 0, 4 * 14 + j1, 0, 4 * 15 + j1}
    PKV_E4T(0, 1), PKV_E4T(2, 3)
#undef PKV_E4T
};

PKV_INLINE void scores_e4m3_t(const int MM, const pkv_side *sd, const pkv_rows *rw, int h, int nt, int D,
                              const float *qv, float *S, int BSP) {
    const __m512i ix0 = _mm512_loadu_si512(E4M3T_IDX[0]), ix1 = _mm512_loadu_si512(E4M3T_IDX[1]);
    const __m512i keep = _mm512_set1_epi16((short)0xbfff);
    const int np = D >> 6, rd = sd->row_data_bytes;
    const int64_t hoff = (int64_t)h * rd;
    for (int g0 = 0; g0 < nt; g0 += 16) {
        const int n16 = imin(16, nt - g0);
        __m512 acc[2][4];
        for (int u = 0; u < 2; u++)
            for (int m = 0; m < MM; m++) acc[u][m] = _mm512_setzero_ps();
        for (int p = 0; p < np; p++) {
            __m512 X[16];
            if (p == 0) prefetch16(rw, g0, hoff, rd);
            const uint8_t *const *dp = rw->data + g0;
            if (n16 == 16) {  /* a full group: no per-row test */
#pragma GCC unroll 16
                for (int t = 0; t < 16; t++) X[t] = _mm512_castsi512_ps(_mm512_loadu_si512(dp[t] + hoff + 64 * p));
            } else {
#pragma GCC unroll 16
                for (int t = 0; t < 16; t++)
                    X[t] = t < n16 ? _mm512_castsi512_ps(_mm512_loadu_si512(dp[t] + hoff + 64 * p)) : _mm512_setzero_ps();
            }
            transpose16_regs(X);
#pragma GCC unroll 16
            for (int k = 0; k < 16; k++) {
                const __m512i x = _mm512_castps_si512(X[k]);
#pragma GCC unroll 2
                for (int pi = 0; pi < 2; pi++) {
                    const __m512i w = _mm512_maskz_permutexvar_epi8((__mmask64)0xAAAAAAAAAAAAAAAAull, pi ? ix1 : ix0, x);
                    const __m512i f = _mm512_and_si512(_mm512_srai_epi16(w, 1), keep);
                    const __m512 v0 = _mm512_cvtph_ps(_mm512_castsi512_si256(f));
                    const __m512 v1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(f, 1));
                    const int d = 64 * p + 4 * k + 2 * pi;
                    for (int m = 0; m < MM; m++) {
                        acc[0][m] = _mm512_fmadd_ps(_mm512_set1_ps(qv[(int64_t)m * D + d]), v0, acc[0][m]);
                        acc[1][m] = _mm512_fmadd_ps(_mm512_set1_ps(qv[(int64_t)m * D + d + 1]), v1, acc[1][m]);
                    }
                }
            }
        }
        for (int m = 0; m < MM; m++) _mm512_store_ps(S + (int64_t)m * BSP + g0, _mm512_add_ps(acc[0][m], acc[1][m]));
    }
}

#ifndef PKV_E4M3T
#define PKV_E4M3T 1  /* 0: E4M3 keys take scores_dot (A/B builds) */
#endif
/* 1 when scores_e4m3 takes this K side (the caller checks M <= SMALL_M) */
static int e4m3t_ok(const pkv_side *sd, int D) {
    return PKV_E4M3T && sd->kind == EK_E4M3 && !sd->group && D % 64 == 0;
}

static void scores_e4m3(const pkv_side *sd, const pkv_rows *rw, int h, int nt, int D, int M, const float *qv,
                        float *S, int BSP) {
    for (int m0 = 0; m0 < M; m0 += 4) {  /* at most 4 query vectors per pass (registers) */
        const int mm = imin(4, M - m0);
        const float *qq = qv + (int64_t)m0 * D;
        float *ss = S + (int64_t)m0 * BSP;
        if (mm == 4) scores_e4m3_t(4, sd, rw, h, nt, D, qq, ss, BSP);
        else if (mm == 3) scores_e4m3_t(3, sd, rw, h, nt, D, qq, ss, BSP);
        else if (mm == 2) scores_e4m3_t(2, sd, rw, h, nt, D, qq, ss, BSP);
        else scores_e4m3_t(1, sd, rw, h, nt, D, qq, ss, BSP);
    }
}

#ifdef __AVX512BF16__
#define PKV_BF16DOT 1
/* Approximate scores with bf16 products (args bf16_dots; bf16_side_ok: bf16 or E4M3 K without group
   scales, whose values are exact in bf16): S[m][i] = sum_d bf16(q_md) k_id by vdpbf16ps (two
   products per fp32 lane, products exact in fp32, fp32 sums). Only q is rounded (to nearest even,
   relative error <= 2^-8), so |S~ - S| <= (2^-8 + D 2^-24) sum_d |q_d k_id| (vdpbf16ps also treats
   denormal inputs as zero and flushes denormal sums: q entries below 2^-126, bf16 keys below 2^-126;
   E4M3 keys arrive times 2^-8, >= 2^-17, never denormal).
   Layout: two tokens share each vector: vector z of a token pair (t0, t1) holds dims 16z .. 16z+15 as
   128-bit lanes [t0 d0-7 | t1 d0-7 | t0 d8-15 | t1 d8-15], dotted with q arranged the same way
   ([q d0-7 | q d0-7 | q d8-15 | q d8-15], bf16_prepare_queries), so that one accumulator holds two
   tokens and two pairs fold into one vector of 4 tokens x 4 lanes (1 store per 4 tokens instead of
   1 per token, and a 2-level reduction of 16 tokens instead of hsum16's 4 levels).
   E4M3 -> bf16 without fp32: vpermi2b puts byte b of either row into both bytes of a word w;
   y = w >> 4 (arithmetic) has the sign in bit 15, the exponent in bits 10..7 and the mantissa in
   6..4, so (y & 0x07f0) | 0x3800 is the bf16 of the magnitude times 2^-8 (exponent + 112 =
   127 - 15); subnormals (exponent 0: no implicit bit) come from a 32-entry vpermw table indexed by
   w's low bits (= the mantissa), masked on exponent 0; then y's bit 15 (the sign) is or-ed in. */
typedef struct {
    __m512i idx[4];  /* vpermi2b index of vector z % 4 within a 64-dim window of the two rows */
    __m512i sub;     /* bf16 magnitude bits of E4M3 subnormal m (m * 2^-9 * 2^-8), m < 8 */
} bf16_ctx;

static void bf16_ctx_init(bf16_ctx *c) {
    uint8_t idx[4][64];
    uint16_t sub[32];
    for (int z = 0; z < 4; z++)
        for (int w = 0; w < 32; w++) {
            const int L = w >> 3, tok = L & 1, dim = 16 * z + 8 * (L >> 1) + (w & 7);
            idx[z][2 * w] = idx[z][2 * w + 1] = (uint8_t)(64 * tok + dim);
        }
    for (int m = 0; m < 32; m++) {
        const float f = m < 8 ? ldexpf((float)m, -17) : 0.0f;
        uint32_t u;
        memcpy(&u, &f, 4);
        sub[m] = (uint16_t)(u >> 16);  /* exact: m < 8 has 3 significant bits */
    }
    for (int z = 0; z < 4; z++) c->idx[z] = _mm512_loadu_si512(idx[z]);
    c->sub = _mm512_loadu_si512(sub);
}

/* q [D] fp32 -> [2D] bf16 in the pair layout (vector z: q 16z..16z+7 twice, then 16z+8..16z+15 twice). */
static void bf16_prepare_query(const float *q, int D, uint16_t *out) {
    const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m512i hi = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int z = 0; z < D / 16; z++) {
        const __m512 v = _mm512_loadu_ps(q + 16 * z);
        _mm512_storeu_si512(out + 32 * z, (__m512i)_mm512_cvtne2ps_pbh(_mm512_permutexvar_ps(hi, v),
                                                                      _mm512_permutexvar_ps(lo, v)));
    }
}

/* Vector z of the pair (rows a, b) from their 64-dim windows xa, xb (E4M3) or the rows (bf16). */
PKV_INLINE __m512bh pair_vec(const int kind, const bf16_ctx *bc, __m512i xa, __m512i xb,
                             const uint8_t *ra, const uint8_t *rb, int z) {
    if (kind == EK_BF16) {
        const __m512i a = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(ra + 32 * z)));
        const __m512i b = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(rb + 32 * z)));
        return (__m512bh)_mm512_permutex2var_epi64(a, _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), b);
    }
    const __m512i w = _mm512_permutex2var_epi8(xa, bc->idx[z & 3], xb);
    const __m512i y = _mm512_srai_epi16(w, 4);
    __m512i n = _mm512_ternarylogic_epi32(y, _mm512_set1_epi16(0x07f0), _mm512_set1_epi16(0x3800), 0xEA);
    n = _mm512_mask_permutexvar_epi16(n, _mm512_testn_epi16_mask(w, _mm512_set1_epi16(0x7800)), w, bc->sub);
    return (__m512bh)_mm512_ternarylogic_epi32(n, y, _mm512_set1_epi16((short)0x8000), 0xF8);
}

/* acc[m] (zeroed here) = the pair layout's partial dots of rows ra, rb with the MM queries. */
PKV_INLINE void pair_dots(const int kind, const int MM, const bf16_ctx *bc, const uint8_t *ra, const uint8_t *rb,
                          int D, const uint16_t *qb, __m512 *acc) {
    for (int m = 0; m < MM; m++) acc[m] = _mm512_setzero_ps();
    for (int g = 0; g < D; g += 64) {
        __m512i xa = _mm512_setzero_si512(), xb = xa;
        if (kind == EK_E4M3) {
            if (D - g >= 64) xa = _mm512_loadu_si512(ra + g), xb = _mm512_loadu_si512(rb + g);
            else {
                const __mmask64 k = (__mmask64)((1ull << (D - g)) - 1u);
                xa = _mm512_maskz_loadu_epi8(k, ra + g), xb = _mm512_maskz_loadu_epi8(k, rb + g);
            }
        }
        const int nz = imin4(4, (D - g) >> 4);
        for (int zz = 0; zz < nz; zz++) {
            const int z = (g >> 4) + zz;
            const __m512bh k = pair_vec(kind, bc, xa, xb, ra, rb, z);
            for (int m = 0; m < MM; m++)
                acc[m] = _mm512_dpbf16_ps(acc[m], k, (__m512bh)_mm512_loadu_si512(qb + (int64_t)m * 2 * D + 32 * z));
        }
    }
}

PKV_INLINE void scores_bf16_t(const int kind, const int MM, const int DD, const pkv_side *sd, const bf16_ctx *bcp,
                              const pkv_rows *rw, int h, int nt, int D, const uint16_t *qb,
                              float *part, float *S, int BSP) {
    if (DD) D = DD;  /* a compile-time head_dim (64, 128): the dim loops unroll */
    const bf16_ctx bc = *bcp;  /* a local copy, kept in registers */
    const int64_t hoff = (int64_t)h * sd->row_data_bytes;
    const int nq = (nt + 3) >> 2;  /* quads of tokens (the last one padded with the last row) */
    for (int u = 0; u < nq; u++) {
        const uint8_t *r[4];
        for (int t = 0; t < 4; t++) {
            const int i = imin4(4 * u + t, nt - 1);
            if (4 * u + t < nt) prefetch_next(rw, 4 * u + t, hoff, sd->row_data_bytes);
            r[t] = rw->data[i] + hoff;
        }
        __m512 a0[SMALL_M], a1[SMALL_M];
        pair_dots(kind, MM, &bc, r[0], r[1], D, qb, a0);
        pair_dots(kind, MM, &bc, r[2], r[3], D, qb, a1);
        for (int m = 0; m < MM; m++)  /* [t0 t1 t0 t1] + [t2 t3 t2 t3] -> [t0 t1 t2 t3], 4 lanes each */
            _mm512_store_ps(part + ((int64_t)m * (BSP >> 2) + u) * 16,
                            _mm512_add_ps(_mm512_shuffle_f32x4(a0[m], a1[m], 0x44), _mm512_shuffle_f32x4(a0[m], a1[m], 0xEE)));
    }
    const __m512i perm = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    for (int m = 0; m < MM; m++) {
        float *pm = part + (int64_t)m * (BSP >> 2) * 16;
        for (int u = nq; u < (BSP >> 2); u++) _mm512_store_ps(pm + 16 * u, _mm512_setzero_ps());
        for (int g = 0; g < BSP / 16; g++) {
            const float *c = pm + 64 * g;  /* 4 quads: quad p's token t in 128-bit lane t */
            const __m512 c0 = _mm512_load_ps(c), c1 = _mm512_load_ps(c + 16);
            const __m512 c2 = _mm512_load_ps(c + 32), c3 = _mm512_load_ps(c + 48);
            const __m512 u01 = _mm512_add_ps(_mm512_unpacklo_ps(c0, c1), _mm512_unpackhi_ps(c0, c1));
            const __m512 u23 = _mm512_add_ps(_mm512_unpacklo_ps(c2, c3), _mm512_unpackhi_ps(c2, c3));
            const __m512 w = _mm512_add_ps(_mm512_shuffle_ps(u01, u23, 0x44), _mm512_shuffle_ps(u01, u23, 0xEE));
            _mm512_store_ps(S + (int64_t)m * BSP + 16 * g, _mm512_permutexvar_ps(perm, w));  /* lane 4t+p -> 4p+t */
        }
    }
}

#define PKV_CALL_BFM(K, MM, DD, qq, pp, ss) scores_bf16_t(K, MM, DD, sd, bc, rw, h, nt, D, qq, pp, ss, BSP)
#define PKV_CALL_BFD(K, MM, qq, pp, ss)                                                           \
    do {                                                                                          \
        if (D == 64) PKV_CALL_BFM(K, MM, 64, qq, pp, ss);                                         \
        else if (D == 128) PKV_CALL_BFM(K, MM, 128, qq, pp, ss);                                  \
        else PKV_CALL_BFM(K, MM, 0, qq, pp, ss);                                                  \
    } while (0)
static void scores_bf16(const pkv_side *sd, const bf16_ctx *bc, const pkv_rows *rw, int h, int nt, int D, int M,
                        const uint16_t *qb, float *part, float *S, int BSP) {
#define PKV_CALL_BF(K)                                                                            \
    for (int m0 = 0; m0 < M; m0 += 4) {  /* at most 4 query vectors per pass (registers) */      \
        const int mm = imin(4, M - m0);                                                           \
        float *pp = part + (int64_t)m0 * (BSP >> 2) * 16;                                         \
        const uint16_t *qq = qb + (int64_t)m0 * 2 * D;                                            \
        float *ss = S + (int64_t)m0 * BSP;                                                        \
        if (mm == 4) PKV_CALL_BFD(K, 4, qq, pp, ss);                                              \
        else if (mm == 3) PKV_CALL_BFD(K, 3, qq, pp, ss);                                         \
        else if (mm == 2) PKV_CALL_BFD(K, 2, qq, pp, ss);                                         \
        else PKV_CALL_BFD(K, 1, qq, pp, ss);                                                      \
    }
    if (sd->kind == EK_BF16) PKV_CALL_BF(EK_BF16)
    else PKV_CALL_BF(EK_E4M3)
#undef PKV_CALL_BF
}
#undef PKV_CALL_BFD
#undef PKV_CALL_BFM
#endif /* __AVX512BF16__ */

/* acc[m] = alpha[m] * acc[m] + sum_i P[m][i] v_i for MM (compile-time) query vectors: each V row
   is decoded into registers once per 64 dims and accumulated into MM x 4 register accumulators. */
PKV_INLINE void vacc_t(const int kind, const int bits, const int MM, const pkv_side *sd, const lut_ctx *lc,
                       const pkv_rows *rw, int h, int nt, int H, int D, const float *P, int BSP,
                       float *st_acc, const float *alpha, const uint8_t *need) {
    const lut_ctx L = *lc;  /* a local copy, kept in registers (see scores_dot_t) */
    lc = &L;
    const int nc = D >> 4;
    const int64_t hoff = (int64_t)h * sd->row_data_bytes;
    const int CG = MM <= 4 ? 4 : 2;  /* chunks per pass: MM x CG accumulators stay in registers */
    int c0 = 0;
    for (; c0 + CG <= nc; c0 += CG) {
        __m512 acc[8][4];
        for (int m = 0; m < MM; m++) {
            const __m512 al = _mm512_set1_ps(alpha[m]);
            for (int z = 0; z < CG; z++) acc[m][z] = _mm512_mul_ps(_mm512_load_ps(st_acc + (int64_t)m * D + 16 * (c0 + z)), al);
        }
        for (int i = 0; i < nt; i++) {
            if (c0 == 0) prefetch_next(rw, i, hoff, sd->row_data_bytes);
            if (need && !need[i]) continue;
            const uint8_t *drow = rw->data[i] + hoff;
            __m512 v[4];
            if (CG == 4) decode64(kind, bits, sd, lc, drow, c0, v);
            else
                for (int z = 0; z < CG; z++) v[z] = decode16(kind, bits, sd, lc, drow, c0 + z);
            if (sd->group) {
                const float *scl = rw->scl + ((int64_t)i * H + h) * nc + c0;
                for (int z = 0; z < CG; z++) v[z] = _mm512_mul_ps(v[z], _mm512_set1_ps(scl[z]));
            }
            for (int m = 0; m < MM; m++) {
                const __m512 p = _mm512_set1_ps(P[(int64_t)m * BSP + i]);
                for (int z = 0; z < CG; z++) acc[m][z] = _mm512_fmadd_ps(p, v[z], acc[m][z]);
            }
        }
        for (int m = 0; m < MM; m++)
            for (int z = 0; z < CG; z++) _mm512_store_ps(st_acc + (int64_t)m * D + 16 * (c0 + z), acc[m][z]);
    }
    for (; c0 < nc; c0++) {  /* remaining chunks (head_dim not a multiple of 64) */
        __m512 acc[8];
        for (int m = 0; m < MM; m++)
            acc[m] = _mm512_mul_ps(_mm512_load_ps(st_acc + (int64_t)m * D + 16 * c0), _mm512_set1_ps(alpha[m]));
        for (int i = 0; i < nt; i++) {
            if (need && !need[i]) continue;
            __m512 v = decode16(kind, bits, sd, lc, rw->data[i] + hoff, c0);
            if (sd->group) v = _mm512_mul_ps(v, _mm512_set1_ps(rw->scl[((int64_t)i * H + h) * nc + c0]));
            for (int m = 0; m < MM; m++) acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(P[(int64_t)m * BSP + i]), v, acc[m]);
        }
        for (int m = 0; m < MM; m++) _mm512_store_ps(st_acc + (int64_t)m * D + 16 * c0, acc[m]);
    }
}

#define VACC_MAX_M 8
static void vacc_fused(const pkv_side *sd, const lut_ctx *lc, const pkv_rows *rw, int h, int nt, int H, int D,
                       int M, const float *P, int BSP, float *st_acc, const float *alpha, const uint8_t *need) {
#define PKV_CALL_V(K, B)                                                                          \
    switch (M) {                                                                                  \
    case 1: vacc_t(K, B, 1, sd, lc, rw, h, nt, H, D, P, BSP, st_acc, alpha, need); break;         \
    case 2: vacc_t(K, B, 2, sd, lc, rw, h, nt, H, D, P, BSP, st_acc, alpha, need); break;         \
    case 3: vacc_t(K, B, 3, sd, lc, rw, h, nt, H, D, P, BSP, st_acc, alpha, need); break;         \
    case 4: vacc_t(K, B, 4, sd, lc, rw, h, nt, H, D, P, BSP, st_acc, alpha, need); break;         \
    case 5: vacc_t(K, B, 5, sd, lc, rw, h, nt, H, D, P, BSP, st_acc, alpha, need); break;         \
    case 6: vacc_t(K, B, 6, sd, lc, rw, h, nt, H, D, P, BSP, st_acc, alpha, need); break;         \
    case 7: vacc_t(K, B, 7, sd, lc, rw, h, nt, H, D, P, BSP, st_acc, alpha, need); break;         \
    default: vacc_t(K, B, 8, sd, lc, rw, h, nt, H, D, P, BSP, st_acc, alpha, need); break;        \
    }
    PKV_DISPATCH(sd, PKV_CALL_V)
#undef PKV_CALL_V
}

static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    x = _mm512_min_ps(x, _mm512_set1_ps(88.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500E-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

static inline __m512 softcap512(__m512 s, float cap) {
    /* cap * tanh(s / cap), tanh(y) = sign(y) (1 - e) / (1 + e), e = exp(-2|y|) */
    __m512 y = _mm512_mul_ps(s, _mm512_set1_ps(1.0f / cap));
    __m512 ay = _mm512_abs_ps(y);
    __m512 e = exp512(_mm512_mul_ps(ay, _mm512_set1_ps(-2.0f)));
    __m512 t = _mm512_div_ps(_mm512_sub_ps(_mm512_set1_ps(1.0f), e), _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    __m512i sign = _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32((int)0x80000000u));
    t = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), sign));
    return _mm512_mul_ps(t, _mm512_set1_ps(cap));
}
#endif /* PKV_AVX512 */

#ifdef PKV_AVX2
/* ---------------------------------------------------------------- AVX2 (8 lanes): the same
   technique as the AVX-512 path with 8-element chunks: a 2/3/4-bit code reaches its own 32-bit
   lane by a broadcast of the word that holds the 8 codes and a variable shift; vpermps looks it
   up in an 8-entry table (4-bit codes: two tables, chosen by bit 3 via a blend on the sign;
   5-bit codes, whose 8 fill 5 bytes: a broadcast qword and a byte shuffle first, then four
   tables chosen by bits 3 and 4); E4M3 through fp16 bits and vcvtph2ps; 8-bit tables by a gather. */
#define PKV_INLINE static inline __attribute__((always_inline))
PKV_INLINE int imin4(int a, int b) { return a < b ? a : b; }

typedef struct {
    __m256i sh[2];   /* lane j >> j * bits; [1]: for a row's last 8 codes, loaded 4 - bits bytes early (lut8);
                        5-bit codes: lane j >> (5 j) % 8, after pick */
    __m256 tlo, thi; /* table entries 0-7 and 8-15 */
    __m256i pick[2]; /* 5-bit codes: byte shuffle of a broadcast qword, lane j <- the bytes holding code j;
                        [1]: for a row's last 8 codes, the qword loaded 3 bytes early (lut8_tab) */
    __m256 t2, t3;   /* 5-bit codes: table entries 16-23 and 24-31 */
} lut_ctx;

static void lut_ctx_init(lut_ctx *c, const pkv_side *sd) {
    int32_t sh[8], st[8];
    int8_t pk[2][32];
    int bits = sd->bits < 8 ? sd->bits : 4;
    for (int j = 0; j < 8; j++) {
        sh[j] = j * bits, st[j] = j * bits + 8 * (4 - bits);
        const int p = (5 * j) / 8, s = (5 * j) % 8;  /* 5-bit code j: byte p, bit s (and byte p + 1) */
        for (int t = 0; t < 2; t++)
            for (int k = 0; k < 4; k++)
                pk[t][4 * j + k] = (int8_t)(k == 0 ? p + 3 * t : k == 1 && s + 5 > 8 ? p + 1 + 3 * t : -128);
        if (bits == 5) sh[j] = st[j] = s;
    }
    c->sh[0] = _mm256_loadu_si256((const __m256i *)sh);
    c->sh[1] = _mm256_loadu_si256((const __m256i *)st);
    c->tlo = _mm256_loadu_ps(sd->table);
    c->thi = _mm256_loadu_ps(sd->table + 8);
    for (int t = 0; t < 2; t++) c->pick[t] = _mm256_loadu_si256((const __m256i *)pk[t]);
    c->t2 = _mm256_loadu_ps(sd->table + 16);
    c->t3 = _mm256_loadu_ps(sd->table + 24);
}

/* 8 E4M3 bytes -> fp32 values times 2^-8 (see e4m3x16): byte b in the high half of a word (b << 8),
   an arithmetic shift by 1 and bit 14 cleared give the fp16 bits (b & 0x80) << 8 | (b & 0x7f) << 7 */
PKV_INLINE __m256 e4m3x8(__m128i bytes) {
    __m128i w = _mm_srai_epi16(_mm_unpacklo_epi8(_mm_setzero_si128(), bytes), 1);
    return _mm256_cvtph_ps(_mm_and_si128(w, _mm_set1_epi16((short)0xbfff)));
}

PKV_INLINE uint32_t load_u32(const uint8_t *p) {
    uint32_t w;
    memcpy(&w, p, 4);
    return w;
}

/* 8 values of a 2/3/4-bit table row (codes 8c .. 8c+7): one 4-byte broadcast load holding the 8
   codes (no scalar register on the way), a variable shift per lane, vpermps as the table (4-bit:
   two tables blended on bit 3). tail (0 or 1): these are the row's last 8 codes, whose 4-byte load
   starts 4 - bits bytes early so that it ends at the row's last byte (never past the pool); the
   shift vector is chosen by indexing, so a runtime tail costs no branch. 5-bit codes (8 in 5
   bytes, more than a word): an 8-byte broadcast load (tail: 3 bytes early), a byte shuffle puts
   the one or two bytes holding code j in lane j (lc->pick), the shift aligns it, and four 8-entry
   tables blended on bit 3, then on bit 4, look it up (tables as lc->t2 / t3 hold entries 16-31). */
PKV_INLINE __m256 lut8_tab(const int bits, int tail, const lut_ctx *lc, __m256 tlo, __m256 thi,
                           const uint8_t *drow, int c) {
    if (bits == 5) {
        const __m256i q = _mm256_broadcastq_epi64(_mm_loadl_epi64((const __m128i *)(drow + 5 * c - 3 * tail)));
        const __m256i v = _mm256_srlv_epi32(_mm256_shuffle_epi8(q, lc->pick[tail]), lc->sh[0]);
        const __m256 b3 = _mm256_castsi256_ps(_mm256_slli_epi32(v, 28));
        const __m256 lo = _mm256_blendv_ps(_mm256_permutevar8x32_ps(tlo, v), _mm256_permutevar8x32_ps(thi, v), b3);
        const __m256 hi = _mm256_blendv_ps(_mm256_permutevar8x32_ps(lc->t2, v), _mm256_permutevar8x32_ps(lc->t3, v), b3);
        return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(v, 27)));
    }
    const __m256i w = _mm256_castps_si256(_mm256_broadcast_ss((const float *)(drow + bits * c - tail * (4 - bits))));
    const __m256i v = _mm256_srlv_epi32(w, lc->sh[tail]);
    const __m256 lo = _mm256_permutevar8x32_ps(tlo, v);
    if (bits != 4) return lo;  /* vpermps reads 3 bits: tables are replicated, upper bits harmless */
    const __m256 hi = _mm256_permutevar8x32_ps(thi, v);
    return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(v, 28)));
}

PKV_INLINE __m256 lut8(const int bits, int tail, const lut_ctx *lc, const uint8_t *drow, int c) {
    return lut8_tab(bits, tail, lc, lc->tlo, lc->thi, drow, c);
}

/* decode8 told whether these are the row's last 8 values (tail: 0 or 1; only 2/3/5-bit codes use it) */
PKV_INLINE __m256 decode8t(const int kind, const int bits, int tail, const pkv_side *sd, const lut_ctx *lc,
                           const uint8_t *drow, int c) {
    if (kind == EK_LUT && bits < 8) return lut8(bits, bits != 4 ? tail : 0, lc, drow, c);
    if (kind == EK_BF16) {
        __m128i h = _mm_loadu_si128((const __m128i *)(drow + 16 * c));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    if (kind == EK_E4M3) return e4m3x8(_mm_loadl_epi64((const __m128i *)(drow + 8 * c)));
    if (kind == EK_I8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(drow + 8 * c))));
    __m256i u = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(drow + 8 * c)));
    return _mm256_i32gather_ps(sd->table, u, 4);
}

/* 8 values (elements 8c .. 8c+7 of a row, rd bytes of codes) for a compile-time (kind, bits) */
PKV_INLINE __m256 decode8(const int kind, const int bits, const pkv_side *sd, const lut_ctx *lc,
                          const uint8_t *drow, int c, int rd) {
    return decode8t(kind, bits, bits * c + (bits == 5 ? 8 : 4) > rd, sd, lc, drow, c);  /* the load's bytes */
}

/* Vectors c and c + 1 of a row (one 16-element scale group) times the group's scale *sp (NULL:
   none). 2/3-bit tables: the scale multiplies the 8-entry table once, one vmulps per 16 values
   instead of two (same product, same rounding). TL: c + 1 is the row's last vector. */
PKV_INLINE void decode_pair(const int kind, const int bits, int TL, const pkv_side *sd, const lut_ctx *lc,
                            const uint8_t *drow, int c, const float *sp, __m256 *v0, __m256 *v1) {
    if (kind == EK_LUT && bits < 4) {
        const __m256 t = sp ? _mm256_mul_ps(lc->tlo, _mm256_broadcast_ss(sp)) : lc->tlo;
        *v0 = lut8_tab(bits, 0, lc, t, t, drow, c);
        *v1 = lut8_tab(bits, TL, lc, t, t, drow, c + 1);
        return;
    }
    __m256 a = decode8t(kind, bits, 0, sd, lc, drow, c), b = decode8t(kind, bits, TL, sd, lc, drow, c + 1);
    if (sp) {
        const __m256 sv = _mm256_broadcast_ss(sp);
        a = _mm256_mul_ps(a, sv);
        b = _mm256_mul_ps(b, sv);
    }
    *v0 = a;
    *v1 = b;
}

/* Scales of every kv head of `nt` tokens into rows->scl, one per 16-element chunk (values' E4M3
   2^-8 folded in, as in the AVX-512 path). Group 16: a token's H * nc scales are contiguous. */
static void decode_scales(const pkv_side *sd, pkv_rows *rows, int nt, int H, int D) {
    if (!sd->group) return;
    const int nc = D >> 4, per = sd->group >> 4, n = H * nc;
    const float f = value_mult(sd);
    if (per == 1 && (sd->scale_kind == SC_E4M3 || sd->scale_kind == SC_BF16)) {
        /* tokens of one block have their scales back to back (n entries each), as their
           decoded scales: each run of such tokens is one vectorised pass (8 scales at a time) */
        const int eb = sd->scale_kind == SC_E4M3 ? 1 : 2;
        for (int i = 0; i < nt;) {
            int r = 1;
            while (i + r < nt && rows->sraw[i + r] == rows->sraw[i] + (int64_t)r * n * eb) r++;
            const uint8_t *s = rows->sraw[i];
            float *dst = rows->scl + (int64_t)i * n;
            const int tot = r * n;
            int e = 0;
            if (eb == 1) {  /* e4m3x8 gives the value times 2^-8 */
                const __m256 mul = _mm256_set1_ps(256.0f * f);
                for (; e + 8 <= tot; e += 8)
                    _mm256_storeu_ps(dst + e, _mm256_mul_ps(e4m3x8(_mm_loadl_epi64((const __m128i *)(s + e))), mul));
                for (; e < tot; e++) dst[e] = sd->e4m3[s[e]] * f;
            } else {
                const __m256 mul = _mm256_set1_ps(f);
                for (; e + 8 <= tot; e += 8) {
                    __m256i hb = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(s + 2 * e)));
                    _mm256_storeu_ps(dst + e, _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(hb, 16)), mul));
                }
                for (; e < tot; e++) dst[e] = bf16_to_f32((uint16_t)(s[2 * e] | (s[2 * e + 1] << 8))) * f;
            }
            i += r;
        }
        return;
    }
    for (int i = 0; i < nt; i++)
        for (int hh = 0; hh < H; hh++) {
            const uint8_t *s = rows->sraw[i] + (int64_t)hh * sd->row_scale_bytes;
            float *dst = rows->scl + ((int64_t)i * H + hh) * nc;
            for (int c = 0; c < nc; c++) dst[c] = group_scale(sd, s, c / per) * f;
        }
}

PKV_INLINE void decode_rows_t(const int kind, const int bits, const pkv_side *sd, const lut_ctx *lc,
                              const pkv_rows *rw, int h, int nt, int H, int D, float *dst,
                              const uint8_t *need) {
    const int nc8 = D >> 3, nc = D >> 4, rd = sd->row_data_bytes;
    const int64_t hoff = (int64_t)h * rd;
    for (int i = 0; i < nt; i++) {
        prefetch_next(rw, i, hoff, rd);
        if (need && !need[i]) continue;
        const uint8_t *drow = rw->data[i] + hoff;
        float *out = dst + (int64_t)i * D;
        const float *scl = sd->group ? rw->scl + ((int64_t)i * H + h) * nc : NULL;
        for (int c = 0; c < nc8; c++) {
            __m256 x = decode8(kind, bits, sd, lc, drow, c, rd);
            if (scl) x = _mm256_mul_ps(x, _mm256_set1_ps(scl[c >> 1]));
            _mm256_store_ps(out + 8 * c, x);
        }
    }
}

static void decode_rows(const pkv_side *sd, const lut_ctx *lc, const pkv_rows *rw, int h, int nt, int H,
                        int D, float *dst, const uint8_t *need) {
#define PKV_CALL_DECODE(K, B) decode_rows_t(K, B, sd, lc, rw, h, nt, H, D, dst, need)
    PKV_DISPATCH(sd, PKV_CALL_DECODE)
#undef PKV_CALL_DECODE
}

/* 8 vectors v[0..7] (stride 8 floats) -> one vector of their horizontal sums. */
PKV_INLINE __m256 hsum8(const float *v) {
    __m256 t0 = _mm256_hadd_ps(_mm256_load_ps(v), _mm256_load_ps(v + 8));
    __m256 t1 = _mm256_hadd_ps(_mm256_load_ps(v + 16), _mm256_load_ps(v + 24));
    __m256 t2 = _mm256_hadd_ps(_mm256_load_ps(v + 32), _mm256_load_ps(v + 40));
    __m256 t3 = _mm256_hadd_ps(_mm256_load_ps(v + 48), _mm256_load_ps(v + 56));
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* 8x8 transpose: in rows (stride ld) -> out[j * ostride + i] = in[i][j] */
static inline void transpose8(const float *in, int ld, float *out, int ostride) {
    __m256 r[8], t[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_load_ps(in + (int64_t)i * ld);
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        r[4 * i + 0] = _mm256_shuffle_ps(t[4 * i + 0], t[4 * i + 2], 0x44);
        r[4 * i + 1] = _mm256_shuffle_ps(t[4 * i + 0], t[4 * i + 2], 0xEE);
        r[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        r[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int k = 0; k < 4; k++) {
        _mm256_store_ps(out + (int64_t)k * ostride, _mm256_permute2f128_ps(r[k], r[4 + k], 0x20));
        _mm256_store_ps(out + (int64_t)(k + 4) * ostride, _mm256_permute2f128_ps(r[k], r[4 + k], 0x31));
    }
}

/* One pass of scores_dot_t over NV (compile-time: 8 or 2) vectors c0 .. c0+NV-1 of a K row: the
   vectors decoded and scaled once into registers, then dotted with each query in two FMA chains
   and added to (first: written as) that query's partial vector dst[m * BSP * 8]. TL: the pass
   holds the row's last vector (decode8t's tail). */
PKV_INLINE void dot_pass(const int kind, const int bits, const int NV, int TL, const pkv_side *sd,
                         const lut_ctx *lc, const uint8_t *drow, const float *scl, int c0, int M, int D,
                         const float *qv, float *dst, int BSP, int first) {
    __m256 k[8];
    if (kind == EK_LUT && bits < 4) {  /* the scale multiplies the table (decode_pair) */
        for (int z = 0; z < NV; z += 2)
            decode_pair(kind, bits, TL && z + 2 == NV, sd, lc, drow, c0 + z, scl ? scl + ((c0 + z) >> 1) : NULL,
                        &k[z], &k[z + 1]);
    } else {
        for (int z = 0; z < NV; z++) k[z] = decode8t(kind, bits, TL && z == NV - 1, sd, lc, drow, c0 + z);
        if (scl)
            for (int z = 0; z < NV; z += 2) {
                const __m256 sv = _mm256_broadcast_ss(scl + ((c0 + z) >> 1));
                k[z] = _mm256_mul_ps(k[z], sv);
                k[z + 1] = _mm256_mul_ps(k[z + 1], sv);
            }
    }
    for (int m = 0; m < M; m++) {
        const float *q = qv + (int64_t)m * D + 8 * c0;
        __m256 a0 = _mm256_mul_ps(k[0], _mm256_loadu_ps(q)), a1 = _mm256_mul_ps(k[1], _mm256_loadu_ps(q + 8));
        for (int z = 2; z < NV; z += 2) {
            a0 = _mm256_fmadd_ps(k[z], _mm256_loadu_ps(q + 8 * z), a0);
            a1 = _mm256_fmadd_ps(k[z + 1], _mm256_loadu_ps(q + 8 * z + 8), a1);
        }
        __m256 acc = _mm256_add_ps(a0, a1);
        float *d = dst + (int64_t)m * BSP * 8;
        if (!first) acc = _mm256_add_ps(acc, _mm256_load_ps(d));
        _mm256_store_ps(d, acc);
    }
}

/* Raw scores S[m][i] = q_m . k_i (few query vectors): each K row decoded into registers once per
   64 dims (dot_pass) and dotted with every q; partial vectors [M][BSP][8] reduced 8 tokens at a
   time. */
PKV_INLINE void scores_dot_t(const int kind, const int bits, const pkv_side *sd, const lut_ctx *lc,
                             const pkv_rows *rw, int h, int nt, int H, int D, int M,
                             const float *qv, float *part, float *S, int BSP) {
    const int nc8 = D >> 3, nc = D >> 4, rd = sd->row_data_bytes;
    const int64_t hoff = (int64_t)h * rd;
    for (int i = 0; i < nt; i++) {
        prefetch_next(rw, i, hoff, rd);
        const uint8_t *drow = rw->data[i] + hoff;
        const float *scl = sd->group ? rw->scl + ((int64_t)i * H + h) * nc : NULL;
        float *dst = part + (int64_t)i * 8;
        int c0 = 0;
        for (; c0 + 8 <= nc8; c0 += 8)
            dot_pass(kind, bits, 8, c0 + 8 == nc8, sd, lc, drow, scl, c0, M, D, qv, dst, BSP, c0 == 0);
        for (; c0 < nc8; c0 += 2)  /* 16 dims at a time (D a multiple of 16) */
            dot_pass(kind, bits, 2, c0 + 2 == nc8, sd, lc, drow, scl, c0, M, D, qv, dst, BSP, c0 == 0);
    }
    for (int m = 0; m < M; m++) {
        float *pm = part + (int64_t)m * BSP * 8;
        for (int i = nt; i < BSP; i++) _mm256_store_ps(pm + 8 * i, _mm256_setzero_ps());
        for (int g = 0; g < BSP / 8; g++) _mm256_store_ps(S + (int64_t)m * BSP + 8 * g, hsum8(pm + 64 * g));
    }
}

static void scores_dot(const pkv_side *sd, const lut_ctx *lc, const pkv_rows *rw, int h, int nt, int H,
                       int D, int M, const float *qv, float *part, float *S, int BSP) {
#define PKV_CALL_DOT(K, B) scores_dot_t(K, B, sd, lc, rw, h, nt, H, D, M, qv, part, S, BSP)
    PKV_DISPATCH(sd, PKV_CALL_DOT)
#undef PKV_CALL_DOT
}

/* Scores of many query vectors against a decoded K tile rows[BSP][D]: transposed to
   kt[BSP/8][D][8], then 6 queries x 16 tokens of register accumulators per pass (pf_scores, the
   prefill tile's micro-kernel in prefill_kernel.h; a short last pass repeats query 0). */
static void pf_scores(const float *kt, int BSP, int D, const float *const *qz, float *S, int nz);
static void scores_tile(const float *rows, int BSP, int D, int M, const float *qv, float *kt, float *S) {
    const int ng8 = BSP >> 3;
    for (int g = 0; g < ng8; g++)
        for (int c = 0; c < D / 8; c++)
            transpose8(rows + (int64_t)g * 8 * D + 8 * c, D, kt + ((int64_t)g * D + 8 * c) * 8, 8);
    for (int m0 = 0; m0 < M; m0 += 6) {
        const int mm = imin4(6, M - m0);
        const float *qz[6];
        for (int z = 0; z < 6; z++) qz[z] = qv + (int64_t)(m0 + (z < mm ? z : 0)) * D;
        pf_scores(kt, BSP, D, qz, S + (int64_t)m0 * BSP, mm);
    }
}

/* Weights as memory operands: MM x CG accumulators, MM broadcast weights, the value and the scale
   would not fit the 16 ymm registers (gcc then spilled an accumulator, an FMA chain through the
   stack: 3 queries x 4 vectors, the SmolLM2 shape); vacc_t pre-broadcasts the weights into P8. */
#define PKV_MEMP(MM, CG) ((MM) * (CG) + (MM) + 3 > 16)

/* One pass of vacc_t over vectors c0 .. c0+CG-1 (CG compile-time, so the MM x CG accumulators
   stay in registers); TL: the pass holds the row's last vector (decode8t's tail). */
PKV_INLINE void vacc_pass(const int kind, const int bits, const int MM, const int CG, int TL,
                          const pkv_side *sd, const lut_ctx *lc, const pkv_rows *rw, int h, int nt, int H, int D,
                          const float *P, const float *P8, int BSP, float *st_acc, const float *alpha,
                          const uint8_t *need, int c0) {
    const int nc = D >> 4, rd = sd->row_data_bytes, MEMP = PKV_MEMP(MM, CG);
    const int64_t hoff = (int64_t)h * rd;
    __m256 acc[8][8];  /* fixed sizes (not VLAs): fully unrolled, they live in registers */
    for (int m = 0; m < MM; m++) {
        const __m256 al = _mm256_set1_ps(alpha[m]);
        for (int z = 0; z < CG; z++) acc[m][z] = _mm256_mul_ps(_mm256_load_ps(st_acc + (int64_t)m * D + 8 * (c0 + z)), al);
    }
    for (int i = 0; i < nt; i++) {
        if (c0 == 0) prefetch_next(rw, i, hoff, rd);
        if (need && !need[i]) continue;
        const uint8_t *drow = rw->data[i] + hoff;
        const float *scl = sd->group ? rw->scl + ((int64_t)i * H + h) * nc + (c0 >> 1) : NULL;
        const float *pp = P8 + (int64_t)i * MM * 8;
        __m256 pr[8];
        if (!MEMP)
            for (int m = 0; m < MM; m++) pr[m] = _mm256_broadcast_ss(P + (int64_t)m * BSP + i);
        for (int z = 0; z < CG; z += 2) {
            __m256 v[2];
            if (CG == 1) {  /* one vector per pass (many queries): c0 may be odd */
                v[0] = decode8t(kind, bits, TL, sd, lc, drow, c0);
                if (scl) v[0] = _mm256_mul_ps(v[0], _mm256_broadcast_ss(scl));
            } else {
                decode_pair(kind, bits, z + 2 == CG ? TL : 0, sd, lc, drow, c0 + z, scl ? scl + (z >> 1) : NULL,
                            &v[0], &v[1]);
            }
            for (int y = 0; y < (CG == 1 ? 1 : 2); y++) {
                if (MEMP) __asm__("" : "+r"(pp));  /* reload (a memory operand), do not keep in registers */
                for (int m = 0; m < MM; m++)
                    acc[m][z + y] = _mm256_fmadd_ps(MEMP ? _mm256_load_ps(pp + 8 * m) : pr[m], v[y], acc[m][z + y]);
            }
        }
    }
    for (int m = 0; m < MM; m++)
        for (int z = 0; z < CG; z++) _mm256_store_ps(st_acc + (int64_t)m * D + 8 * (c0 + z), acc[m][z]);
}

/* acc[m] = alpha[m] * acc[m] + sum_i P[m][i] v_i for MM (compile-time) query vectors: V decoded
   into registers CG vectors (of 8) at a time into MM x CG register accumulators; a 2-vector tail
   when CG does not divide D / 8 (D is a multiple of 16). P8: scratch of [nt][MM][8] floats. */
PKV_INLINE void vacc_t(const int kind, const int bits, const int MM, const pkv_side *sd, const lut_ctx *lc,
                       const pkv_rows *rw, int h, int nt, int H, int D, const float *P, float *P8, int BSP,
                       float *st_acc, const float *alpha, const uint8_t *need) {
    const int nc8 = D >> 3;
    const int CG = MM == 1 ? 8 : MM <= 3 ? 4 : MM <= 6 ? 2 : 1;
    if (PKV_MEMP(MM, CG) || PKV_MEMP(MM, 2))
        for (int i = 0; i < nt; i++)
            for (int m = 0; m < MM; m++) _mm256_store_ps(P8 + ((int64_t)i * MM + m) * 8, _mm256_broadcast_ss(P + (int64_t)m * BSP + i));
#define PKV_VP(G, T) vacc_pass(kind, bits, MM, G, T, sd, lc, rw, h, nt, H, D, P, P8, BSP, st_acc, alpha, need, c0)
    int c0 = 0;
    for (; c0 + CG <= nc8; c0 += CG) PKV_VP(CG, c0 + CG == nc8);
    for (; c0 < nc8; c0 += 2) PKV_VP(2, c0 + 2 == nc8);
#undef PKV_VP
}

#define VACC_MAX_M 8
static void vacc_fused(const pkv_side *sd, const lut_ctx *lc, const pkv_rows *rw, int h, int nt, int H, int D,
                       int M, const float *P, float *P8, int BSP, float *st_acc, const float *alpha,
                       const uint8_t *need) {
#define PKV_CALL_V(K, B)                                                                          \
    switch (M) {                                                                                  \
    case 1: vacc_t(K, B, 1, sd, lc, rw, h, nt, H, D, P, P8, BSP, st_acc, alpha, need); break;     \
    case 2: vacc_t(K, B, 2, sd, lc, rw, h, nt, H, D, P, P8, BSP, st_acc, alpha, need); break;     \
    case 3: vacc_t(K, B, 3, sd, lc, rw, h, nt, H, D, P, P8, BSP, st_acc, alpha, need); break;     \
    case 4: vacc_t(K, B, 4, sd, lc, rw, h, nt, H, D, P, P8, BSP, st_acc, alpha, need); break;     \
    case 5: vacc_t(K, B, 5, sd, lc, rw, h, nt, H, D, P, P8, BSP, st_acc, alpha, need); break;     \
    case 6: vacc_t(K, B, 6, sd, lc, rw, h, nt, H, D, P, P8, BSP, st_acc, alpha, need); break;     \
    case 7: vacc_t(K, B, 7, sd, lc, rw, h, nt, H, D, P, P8, BSP, st_acc, alpha, need); break;     \
    default: vacc_t(K, B, 8, sd, lc, rw, h, nt, H, D, P, P8, BSP, st_acc, alpha, need); break;    \
    }
    PKV_DISPATCH(sd, PKV_CALL_V)
#undef PKV_CALL_V
}

/* acc[m] = alpha[m] acc[m] + sum_i P[m][i] rows[i] for many query vectors (decoded V tile):
   6 queries x 16 dims of accumulators per pass, in named variables (12 of the 16 ymm registers;
   an array of accumulators indexed in loops was kept on the stack by gcc, each FMA then waiting
   on a store-to-load round trip: prefill ran at 1.35x SDPA). A short last pass repeats query 0
   (computed, not stored). */
#define PKV_VT_LOAD(z, a0, a1)                                                                     \
    const __m256 al##z = _mm256_set1_ps(alpha[mq[z]]);                                              \
    __m256 a0 = _mm256_mul_ps(_mm256_load_ps(st_acc + (int64_t)mq[z] * D + dc), al##z);             \
    __m256 a1 = _mm256_mul_ps(_mm256_load_ps(st_acc + (int64_t)mq[z] * D + dc + 8), al##z);
#define PKV_VT_FMA(z, a0, a1)                                                                      \
    w = _mm256_broadcast_ss(P + (int64_t)mq[z] * BSP + i);                                          \
    a0 = _mm256_fmadd_ps(w, x, a0);                                                                \
    a1 = _mm256_fmadd_ps(w, y, a1);
static void vacc_tile(const float *rows, int nt, int D, int M, const float *P, int BSP, float *st_acc,
                      const float *alpha, const uint8_t *need) {
    for (int m0 = 0; m0 < M; m0 += 6) {
        const int mm = imin4(6, M - m0);
        int mq[6];
        for (int z = 0; z < 6; z++) mq[z] = m0 + (z < mm ? z : 0);
        for (int dc = 0; dc < D; dc += 16) {
            PKV_VT_LOAD(0, c00, c01) PKV_VT_LOAD(1, c10, c11) PKV_VT_LOAD(2, c20, c21)
            PKV_VT_LOAD(3, c30, c31) PKV_VT_LOAD(4, c40, c41) PKV_VT_LOAD(5, c50, c51)
            for (int i = 0; i < nt; i++) {
                if (need && !need[i]) continue;
                const __m256 x = _mm256_load_ps(rows + (int64_t)i * D + dc), y = _mm256_load_ps(rows + (int64_t)i * D + dc + 8);
                __m256 w;
                PKV_VT_FMA(0, c00, c01) PKV_VT_FMA(1, c10, c11) PKV_VT_FMA(2, c20, c21)
                PKV_VT_FMA(3, c30, c31) PKV_VT_FMA(4, c40, c41) PKV_VT_FMA(5, c50, c51)
            }
            const __m256 res[12] = {c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51};
            for (int z = 0; z < mm; z++) {
                _mm256_store_ps(st_acc + (int64_t)(m0 + z) * D + dc, res[2 * z]);
                _mm256_store_ps(st_acc + (int64_t)(m0 + z) * D + dc + 8, res[2 * z + 1]);
            }
        }
    }
}
#undef PKV_VT_LOAD
#undef PKV_VT_FMA

static inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    x = _mm256_min_ps(x, _mm256_set1_ps(88.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500E-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    /* times 2^n, n in [-126, 127]: n + 127 in the exponent field */
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline __m256 softcap256(__m256 s, float cap) {
    __m256 y = _mm256_mul_ps(s, _mm256_set1_ps(1.0f / cap));
    const __m256 signbit = _mm256_set1_ps(-0.0f);
    __m256 ay = _mm256_andnot_ps(signbit, y);
    __m256 e = exp256(_mm256_mul_ps(ay, _mm256_set1_ps(-2.0f)));
    __m256 t = _mm256_div_ps(_mm256_sub_ps(_mm256_set1_ps(1.0f), e), _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    t = _mm256_or_ps(t, _mm256_and_ps(y, signbit));
    return _mm256_mul_ps(t, _mm256_set1_ps(cap));
}
#endif /* PKV_AVX2 */

#ifdef PKV_SIMD
#include "attention_i8.h"
#endif

/* ---------------------------------------------------------------- per-task state */
typedef struct {
    float *m;    /* [Mt] running max (-inf: nothing seen) */
    float *l;    /* [Mt] running denominator */
    float *acc;  /* [Mt, D] */
} pkv_state;

typedef struct {
    float *q;       /* [hpt, M, D] query vectors of the task, contiguous */
    float *bias;    /* [hpt, M] */
    int32_t *pos;   /* [M] query position of each vector */
    float *rows;    /* [BSP, D] decoded rows (K then V) */
    float *kt;      /* [BSP/16][D][16] transposed K */
    float *s;       /* [M, BSP] scores then probabilities */
    uint8_t *need;  /* [BSP] V row needed */
    float *lv;      /* [hpt, M, 16] AVX-512: lane sums of the softmax denominator (added to st_l at the end) */
    float *alpha;   /* [M] */
    int8_t *q8;     /* [hpt, M, D] int8 queries, or NULL: exact scores (AVX2 integer path only) */
    int32_t *qc;    /* [hpt, M, D/4] */
    float *qmul;    /* [hpt, M] */
#ifdef PKV_BF16DOT
    uint16_t *qb;   /* [hpt, M, 2D] bf16 queries in the pair layout, or NULL: fp32 scores (bf16_dots) */
    bf16_ctx bc;
#endif
} pkv_scratch;

/* Process the chunk's tokens (positions [jlo, jhi), rows in kr / vr) for one kv head h and the
 * M query vectors of the tile. */
static void chunk_head(const pkv_args *a, const pkv_side *ks, const pkv_side *vs,
#ifdef PKV_SIMD
                       const lut_ctx *klc, const lut_ctx *vlc,
#endif
#ifdef PKV_SIMD
                       const i8_ctx *ik,
#endif
                       const pkv_rows *kr, const pkv_rows *vr, int h, int hh, int jlo, int jhi, int M,
                       const float *qv, const float *bias, const float *sinks, const int32_t *pos,
                       pkv_scratch *sc, float *st_m, float *st_l, float *st_acc, int64_t *nv, int64_t *nskip) {
    const int D = a->head_dim, H = a->num_kv_heads;
    const int nt = jhi - jlo;
    (void)H; (void)hh;
    const int ng = (nt + 15) >> 4, BSP = ng * 16;
    const int W = a->window;
    float *rows = sc->rows, *S = sc->s;

#ifdef PKV_AVX512
    if (sc->q8) {  /* approximate integer scores (M <= SMALL_M, checked by the caller) */
        const int D64 = (D + 63) & ~63;
        scores_i8(ks, ik, kr, h, nt, H, D, M, sc->q8 + (int64_t)hh * M * D64, sc->qc + (int64_t)hh * M * (D64 / 4),
                  sc->qmul + (int64_t)hh * M, S, BSP);
#ifdef PKV_BF16DOT
    } else if (sc->qb) {  /* bf16 products (bf16_dots; M <= SMALL_M, checked by the caller) */
        scores_bf16(ks, &sc->bc, kr, h, nt, D, M, sc->qb + (int64_t)hh * M * 2 * D, sc->kt, S, BSP);
#endif
    } else if (kr->sclt) {  /* exact, table keys with group scales, tokens in lanes (scores_lut) */
        scores_lut(ks, ik, kr, h, nt, D, M, qv, S, BSP);
    } else if (M <= SMALL_M && e4m3t_ok(ks, D)) {  /* exact, E4M3 keys, tokens in lanes (scores_e4m3) */
        scores_e4m3(ks, kr, h, nt, D, M, qv, S, BSP);
    } else if (M <= SMALL_M) {  /* few query vectors: K rows decoded into registers, dot + tree reduce */
        scores_dot(ks, klc, kr, h, nt, H, D, M, qv, sc->kt, S, BSP);
    } else {  /* many: decode into a tile, transpose, broadcast-FMA every query against it */
        decode_rows(ks, klc, kr, h, nt, H, D, rows, NULL);
        for (int i = nt; i < BSP; i++) memset(rows + (int64_t)i * D, 0, sizeof(float) * D);
        for (int g = 0; g < ng; g++)
            for (int c = 0; c < D / 16; c++)
                transpose16(rows + (int64_t)g * 16 * D + 16 * c, D, sc->kt + ((int64_t)g * D + 16 * c) * 16, 16);
        for (int m = 0; m < M; m++) {
            const float *q = qv + (int64_t)m * D;
            for (int g = 0; g < ng; g++) {
                const float *kt = sc->kt + (int64_t)g * D * 16;
                __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                for (int d = 0; d < D; d += 4) {
                    a0 = _mm512_fmadd_ps(_mm512_set1_ps(q[d]), _mm512_load_ps(kt + 16 * d), a0);
                    a1 = _mm512_fmadd_ps(_mm512_set1_ps(q[d + 1]), _mm512_load_ps(kt + 16 * d + 16), a1);
                    a2 = _mm512_fmadd_ps(_mm512_set1_ps(q[d + 2]), _mm512_load_ps(kt + 16 * d + 32), a2);
                    a3 = _mm512_fmadd_ps(_mm512_set1_ps(q[d + 3]), _mm512_load_ps(kt + 16 * d + 48), a3);
                }
                _mm512_store_ps(S + (int64_t)m * BSP + 16 * g,
                                _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
            }
        }
    }
    /* a whole chunk that every query sees, with no bias and no cap (decode, but for the context's
       last chunk): the scores are the logits already; skip the pass */
    int pmin = pos[0], pmax = pos[0];
    for (int m = 1; m < M; m++) pmin = imin(pmin, pos[m]), pmax = imax(pmax, pos[m]);
    const int all_seen = nt == BSP && pmin >= jhi - 1 && (W <= 0 || jlo > pmax - W);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int m = 0; m < (!all_seen || bias || a->soft_cap > 0 ? M : 0); m++) {
        for (int g = 0; g < ng; g++) {
            __m512 s = _mm512_load_ps(S + (int64_t)m * BSP + 16 * g);
            if (bias) s = _mm512_add_ps(s, _mm512_set1_ps(bias[m]));
            if (a->soft_cap > 0) s = softcap512(s, a->soft_cap);
            /* visibility: lane i <-> key j = jlo + 16g + i; i < nt, j <= pos, j > pos - W */
            __m512i j = _mm512_add_epi32(lane, _mm512_set1_epi32(jlo + 16 * g));
            __mmask16 ok = _mm512_cmplt_epi32_mask(j, _mm512_set1_epi32(jhi));
            ok &= _mm512_cmple_epi32_mask(j, _mm512_set1_epi32(pos[m]));
            if (W > 0) ok &= _mm512_cmpgt_epi32_mask(j, _mm512_set1_epi32(pos[m] - W));
            s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), ok, s);
            _mm512_store_ps(S + (int64_t)m * BSP + 16 * g, s);
        }
    }
#elif defined(PKV_AVX2)
    if (sc->q8) {  /* approximate integer scores (M <= SMALL_M, checked by the caller) */
        scores_i8(ks, ik, kr, h, nt, H, D, M, sc->q8 + (int64_t)hh * M * D, sc->qc + (int64_t)hh * M * (D / 4),
                  sc->qmul + (int64_t)hh * M, sc->kt, S, BSP);
    } else if (M <= SMALL_M) {  /* few query vectors: K rows decoded into registers, dot + tree reduce */
        scores_dot(ks, klc, kr, h, nt, H, D, M, qv, sc->kt, S, BSP);
    } else {  /* many: decode into a tile, transpose, broadcast-FMA 4 queries at a time */
        decode_rows(ks, klc, kr, h, nt, H, D, rows, NULL);
        for (int i = nt; i < BSP; i++) memset(rows + (int64_t)i * D, 0, sizeof(float) * D);
        scores_tile(rows, BSP, D, M, qv, sc->kt, S);
    }
    /* a whole chunk that every query sees, with no bias and no cap (decode, but for the context's
       last chunk): the scores are the logits already; skip the pass */
    int pmin = pos[0], pmax = pos[0];
    for (int m = 1; m < M; m++) pmin = imin(pmin, pos[m]), pmax = imax(pmax, pos[m]);
    const int all_seen = nt == BSP && pmin >= jhi - 1 && (W <= 0 || jlo > pmax - W);
    if (!all_seen || bias || a->soft_cap > 0) {
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        for (int m = 0; m < M; m++) {
            for (int g = 0; g < BSP / 8; g++) {
                __m256 s = _mm256_load_ps(S + (int64_t)m * BSP + 8 * g);
                if (bias) s = _mm256_add_ps(s, _mm256_set1_ps(bias[m]));
                if (a->soft_cap > 0) s = softcap256(s, a->soft_cap);
                /* visibility: lane i <-> key j = jlo + 8g + i; j < jhi, j <= pos, j > pos - W */
                __m256i j = _mm256_add_epi32(lane, _mm256_set1_epi32(jlo + 8 * g));
                __m256i ok = _mm256_and_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(jhi), j),
                                              _mm256_cmpgt_epi32(_mm256_set1_epi32(pos[m] + 1), j));
                if (W > 0) ok = _mm256_and_si256(ok, _mm256_cmpgt_epi32(j, _mm256_set1_epi32(pos[m] - W)));
                s = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s, _mm256_castsi256_ps(ok));
                _mm256_store_ps(S + (int64_t)m * BSP + 8 * g, s);
            }
        }
    }
#else
    for (int i = 0; i < nt; i++)
        decode_row_scalar(ks, kr->data[i] + (int64_t)h * ks->row_data_bytes,
                          kr->sraw[i] + (int64_t)h * ks->row_scale_bytes, D, rows + (int64_t)i * D);
    /* transpose the K tile to [D][BSP] so that the score loop runs along tokens (vectorises) */
    float *kt = sc->kt;
    for (int i = 0; i < BSP; i++)
        for (int d = 0; d < D; d++) kt[(int64_t)d * BSP + i] = i < nt ? rows[(int64_t)i * D + d] : 0.0f;
    for (int m = 0; m < M; m++) {
        const float *q = qv + (int64_t)m * D;
        float *sr = S + (int64_t)m * BSP;
        for (int i = 0; i < BSP; i++) sr[i] = 0.0f;
        for (int d = 0; d < D; d++) {
            const float qd = q[d];
            const float *kd = kt + (int64_t)d * BSP;
#ifdef _OPENMP
#pragma omp simd
#endif
            for (int i = 0; i < BSP; i++) sr[i] += qd * kd[i];
        }
        for (int i = 0; i < BSP; i++) {
            int j = jlo + i;
            float s = -INFINITY;
            if (i < nt && j <= pos[m] && (W <= 0 || j > pos[m] - W)) {
                s = sr[i] + (bias ? bias[m] : 0.0f);
                if (a->soft_cap > 0) s = a->soft_cap * tanhf(s / a->soft_cap);
            }
            sr[i] = s;
        }
    }
#endif

    /* online softmax; S becomes p = exp(s - m_new) (0 when masked or sparse-skipped) */
    const float thr = a->sparse_thr;
    if (thr > 0) memset(sc->need, 0, BSP);
    int any_row = 0;
    float *alpha = sc->alpha;  /* [M] rescale factors of this chunk */
#ifdef PKV_AVX512
    if (thr <= 0) {
        /* Lazy max, lane sums: the running max moves only when a chunk's score exceeds it by more
           than PKV_LAZY_T (p <= e^T otherwise: no overflow; any offset gives the same softmax in
           exact arithmetic and the same relative rounding), and the denominator is kept as 16
           lane sums (sc->lv) reduced once at the task's end: in the common case no horizontal
           max, no expf and no horizontal sum per chunk and query. */
        float *lv = sc->lv + (int64_t)hh * M * 16;
        for (int m = 0; m < M; m++) {
            float *sr = S + (int64_t)m * BSP;
            const float mo = st_m[m];
            __m512 vm = _mm512_load_ps(sr);
            for (int g = 1; g < ng; g++) vm = _mm512_max_ps(vm, _mm512_load_ps(sr + 16 * g));
            __m512 lm = _mm512_load_ps(lv + 16 * m);
            float mx = mo;
            if (mo == -INFINITY || _mm512_cmp_ps_mask(vm, _mm512_set1_ps(mo + PKV_LAZY_T), _CMP_GT_OQ)) {
                mx = _mm512_reduce_max_ps(vm);
                if (mx == -INFINITY) {  /* nothing visible yet for this query */
                    alpha[m] = 1.0f;
                    for (int i = 0; i < BSP; i++) sr[i] = 0.0f;
                    continue;
                }
                alpha[m] = mo == -INFINITY ? 0.0f : expf(mo - mx);
                lm = _mm512_mul_ps(lm, _mm512_set1_ps(alpha[m]));
                st_l[m] *= alpha[m];
                st_m[m] = mx;
            } else {
                alpha[m] = 1.0f;
            }
            const __m512 vmx = _mm512_set1_ps(mx);
            for (int g = 0; g < ng; g++) {
                __m512 s = _mm512_load_ps(sr + 16 * g);
                __mmask16 fin = _mm512_cmp_ps_mask(s, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
                __m512 p = _mm512_maskz_mov_ps(fin, exp512(_mm512_sub_ps(s, vmx)));
                lm = _mm512_add_ps(lm, p);
                _mm512_store_ps(sr + 16 * g, p);
            }
            _mm512_store_ps(lv + 16 * m, lm);
            any_row = 1;
        }
    } else
#endif
    for (int m = 0; m < M; m++) {
        float *sr = S + (int64_t)m * BSP;
        float mx = st_m[m];
#ifdef PKV_AVX512
        __m512 vm = _mm512_set1_ps(mx);
        for (int g = 0; g < ng; g++) vm = _mm512_max_ps(vm, _mm512_load_ps(sr + 16 * g));
        mx = _mm512_reduce_max_ps(vm);
#elif defined(PKV_AVX2)
        __m256 vm = _mm256_set1_ps(mx);
        for (int g = 0; g < BSP / 8; g++) vm = _mm256_max_ps(vm, _mm256_load_ps(sr + 8 * g));
        __m128 v4 = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
        v4 = _mm_max_ps(v4, _mm_movehl_ps(v4, v4));
        v4 = _mm_max_ss(v4, _mm_shuffle_ps(v4, v4, 1));
        mx = _mm_cvtss_f32(v4);
#else
        for (int i = 0; i < BSP; i++) mx = sr[i] > mx ? sr[i] : mx;
#endif
        if (mx == -INFINITY) {  /* nothing visible yet for this query */
            alpha[m] = 1.0f;
            for (int i = 0; i < BSP; i++) sr[i] = 0.0f;
            continue;
        }
        alpha[m] = st_m[m] == -INFINITY ? 0.0f : (st_m[m] == mx ? 1.0f : expf(st_m[m] - mx));
        float lsum = 0.0f;
#ifdef PKV_AVX512
        __m512 vs = _mm512_setzero_ps();
        for (int g = 0; g < ng; g++) {
            __m512 s = _mm512_load_ps(sr + 16 * g);
            __mmask16 fin = _mm512_cmp_ps_mask(s, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
            __m512 p = _mm512_maskz_mov_ps(fin, exp512(_mm512_sub_ps(s, _mm512_set1_ps(mx))));
            vs = _mm512_add_ps(vs, p);
            _mm512_store_ps(sr + 16 * g, p);
        }
        lsum = _mm512_reduce_add_ps(vs);
#elif defined(PKV_AVX2)
        __m256 vsum = _mm256_setzero_ps();
        for (int g = 0; g < BSP / 8; g++) {
            __m256 s = _mm256_load_ps(sr + 8 * g);
            __m256 fin = _mm256_cmp_ps(s, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ);
            __m256 p = _mm256_and_ps(fin, exp256(_mm256_sub_ps(s, _mm256_set1_ps(mx))));
            vsum = _mm256_add_ps(vsum, p);
            _mm256_store_ps(sr + 8 * g, p);
        }
        {
            float t8[8];
            _mm256_storeu_ps(t8, vsum);
            lsum = ((t8[0] + t8[1]) + (t8[2] + t8[3])) + ((t8[4] + t8[5]) + (t8[6] + t8[7]));
        }
#else
        for (int i = 0; i < BSP; i++) {
            float p = sr[i] == -INFINITY ? 0.0f : expf(sr[i] - mx);
            sr[i] = p;
            lsum += p;
        }
#endif
        st_l[m] = st_l[m] * alpha[m] + lsum;
        st_m[m] = mx;
        if (thr > 0) {
            /* p_final = exp(s - m_final) / Z_final <= exp(s - mx) / Z_so_far (sinks included),
               so skipping p < thr * Z_so_far only skips positions whose final weight < thr. */
            float z = st_l[m];
            if (sinks) z += expf(sinks[m] - mx);
            float cut = thr * z;
            for (int i = 0; i < nt; i++) {
                if (sr[i] < cut) sr[i] = 0.0f;
                else sc->need[i] = 1;
            }
        }
        any_row = 1;
    }
    if (!any_row) return;

    /* V rows that some query needs -> fp32 tile */
    if (thr > 0) {
        int64_t skipped = 0;
        for (int i = 0; i < nt; i++) skipped += !sc->need[i];
        *nskip += skipped;
        *nv += nt - skipped;
    } else {
        *nv += nt;
    }
#ifdef PKV_AVX512
    if (M <= VACC_MAX_M) {  /* few query vectors: V decoded into registers, accumulators too */
        vacc_fused(vs, vlc, vr, h, nt, H, D, M, S, BSP, st_acc, alpha, thr > 0 ? sc->need : NULL);
        return;
    }
    decode_rows(vs, vlc, vr, h, nt, H, D, rows, thr > 0 ? sc->need : NULL);
#elif defined(PKV_AVX2)
    if (M <= VACC_MAX_M) {  /* few query vectors: V decoded into registers, accumulators too */
        vacc_fused(vs, vlc, vr, h, nt, H, D, M, S, sc->kt, BSP, st_acc, alpha, thr > 0 ? sc->need : NULL);
        return;
    }
    decode_rows(vs, vlc, vr, h, nt, H, D, rows, thr > 0 ? sc->need : NULL);
    vacc_tile(rows, nt, D, M, S, BSP, st_acc, alpha, thr > 0 ? sc->need : NULL);
    return;
#else
    for (int i = 0; i < nt; i++) {
        if (thr > 0 && !sc->need[i]) continue;
        decode_row_scalar(vs, vr->data[i] + (int64_t)h * vs->row_data_bytes,
                          vr->sraw[i] + (int64_t)h * vs->row_scale_bytes, D, rows + (int64_t)i * D);
    }
#endif

    for (int m = 0; m < M; m++) {
        const float *pr = S + (int64_t)m * BSP;
        float *acc = st_acc + (int64_t)m * D;
        const float al = alpha[m];
#ifdef PKV_AVX512
        for (int dc = 0; dc < D; dc += 64) {
            int nz = imin(4, (D - dc) >> 4);
            if (nz == 4) {
                __m512 c0 = _mm512_load_ps(acc + dc), c1 = _mm512_load_ps(acc + dc + 16);
                __m512 c2 = _mm512_load_ps(acc + dc + 32), c3 = _mm512_load_ps(acc + dc + 48);
                if (al != 1.0f) {
                    __m512 va = _mm512_set1_ps(al);
                    c0 = _mm512_mul_ps(c0, va); c1 = _mm512_mul_ps(c1, va);
                    c2 = _mm512_mul_ps(c2, va); c3 = _mm512_mul_ps(c3, va);
                }
                for (int i = 0; i < nt; i++) {
                    if (thr > 0 && pr[i] == 0.0f) continue;
                    __m512 p = _mm512_set1_ps(pr[i]);
                    const float *v = rows + (int64_t)i * D + dc;
                    c0 = _mm512_fmadd_ps(p, _mm512_load_ps(v), c0);
                    c1 = _mm512_fmadd_ps(p, _mm512_load_ps(v + 16), c1);
                    c2 = _mm512_fmadd_ps(p, _mm512_load_ps(v + 32), c2);
                    c3 = _mm512_fmadd_ps(p, _mm512_load_ps(v + 48), c3);
                }
                _mm512_store_ps(acc + dc, c0); _mm512_store_ps(acc + dc + 16, c1);
                _mm512_store_ps(acc + dc + 32, c2); _mm512_store_ps(acc + dc + 48, c3);
            } else {
                for (int z = 0; z < nz; z++) {
                    __m512 c0 = _mm512_mul_ps(_mm512_load_ps(acc + dc + 16 * z), _mm512_set1_ps(al));
                    for (int i = 0; i < nt; i++) {
                        if (thr > 0 && pr[i] == 0.0f) continue;
                        c0 = _mm512_fmadd_ps(_mm512_set1_ps(pr[i]), _mm512_load_ps(rows + (int64_t)i * D + dc + 16 * z), c0);
                    }
                    _mm512_store_ps(acc + dc + 16 * z, c0);
                }
            }
        }
#else
        if (al != 1.0f)
            for (int d = 0; d < D; d++) acc[d] *= al;
        for (int i = 0; i < nt; i++) {
            float p = pr[i];
            if (p == 0.0f) continue;
            const float *v = rows + (int64_t)i * D;
#ifdef _OPENMP
#pragma omp simd
#endif
            for (int d = 0; d < D; d++) acc[d] += p * v[d];
        }
#endif
    }
}

/* ---------------------------------------------------------------- tasks, merge, entry point */
typedef struct {
    int32_t b, hg, r0, r1, blk0, blk1;
    int64_t part;  /* index of the first partial row of this task: [hpt][M] rows of D + 2 */
} pkv_task;

static void *xalloc(size_t bytes) {
    size_t n = (bytes + 63) & ~(size_t)63;
    void *p = aligned_alloc(64, n ? n : 64);
    if (p) memset(p, 0, n ? n : 64);
    return p;
}

/* Row pointers of the chunk of logical blocks [lb, min(lb + NB, blk1)) of one sequence, limited to
   visible positions [jmin, jmax]; returns its token count (0 if none), positions in [*jlo, *jhi). */
static int fill_chunk(const pkv_args *a, const pkv_side *ks, const pkv_side *vs, const int32_t *bt, int lb,
                      int blk1, int NB, int jmin, int jmax, int *jlo, int *jhi, pkv_rows *kr, pkv_rows *vr) {
    const int BS = a->block_size, H = a->num_kv_heads;
    const int lb1 = imin(lb + NB, blk1);
    *jlo = imax(lb * BS, jmin);
    *jhi = imin(lb1 * BS, jmax + 1);
    const int nt = *jhi - *jlo;
    const int64_t kd = (int64_t)H * ks->row_data_bytes, ksb = (int64_t)H * ks->row_scale_bytes;
    const int64_t vd = (int64_t)H * vs->row_data_bytes, vsb = (int64_t)H * vs->row_scale_bytes;
    for (int i = 0; i < nt;) {  /* block by block: one table lookup and division per block */
        const int j = *jlo + i, pb = bt[j / BS], off = j % BS, n = imin(BS - off, nt - i);
        const uint8_t *kb = ks->pool + (int64_t)pb * ks->block_stride;
        const uint8_t *vb = vs->pool + (int64_t)pb * vs->block_stride;
        const uint8_t *k0 = kb + off * kd, *k1 = kb + ks->scale_offset + off * ksb;
        const uint8_t *v0 = vb + off * vd, *v1 = vb + vs->scale_offset + off * vsb;
        for (int u = 0; u < n; u++, i++) {
            kr->data[i] = k0 + u * kd;
            kr->sraw[i] = k1 + u * ksb;
            vr->data[i] = v0 + u * vd;
            vr->sraw[i] = v1 + u * vsb;
        }
    }
    return nt > 0 ? nt : 0;
}

#ifdef PKV_BF16DOT
/* 1 when the bf16 score path takes K side sd: bf16 or E4M3 values (3 mantissa bits: exact in bf16)
   without group scales, so that only q's rounding to bf16 is approximate. */
static int bf16_side_ok(const pkv_side *sd) {
    return !sd->group && (sd->kind == EK_BF16 || sd->kind == EK_E4M3);
}
#endif

/* Run one task; writes [hpt*M] partial rows (m, l, acc[D]) at part_out. Returns 0 or -1 (OOM). */
static int run_task(const pkv_args *a, const pkv_side *ks, const pkv_side *vs, const pkv_task *t,
                    float *part_out, int64_t *nv, int64_t *nskip) {
    const int D = a->head_dim, H = a->num_kv_heads, Hq = a->num_q_heads, G = Hq / H;
    const int BS = a->block_size, hpt = a->heads_per_task;
    const int R = t->r1 - t->r0, M = R * G;
    const int qs = a->query_start[t->b], qlen = a->query_start[t->b + 1] - qs;
    const int L = a->seq_lens[t->b];
    const int NB = BS >= 64 ? 1 : 64 / BS;     /* blocks per chunk: ~64 tokens share one pass */
    const int CH = NB * BS, BSP = (CH + 15) & ~15, nc = D / 16 > 0 ? D / 16 : 1;
    pkv_scratch sc;
    memset(&sc, 0, sizeof sc);
    pkv_rows krs[2], vrs[2];  /* rows of the current and of the next chunk (ping-pong) */
    int rows_ok = 1;
    for (int z = 0; z < 2; z++) {
        pkv_rows *r2[2] = {&krs[z], &vrs[z]};
        for (int y = 0; y < 2; y++) {
            r2[y]->data = malloc(sizeof(void *) * CH);
            r2[y]->sraw = malloc(sizeof(void *) * CH);
            r2[y]->scl = xalloc(sizeof(float) * (size_t)CH * H * nc);
            r2[y]->pf_data = r2[y]->pf_sraw = NULL;
            r2[y]->pf_nt = 0;
            r2[y]->sclt = NULL;
            r2[y]->sclt_ld = BSP;
            rows_ok &= r2[y]->data && r2[y]->sraw && r2[y]->scl;
        }
    }
    sc.q = xalloc(sizeof(float) * (size_t)hpt * M * D);
    sc.bias = xalloc(sizeof(float) * (size_t)hpt * M);
    sc.pos = xalloc(sizeof(int32_t) * (size_t)M);
    sc.rows = xalloc(sizeof(float) * (size_t)BSP * D);
    sc.kt = xalloc(sizeof(float) * (size_t)BSP * (D > 16 * M ? D : 16 * M));
    sc.s = xalloc(sizeof(float) * (size_t)M * BSP);
    sc.need = xalloc((size_t)BSP);
    sc.alpha = xalloc(sizeof(float) * (size_t)M);
    float *sinkv = a->sinks ? xalloc(sizeof(float) * (size_t)hpt * M) : NULL;
    float *st_m = xalloc(sizeof(float) * (size_t)hpt * M);
    float *st_l = xalloc(sizeof(float) * (size_t)hpt * M);
    float *st_acc = xalloc(sizeof(float) * (size_t)hpt * M * D);
    sc.lv = xalloc(sizeof(float) * (size_t)hpt * M * 16);
    int rc = 0;
    if (!sc.q || !sc.bias || !sc.pos || !sc.rows || !sc.kt || !sc.s || !sc.need || !sc.alpha || !st_m || !st_l ||
        !st_acc || !sc.lv || (a->sinks && !sinkv) || !rows_ok) {
        rc = -1;
        goto done;
    }
    for (int hh = 0; hh < hpt; hh++) {
        int h = t->hg * hpt + hh;
        for (int r = 0; r < R; r++)
            for (int g = 0; g < G; g++) {
                int m = r * G + g, tok = qs + t->r0 + r, qh = h * G + g;
                {
                    const float f = ks->group ? 1.0f : value_mult(ks);
                    float *dq = sc.q + ((size_t)hh * M + m) * D;
                    const float *sq = a->q + ((size_t)tok * Hq + qh) * D;
                    for (int d = 0; d < D; d++) dq[d] = sq[d] * f;
                }
                sc.bias[hh * M + m] = a->bias ? a->bias[(size_t)tok * Hq + qh] : 0.0f;
                if (sinkv) sinkv[hh * M + m] = a->sinks[qh];
                st_m[hh * M + m] = -INFINITY;
            }
    }
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) sc.pos[r * G + g] = L - qlen + t->r0 + r;
    const int pos_lo = L - qlen + t->r0, pos_hi = L - qlen + t->r1 - 1;
    int jmin = imax(a->window > 0 ? imax(0, pos_lo - a->window + 1) : 0, a->key_start);
    int jmax = pos_hi; /* inclusive */

#ifdef PKV_SIMD
    lut_ctx klc, vlc;
    lut_ctx_init(&klc, ks);
    lut_ctx_init(&vlc, vs);
#endif
#ifdef PKV_SIMD
    i8_ctx ik;
    i8_ctx_init(&ik, ks, H, D);
    if (a->int8_scores && ik.ok && M <= SMALL_M) {
#ifdef PKV_AVX512
        const int QD = (D + 63) & ~63;  /* each vector zero-padded to 64-dim passes */
#else
        const int QD = D;
#endif
        sc.q8 = xalloc((size_t)hpt * M * QD);
        sc.qc = xalloc(sizeof(int32_t) * (size_t)hpt * M * (QD / 4));
        sc.qmul = xalloc(sizeof(float) * (size_t)hpt * M);
        if (!sc.q8 || !sc.qc || !sc.qmul) { rc = -1; goto done; }
#ifdef PKV_AVX512
        for (int z = 0; z < 2; z++)
            if (!(krs[z].sclt = xalloc(sizeof(float) * (size_t)H * nc * BSP))) { rc = -1; goto done; }
#endif
        for (int m = 0; m < hpt * M; m++)
            i8_prepare_queries(ik.ls, sc.q + (int64_t)m * D, 1, D, sc.q8 + (int64_t)m * QD, sc.qc + (int64_t)m * (QD / 4),
                               sc.qmul + m);
    }
#endif
#ifdef PKV_AVX512
    /* the exact tokens-in-lanes scores (scores_lut) where the integer path is off; bf16_dots never
       takes table keys (bf16_side_ok), so it does not compete for them */
    const int lut_scores = ik.ok && !sc.q8 && D % 64 == 0 && M <= LUT_MAX_M;
    for (int z = 0; z < 2 && lut_scores; z++)
        if (!(krs[z].sclt = xalloc(sizeof(float) * (size_t)H * nc * BSP))) { rc = -1; goto done; }
#endif
#ifdef PKV_BF16DOT
    if (a->bf16_dots && !sc.q8 && M <= SMALL_M && bf16_side_ok(ks)) {
        sc.qb = xalloc(sizeof(uint16_t) * (size_t)hpt * M * 2 * D);
        if (!sc.qb) { rc = -1; goto done; }
        for (int m = 0; m < hpt * M; m++) bf16_prepare_query(sc.q + (int64_t)m * D, D, sc.qb + (int64_t)m * 2 * D);
        bf16_ctx_init(&sc.bc);
    }
#endif
    const int32_t *bt = a->block_tables + (int64_t)t->b * a->bt_stride;
#ifdef PKV_SIMD
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr & ~0x8040u);  /* DAZ and FTZ off: IEEE results whatever the caller set */
#endif
    int cur = 0, jlo = 0, jhi = 0;
    int nt = fill_chunk(a, ks, vs, bt, t->blk0, t->blk1, NB, jmin, jmax, &jlo, &jhi, &krs[0], &vrs[0]);
#if PKV_PF_AHEAD > 0
    /* bytes of one K / V block (codes and scales): what the prefetch below fetches per block */
    const int64_t pf_kn = ks->scale_offset + (int64_t)BS * H * ks->row_scale_bytes;
    const int64_t pf_vn = vs->scale_offset + (int64_t)BS * H * vs->row_scale_bytes;
#endif
    for (int lb = t->blk0; lb < t->blk1; lb += NB) {
        int jlo2 = 0, jhi2 = 0;
#if PKV_PF_AHEAD > 0
        /* the blocks PKV_PF_AHEAD chunks ahead into L2 (whole K and V blocks, one prefetcht1 per line);
           a negative entry (a block a sliding window gave back) has nothing to fetch */
        for (int b2 = lb + PKV_PF_AHEAD * NB; b2 < imin(lb + (PKV_PF_AHEAD + 1) * NB, t->blk1); b2++) {
            const int pb = bt[b2];
            if (pb < 0) continue;
            const uint8_t *kb = ks->pool + (int64_t)pb * ks->block_stride, *vb = vs->pool + (int64_t)pb * vs->block_stride;
            for (int64_t o = 0; o < pf_kn; o += 64) __builtin_prefetch(kb + o, 0, 2);
            for (int64_t o = 0; o < pf_vn; o += 64) __builtin_prefetch(vb + o, 0, 2);
        }
#endif
        int nt2 = lb + NB < t->blk1
                      ? fill_chunk(a, ks, vs, bt, lb + NB, t->blk1, NB, jmin, jmax, &jlo2, &jhi2, &krs[cur ^ 1], &vrs[cur ^ 1])
                      : 0;
        pkv_rows *kr = &krs[cur], *vr = &vrs[cur];
        kr->pf_data = krs[cur ^ 1].data; kr->pf_sraw = krs[cur ^ 1].sraw; kr->pf_nt = nt2;
        vr->pf_data = vrs[cur ^ 1].data; vr->pf_sraw = vrs[cur ^ 1].sraw; vr->pf_nt = nt2;
        if (nt > 0) {
#ifdef PKV_SIMD
#ifdef PKV_AVX512
            if (kr->sclt) i8_scales_t(ks, &ik, kr, nt, H, D);
            else
#endif
                decode_scales(ks, kr, nt, H, D);
            decode_scales(vs, vr, nt, H, D);
#endif
            for (int hh = 0; hh < hpt; hh++) {
                int h = t->hg * hpt + hh;
                chunk_head(a, ks, vs,
#ifdef PKV_SIMD
                           &klc, &vlc,
#endif
#ifdef PKV_SIMD
                           &ik,
#endif
                           kr, vr, h, hh, jlo, jhi, M, sc.q + (size_t)hh * M * D,
                           a->bias ? sc.bias + hh * M : NULL, sinkv ? sinkv + hh * M : NULL, sc.pos, &sc,
                           st_m + hh * M, st_l + hh * M, st_acc + (size_t)hh * M * D, nv, nskip);
            }
        }
        nt = nt2; jlo = jlo2; jhi = jhi2; cur ^= 1;
    }
#ifdef PKV_SIMD
    _mm_setcsr(csr);
#endif
#ifdef PKV_AVX512
    for (int i = 0; i < hpt * M; i++) st_l[i] += _mm512_reduce_add_ps(_mm512_load_ps(sc.lv + 16 * i));
#endif
    for (int i = 0; i < hpt * M; i++) {
        float *row = part_out + (size_t)i * (D + 2);
        row[0] = st_m[i];
        row[1] = st_l[i];
        memcpy(row + 2, st_acc + (size_t)i * D, sizeof(float) * D);
    }
done:
    free(sc.q); free(sc.bias); free(sc.pos); free(sc.rows); free(sc.kt); free(sc.s); free(sc.need); free(sc.alpha);
    free(sc.q8); free(sc.qc); free(sc.qmul);
#ifdef PKV_BF16DOT
    free(sc.qb);
#endif
    free(sinkv); free(st_m); free(st_l); free(st_acc); free(sc.lv);
    for (int z = 0; z < 2; z++) {
        free(krs[z].data); free(krs[z].sraw); free(krs[z].scl); free(krs[z].sclt);
        free(vrs[z].data); free(vrs[z].sraw); free(vrs[z].scl);
    }
    return rc;
}

/* 1 when the kernel implements this side exactly: every (kind, code width) below has its own
   decode, so an unknown width is refused here instead of being decoded as another one. */
static int side_ok(const pkv_side *sd, int D) {
    int width_ok;
    switch (sd->kind) {
    case EK_BF16: width_ok = sd->bits == 16; break;
    case EK_E4M3: case EK_I8: width_ok = sd->bits == 8; break;
    case EK_LUT: width_ok = sd->bits == 2 || sd->bits == 3 || sd->bits == 4 || sd->bits == 5 || sd->bits == 8; break;
    default: width_ok = 0;
    }
    if (!width_ok || sd->scale_kind < SC_NONE || sd->scale_kind > SC_FP16) return 0;
    if (sd->group && (sd->group % 16 || D % sd->group || sd->scale_kind == SC_NONE)) return 0;
    return 1;
}

/* Attention of packed varlen queries over the paged cache; decode is q_len = 1 per sequence.
 * Returns 0 on success, -1 when out of memory, -2 on bad arguments, -3 (K) / -4 (V) when a
 * side's code kind, width, group or scale kind is not one the kernel implements. */
int pkv_attention(const pkv_args *a, const pkv_side *ks, const pkv_side *vs) {
    const int B = a->num_seqs, H = a->num_kv_heads, Hq = a->num_q_heads, D = a->head_dim;
    const int BS = a->block_size;
    if (B < 0 || H <= 0 || Hq % H || D <= 0 || BS <= 0 || a->heads_per_task <= 0 ||
        H % a->heads_per_task || a->rows_per_tile <= 0)
        return -2;
    if (!side_ok(ks, D)) return -3;
    if (!side_ok(vs, D)) return -4;
#ifdef PKV_SIMD
    if (D % 16 || D > 1024) return -2;
#endif
    const int G = Hq / H, hpt = a->heads_per_task, ngroups = H / hpt;
    int threads = a->num_threads > 0 ? a->num_threads : 1;

    /* count base tasks (sequence, head group, row tile), then choose the split count */
    int64_t nbase = 0;
    for (int b = 0; b < B; b++) {
        int qlen = a->query_start[b + 1] - a->query_start[b];
        nbase += (int64_t)ngroups * ((qlen + a->rows_per_tile - 1) / a->rows_per_tile);
    }
    int nsplit = a->num_splits;
    if (nsplit <= 0) {
        nsplit = 1;
        if (threads > 1 && nbase < 2 * threads) nsplit = (int)((2 * threads + nbase - 1) / (nbase ? nbase : 1));
    }
    int64_t ntask = nbase * nsplit;
    pkv_task *tasks = malloc(sizeof(pkv_task) * (size_t)(ntask ? ntask : 1));
    if (!tasks) return -1;
    int64_t it = 0, part = 0;
    for (int b = 0; b < B; b++) {
        int qlen = a->query_start[b + 1] - a->query_start[b], L = a->seq_lens[b];
        for (int hg = 0; hg < ngroups; hg++)
            for (int r0 = 0; r0 < qlen; r0 += a->rows_per_tile) {
                int r1 = imin(qlen, r0 + a->rows_per_tile);
                int pos_lo = L - qlen + r0, pos_hi = L - qlen + r1 - 1;
                int jmin = imax(a->window > 0 ? imax(0, pos_lo - a->window + 1) : 0, a->key_start);
                int b0 = jmin / BS, b1 = pos_hi >= 0 ? pos_hi / BS + 1 : b0;
                if (b1 < b0) b1 = b0;
                int nb = b1 - b0;
                for (int s = 0; s < nsplit; s++) {
                    pkv_task *t = &tasks[it++];
                    t->b = b; t->hg = hg; t->r0 = r0; t->r1 = r1;
                    t->blk0 = b0 + (int)((int64_t)nb * s / nsplit);
                    t->blk1 = b0 + (int)((int64_t)nb * (s + 1) / nsplit);
                    t->part = part;
                    part += (int64_t)hpt * (r1 - r0) * G;
                }
            }
    }
    float *parts = malloc(sizeof(float) * (size_t)(part ? part : 1) * (D + 2));
    if (!parts) { free(tasks); return -1; }
    int failed = 0;
    int64_t nv = 0, nskip = 0;
    const int64_t nbase_tasks = ntask / (nsplit ? nsplit : 1);
    /* one parallel region for the tasks and the merge (one thread wake-up per call, not two) */
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
#endif
    {
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1) reduction(+ : nv, nskip) reduction(| : failed)
#endif
        for (int64_t i = 0; i < ntask; i++)
            failed |= run_task(a, ks, vs, &tasks[i], parts + tasks[i].part * (D + 2), &nv, &nskip) != 0;

        /* merge the splits of each (sequence, head group, tile) and write the output (after the
           implicit barrier of the loop above: every partial is written) */
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t ib = 0; ib < nbase_tasks; ib++) {
            const pkv_task *t0 = &tasks[ib * nsplit];
            const int R = t0->r1 - t0->r0, M = R * G, qs = a->query_start[t0->b];
            for (int hh = 0; hh < hpt; hh++)
                for (int m = 0; m < M; m++) {
                    int r = m / G, g = m % G, h = t0->hg * hpt + hh, qh = h * G + g;
                    int64_t row = (int64_t)hh * M + m;
                    float mx = a->sinks ? a->sinks[qh] : -INFINITY;
                    for (int s = 0; s < nsplit; s++) {
                        float ms = parts[(t0[s].part + row) * (D + 2)];
                        mx = ms > mx ? ms : mx;
                    }
                    float *o = a->out + ((size_t)(qs + t0->r0 + r) * Hq + qh) * D;
                    for (int d = 0; d < D; d++) o[d] = 0.0f;
                    float *lse = a->lse ? a->lse + (size_t)(qs + t0->r0 + r) * Hq + qh : NULL;
                    if (lse) *lse = -INFINITY;
                    if (mx == -INFINITY) continue;
                    float z = a->sinks ? expf(a->sinks[qh] - mx) : 0.0f;
                    for (int s = 0; s < nsplit; s++) {
                        const float *p = parts + (t0[s].part + row) * (D + 2);
                        if (p[0] == -INFINITY) continue;
                        float w = expf(p[0] - mx);
                        z += p[1] * w;
                        for (int d = 0; d < D; d++) o[d] += w * p[2 + d];
                    }
                    if (lse && z > 0) *lse = mx + logf(z);
                    float f = z > 0 ? a->out_scale * (vs->group ? 1.0f : value_mult(vs)) / z : 0.0f;
                    for (int d = 0; d < D; d++) o[d] *= f;
                }
        }
    }
    if (a->stats) { a->stats[0] += nv; a->stats[1] += nskip; }
    free(parts);
    free(tasks);
    return failed ? -1 : 0;
}

/* Streaming read of n floats (the bench's memory-bandwidth probe); returns their sum. */
double pkv_stream_sum(const float *p, int64_t n, int32_t threads) {
    double total = 0.0;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1) reduction(+ : total)
#endif
    for (int64_t b = 0; b < n; b += 4096) {
        int64_t e = b + 4096 < n ? b + 4096 : n;
#ifdef PKV_AVX512
        __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
        int64_t i = b;
        for (; i + 64 <= e; i += 64) {
            s0 = _mm512_add_ps(s0, _mm512_loadu_ps(p + i));
            s1 = _mm512_add_ps(s1, _mm512_loadu_ps(p + i + 16));
            s2 = _mm512_add_ps(s2, _mm512_loadu_ps(p + i + 32));
            s3 = _mm512_add_ps(s3, _mm512_loadu_ps(p + i + 48));
        }
        float acc = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
        for (; i < e; i++) acc += p[i];
#elif defined(PKV_AVX2)
        __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
        int64_t i = b;
        for (; i + 32 <= e; i += 32) {
            s0 = _mm256_add_ps(s0, _mm256_loadu_ps(p + i));
            s1 = _mm256_add_ps(s1, _mm256_loadu_ps(p + i + 8));
            s2 = _mm256_add_ps(s2, _mm256_loadu_ps(p + i + 16));
            s3 = _mm256_add_ps(s3, _mm256_loadu_ps(p + i + 24));
        }
        float t8[8], acc = 0.0f;
        _mm256_storeu_ps(t8, _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
        for (int k = 0; k < 8; k++) acc += t8[k];
        for (; i < e; i++) acc += p[i];
#else
        float acc = 0.0f;
        for (int64_t i = b; i < e; i++) acc += p[i];
#endif
        total += acc;
    }
    return total;
}

#include "prefill_kernel.h" /* chunked-prefill tile (AVX2, AVX-512): pkv_prefill */
