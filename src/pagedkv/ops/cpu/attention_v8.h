/* Approximate integer P.V for the AVX-512 decode (included by attention_kernel.c after
 * attention_i8.h, whose level images it reuses; `AttentionParams.int8_values`, off by default).
 *
 * Only for V sides that attention_i8.h's i8_levels() accepts (2/3/4-bit table codes with per-group
 * scales: turbo2/3/4, nvfp4, q4_0), head_dim a multiple of 64, tasks of at most SMALL_M query
 * vectors (decode). Everything else, and the AVX2 and scalar builds, compute P.V exactly.
 *
 * Per chunk (the <= 64 tokens of one pass of run_task, padded to BSP = a multiple of 16) and kv
 * head, after the softmax weights P[m][i] >= 0 (fp32; 0 for masked, padding and sparse-skipped
 * tokens, so sparse V needs no test here):
 * - weights (v8_weights): w[m][i][c] = P[m][i] * s(i, c), s the decoded scale of token i's 16-dim
 *   chunk c (may be negative: q4_0). Per query m and chunk: wmax = max_i P[m][i] * max_c |s(i, c)|
 *   (fp32 products; = max_{i,c} |w|), wsc = wmax / 127, a = P[m][i] * (127 / wmax) (fp32), wq =
 *   rint(a * s(i, c)) (fp32 product, round to nearest even; |wq| <= 127); wmax == 0 or not finite:
 *   wq = 0. One wsc per chunk, not per 16 tokens: a per-group scale costs a horizontal max and an
 *   int -> float flush per 16 tokens (the first version did that, with gathered scales: no faster
 *   than the exact V; the two costs were not timed apart). Scales are read as one 128-bit block
 *   per token and 64-dim pass (gathers, 4 per 16 tokens, took ~18% of that first version's
 *   samples) and transposed in registers; the 16 tokens of a group sit in the order
 *   0,4,8,12,1,5,... so that dword q of each 128-bit lane holds the s8 weights of tokens q, q+4, q+8,
 *   q+12 (one quad); packs + one vpermd put chunk L's weights in lane L;
 * - levels: the V codes' 7-bit images L = round(level / ls) + 64 of i8_levels (1 .. 127, lev = L -
 *   64), ls the level unit;
 * - products (vacc_i8_t): 4 tokens per vpdpbusd. A quad's 4 code rows (8 * bits bytes per 64-dim
 *   pass) are loaded two per register; per accumulator x one vpermi2b picks, for each qword (lane
 *   L, dims 16L+4x+2r, +1), the 2 bytes of each token that hold its 2 codes, vpmultishiftqb moves
 *   each code to the bottom of its byte (byte 4j+k of the lane: token k, dim 16L+4x+j) and vpermb
 *   looks the 7-bit level up; vpshufd broadcasts each lane's quad weights (dword q) to its 4 dwords,
 *   so accumulator x's dword (L, j) adds the 4 tokens' products for dim 16L+4x+j. The offset 64
 *   is removed exactly: each accumulator starts at -64 * (the chunk's weight sum for that 16-dim
 *   chunk), computed with the weights;
 * - the int32 sums (exact: |sum| <= BSP * 63 * 127) become fp32: acc = float(sum) * (wsc * ls)
 *   (wsc * ls rounded once); a 4x4 transpose of 128-bit blocks puts the dims back in order and
 *   st_acc = alpha * st_acc + acc (one FMA).
 * The next chunk's rows are prefetched (prefetch_next, one row per row) while the scales are read
 * in v8_weights, not in the product loop: there, 4 tokens' prefetches per quad came in bursts
 * between short compute runs (A/B at load 0.9: medians 0.93-0.94x instead of 0.95-0.99x the
 * int8-scores time).
 * Error (per query m and output dim d, chunk c(d), before the division by the softmax denominator
 * l = sum_i P, sinks included): with w^ = wq * wsc and l^ = ls * lev the kernel computes
 * sum_i w^_{i,c(d)} l^_{i,d} for the exact sum_i w_{i,c(d)} level_{i,d}, so
 *   |o~_d - o_d| <= sum_i (wsc_{m,C(i)} / 2) |l^_{i,d}| + sum_i |w_{i,c(d)}| |l^_{i,d} - level_{i,d}|,
 * |l^ - level| <= ls / 2 (0 for integer levels within +-63), C(i) token i's chunk; plus fp32
 * rounding of the weights (relative ~2^-22) and of the sums. (The weight is the exact one in the
 * second term: with |w^| instead the bound fails where w rounds down to 0.) The test
 * (tests/test_cpu_int8_values.py) derives its tolerance from this bound and checks the kernel
 * against a float64 oracle of the same integer arithmetic. Measured gains: ops/cpu/__init__.py. */

/* The V side's integer view: its 7-bit levels (attention_i8.h) and, per X register x of a quad, the
   vpermi2b index and vpmultishiftqb control that take 4 tokens' code bytes straight to the
   interleaved layout (see vacc_i8_t). */
typedef struct {
    i8_ctx lv;
    __m512i idx[4];   /* byte (lane L, qword r, 2k + e) <- byte b0 + e of token k's 64-code pass */
    __m512i ctrl[2];  /* byte (lane L, qword r, 4jj + k) <- bits at 16k + (bits b0 offset) + bits * jj;
                         the offset depends on x only through its parity (3-bit codes) */
} v8_ctx;

static void v8_ctx_init(v8_ctx *c, const pkv_side *sd, int H, int D) {
    memset(c, 0, sizeof *c);
    i8_ctx_init(&c->lv, sd, H, D);
    if (!c->lv.ok) return;
    const int bits = sd->bits;
    for (int x = 0; x < 4; x++) {
        uint8_t idx[64], ctl[64];
        for (int L = 0; L < 4; L++)
            for (int r = 0; r < 2; r++) {
                const int j = 16 * L + 4 * x + 2 * r, b0 = bits * j / 8, o = bits * j % 8;  /* first code of the pair */
                for (int k = 0; k < 4; k++) {
                    for (int e = 0; e < 2; e++)  /* tokens 0, 1 in the first table (bytes 0 / 32), 2, 3 in the second */
                        idx[16 * L + 8 * r + 2 * k + e] = (uint8_t)(64 * (k >> 1) + 32 * (k & 1) + b0 + e);
                    for (int jj = 0; jj < 2; jj++) ctl[16 * L + 8 * r + 4 * jj + k] = (uint8_t)(16 * k + o + bits * jj);
                }
            }
        c->idx[x] = _mm512_loadu_si512(idx);
        if (x < 2) c->ctrl[x] = _mm512_loadu_si512(ctl);
    }
}

/* Quantized weights of one chunk and kv head for all M queries: wq [M][ng][nc][16] (chunk c of group
   g: its 16 tokens' s8 weights; byte n = 4b + k: token 4k + b, so that dword q of a 128-bit lane
   holds tokens q, q+4, q+8, q+12, one quad of vacc_i8_t), wls [M] (wsc * ls) and wcor [M][np][16]
   (the offset correction of each 64-dim pass: -64 * the weight sum of lane L's chunk, in all 4 of
   its dwords). Each token's scales of a 64-dim pass (4 floats, contiguous) are loaded as one
   128-bit block (tokens i >= nt: zero, no read) and 16 tokens' blocks transposed in registers (4x4
   dwords per block: the result's lane order is that token order). sv [ng][nc][16]: the transposed
   scales (kept between the two passes: wmax needs every token first). */
static void v8_weights(const i8_ctx *c, const pkv_rows *rw, int h, int nt, int H, int D, int M, const float *P,
                       int BSP, float *sv, int8_t *wq, float *wls, int32_t *wcor, int rd) {
    const int nc = D >> 4, np = D >> 6, ng = BSP >> 4;
    const __m512i tord = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m512 absm = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    __m512 wm[SMALL_M];
    for (int m = 0; m < M; m++) wm[m] = _mm512_setzero_ps();
    for (int g = 0; g < ng; g++) {
        const int g0 = 16 * g, n16 = imin(16, nt - g0);
        for (int t = 0; t < n16; t++) prefetch_next(rw, g0 + t, (int64_t)h * rd, rd);  /* see the file comment */
        __m512 smax = _mm512_setzero_ps();
        for (int p = 0; p < np; p++) {
            __m512 R[4];
            const float *s0 = rw->scl + ((int64_t)g0 * H + h) * nc + 4 * p;
            const int64_t ts = (int64_t)H * nc;  /* floats from one token's scales to the next's */
            if (n16 == 16) {
                for (int k = 0; k < 4; k++) {  /* R[k] block b: token 4k + b, chunks 4p .. 4p+3 */
                    const float *sk = s0 + 4 * k * ts;
                    const __m256 lo = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(sk)), _mm_loadu_ps(sk + ts), 1);
                    const __m256 hi = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(sk + 2 * ts)), _mm_loadu_ps(sk + 3 * ts), 1);
                    R[k] = _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
                }
            } else {
                for (int k = 0; k < 4; k++) {
                    R[k] = _mm512_setzero_ps();
                    for (int b = 0; b < 4; b++)
                        if (4 * k + b < n16) R[k] = _mm512_insertf32x4(R[k], _mm_loadu_ps(s0 + (4 * k + b) * ts), b);
                }
            }
            const __m512 t0 = _mm512_unpacklo_ps(R[0], R[1]), t1 = _mm512_unpackhi_ps(R[0], R[1]);
            const __m512 t2 = _mm512_unpacklo_ps(R[2], R[3]), t3 = _mm512_unpackhi_ps(R[2], R[3]);
            const __m512 u[4] = {_mm512_shuffle_ps(t0, t2, 0x44), _mm512_shuffle_ps(t0, t2, 0xEE),
                                 _mm512_shuffle_ps(t1, t3, 0x44), _mm512_shuffle_ps(t1, t3, 0xEE)};
            for (int j = 0; j < 4; j++) {  /* u[j] lane 4b + k: chunk 4p + j of token 4k + b */
                _mm512_store_ps(sv + ((int64_t)g * nc + 4 * p + j) * 16, u[j]);
                smax = _mm512_max_ps(smax, _mm512_and_ps(u[j], absm));
            }
        }
        for (int m = 0; m < M; m++)
            wm[m] = _mm512_max_ps(wm[m], _mm512_mul_ps(_mm512_permutexvar_ps(tord, _mm512_load_ps(P + (int64_t)m * BSP + g0)), smax));
    }
    for (int m = 0; m < M; m++) {
        const float wmax = _mm512_reduce_max_ps(wm[m]);
        int8_t *dst = wq + (int64_t)m * ng * nc * 16;
        int32_t *cor = wcor + (int64_t)m * np * 16;
        if (!(wmax > 0.0f) || !isfinite(wmax)) {
            wls[m] = 0.0f;
            memset(dst, 0, (size_t)ng * nc * 16);
            memset(cor, 0, sizeof(int32_t) * (size_t)np * 16);
            continue;
        }
        wls[m] = wmax / 127.0f * c->ls;
        const __m512 inv = _mm512_set1_ps(127.0f / wmax);
        for (int p = 0; p < np; p++) {
            __m512i cs = _mm512_setzero_si512();  /* 64 * the weights' sums, 4 tokens per dword */
            for (int g = 0; g < ng; g++) {
                const __m512 a = _mm512_mul_ps(_mm512_permutexvar_ps(tord, _mm512_load_ps(P + (int64_t)m * BSP + 16 * g)), inv);
                const float *s4 = sv + ((int64_t)g * nc + 4 * p) * 16;
                __m512i r[4];
                for (int j = 0; j < 4; j++) r[j] = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_load_ps(s4 + 16 * j)));
                /* packs (saturating, per 128-bit lane): dword j of lane L <- chunk j's lanes 4L .. 4L+3;
                   the dword transpose (the same index as the token order) puts chunk j in lane j */
                const __m512i b = _mm512_permutexvar_epi32(
                    tord, _mm512_packs_epi16(_mm512_packs_epi32(r[0], r[1]), _mm512_packs_epi32(r[2], r[3])));
                _mm512_store_si512(dst + ((int64_t)g * nc + 4 * p) * 16, b);
                cs = i8_dot(cs, _mm512_set1_epi8(64), b);
            }
            /* the offset correction: -64 * each chunk's weight sum (the lane's 4 dwords), in all 4 dwords */
            cs = _mm512_add_epi32(cs, _mm512_shuffle_epi32(cs, (_MM_PERM_ENUM)0x4E));
            cs = _mm512_add_epi32(cs, _mm512_shuffle_epi32(cs, (_MM_PERM_ENUM)0xB1));
            _mm512_store_si512(cor + 16 * p, _mm512_sub_epi32(_mm512_setzero_si512(), cs));
        }
    }
}

/* Dword q of each 128-bit lane broadcast to the lane's 4 dwords (vpshufd needs an immediate). */
PKV_INLINE __m512i v8_quad(__m512i w, int q) {
    switch (q) {
    case 0: return _mm512_shuffle_epi32(w, (_MM_PERM_ENUM)0x00);
    case 1: return _mm512_shuffle_epi32(w, (_MM_PERM_ENUM)0x55);
    case 2: return _mm512_shuffle_epi32(w, (_MM_PERM_ENUM)0xAA);
    default: return _mm512_shuffle_epi32(w, (_MM_PERM_ENUM)0xFF);
    }
}

/* One 16-token group of vacc_i8_t (full: all 16 tokens exist, compile-time): 4 quads of tokens
   q, q+4 (A: bytes 0, 32) and q+8, q+12 (B), their levels interleaved by vpermi2b + vpmultishiftqb
   + the level table, MM x 4 vpdpbusd each. Tokens past the chunk (not full) read nothing (masked
   loads; their weights are 0). */
PKV_INLINE void v8_group(const int bits, const int MM, const int full, const pkv_rows *rw, int g0, int n16,
                         int64_t hoff, int p, __mmask64 lmask, const int8_t *wg, int64_t wstride,
                         __m512i lut, __m512i c0, __m512i c1, const __m512i ix[4], __m512i ai[4][4]) {
#pragma GCC unroll 4
    for (int q = 0; q < 4; q++) {
        const uint8_t *r[4];
        __mmask64 km[4];
        for (int k = 0; k < 4; k++) {
            const int t = q + 4 * k, ok = full || t < n16;
            km[k] = ok ? lmask : 0;
            r[k] = rw->data[g0 + (ok ? t : 0)] + hoff + 8 * bits * p;  /* not read when !ok */
        }
        const __m512i A = _mm512_mask_loadu_epi8(_mm512_maskz_loadu_epi8(km[0], r[0]), km[1] << 32, r[1] - 32);
        const __m512i B = _mm512_mask_loadu_epi8(_mm512_maskz_loadu_epi8(km[2], r[2]), km[3] << 32, r[3] - 32);
        __m512i wb[4];
        for (int m = 0; m < MM; m++) wb[m] = v8_quad(_mm512_load_si512(wg + m * wstride), q);
        for (int x = 0; x < 4; x++) {
            const __m512i X = _mm512_permutexvar_epi8(
                _mm512_multishift_epi64_epi8(x & 1 ? c1 : c0, _mm512_permutex2var_epi8(A, ix[x], B)), lut);
            for (int m = 0; m < MM; m++) ai[m][x] = i8_dot(ai[m][x], X, wb[m]);
        }
    }
}

/* st_acc[m] = alpha[m] * st_acc[m] + wsc * ls * sum_i wq_i lev_i for MM (compile-time, <= 4) query
   vectors, weights from v8_weights (wq, wls: this block's first query); see the file comment. */
PKV_INLINE void vacc_i8_t(const int bits, const int MM, const pkv_side *sd, const v8_ctx *ic, const pkv_rows *rw,
                          int h, int nt, int D, const float *alpha, const int8_t *wq, const float *wls,
                          const int32_t *wcor, int BSP, float *st_acc) {
    /* the tables in locals (kept in registers: stores through st_acc cannot alias them) */
    const __m512i lut = ic->lv.lut, c0 = ic->ctrl[0], c1 = ic->ctrl[1];
    const __m512i ix[4] = {ic->idx[0], ic->idx[1], ic->idx[2], ic->idx[3]};
    const int np = D >> 6, nc = D >> 4, ng = BSP >> 4, rd = sd->row_data_bytes;
    const int64_t hoff = (int64_t)h * rd;
    const __mmask64 lmask = (1ull << (8 * bits)) - 1u;  /* a token's 8 * bits code bytes of one pass */
    for (int p = 0; p < np; p++) {
        __m512i ai[4][4];
        for (int m = 0; m < MM; m++) {  /* the offset correction (v8_weights) */
            const __m512i cor = _mm512_load_si512(wcor + ((int64_t)m * np + p) * 16);
            for (int x = 0; x < 4; x++) ai[m][x] = cor;
        }
        for (int g = 0; g < ng; g++) {
            const int g0 = 16 * g, n16 = imin(16, nt - g0);
            const int8_t *wg = wq + ((int64_t)g * nc + 4 * p) * 16;
            if (n16 == 16) v8_group(bits, MM, 1, rw, g0, 16, hoff, p, lmask, wg, (int64_t)ng * nc * 16, lut, c0, c1, ix, ai);
            else v8_group(bits, MM, 0, rw, g0, n16, hoff, p, lmask, wg, (int64_t)ng * nc * 16, lut, c0, c1, ix, ai);
        }
        for (int m = 0; m < MM; m++) {
            const __m512 f = _mm512_set1_ps(wls[m]);
            __m512 af[4];
            for (int x = 0; x < 4; x++) af[x] = _mm512_mul_ps(_mm512_cvtepi32_ps(ai[m][x]), f);
            /* af[x] block L = dims 16L+4x .. +3: a 4x4 transpose of 128-bit blocks */
            const __m512 t0 = _mm512_shuffle_f32x4(af[0], af[1], 0x44), t1 = _mm512_shuffle_f32x4(af[0], af[1], 0xEE);
            const __m512 t2 = _mm512_shuffle_f32x4(af[2], af[3], 0x44), t3 = _mm512_shuffle_f32x4(af[2], af[3], 0xEE);
            const __m512 o[4] = {_mm512_shuffle_f32x4(t0, t2, 0x88), _mm512_shuffle_f32x4(t0, t2, 0xDD),
                                 _mm512_shuffle_f32x4(t1, t3, 0x88), _mm512_shuffle_f32x4(t1, t3, 0xDD)};
            const __m512 al = _mm512_set1_ps(alpha[m]);
            float *st = st_acc + (int64_t)m * D + 64 * p;
            for (int L = 0; L < 4; L++) _mm512_store_ps(st + 16 * L, _mm512_fmadd_ps(_mm512_load_ps(st + 16 * L), al, o[L]));
        }
    }
}

#define PKV_V8_M(B)                                                                                          \
    for (int m0 = 0; m0 < M; m0 += 4) {                                                                      \
        const int mm = imin(4, M - m0);                                                                      \
        const int8_t *w8 = wq + (int64_t)m0 * ng * nc * 16;                                                  \
        const int32_t *wc = wcor + (int64_t)m0 * (D >> 6) * 16;                                              \
        const float *wl = wls + m0, *al = alpha + m0;                                                        \
        float *st = st_acc + (int64_t)m0 * D;                                                                \
        if (mm == 4) vacc_i8_t(B, 4, sd, c, rw, h, nt, D, al, w8, wl, wc, BSP, st);                          \
        else if (mm == 3) vacc_i8_t(B, 3, sd, c, rw, h, nt, D, al, w8, wl, wc, BSP, st);                     \
        else if (mm == 2) vacc_i8_t(B, 2, sd, c, rw, h, nt, D, al, w8, wl, wc, BSP, st);                     \
        else vacc_i8_t(B, 1, sd, c, rw, h, nt, D, al, w8, wl, wc, BSP, st);                                  \
    }
/* The integer P.V of one chunk and kv head (M <= SMALL_M queries, D a multiple of 64): weights, then
   at most 4 queries per pass over the chunk's levels (their accumulators stay in registers).
   Scratch: sv [BSP/16][D/16][16] floats, wq [M][BSP/16][D/16][16] bytes, wls [M], wcor [M][D/64][16]. */
static void vacc_i8(const pkv_side *sd, const v8_ctx *c, const pkv_rows *rw, int h, int nt, int H, int D, int M,
                    const float *P, int BSP, float *st_acc, const float *alpha, float *sv, int8_t *wq, float *wls,
                    int32_t *wcor) {
    const int nc = D >> 4, ng = BSP >> 4;
    v8_weights(&c->lv, rw, h, nt, H, D, M, P, BSP, sv, wq, wls, wcor, sd->row_data_bytes);
    switch (sd->bits) {
    case 2: PKV_V8_M(2) break;
    case 3: PKV_V8_M(3) break;
    default: PKV_V8_M(4) break;
    }
}
#undef PKV_V8_M
