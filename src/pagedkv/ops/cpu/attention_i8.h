/* Approximate integer scores for the SIMD decode paths (included by attention_kernel.c after its
 * AVX2 / AVX-512 sections; `AttentionParams.int8_scores`, off by default), and, on AVX-512, the
 * EXACT decode scores over the same table keys in the same tokens-in-lanes layout (scores_lut_t,
 * the default path for them, below).
 *
 * Only for K sides whose codes are 2/3/4/5-bit table lookups with per-group scales (turbo*, q4_0,
 * ...), head_dim a multiple of 32, few query vectors per task (decode). What changes:
 * - each query vector q (fp32, already scaled) is quantized once per call: q8 = round(q / sq),
 *   sq = max|q| / 127;
 * - the code levels become 7-bit integers: L = round(level / ls) + 64 in [1, 127] with
 *   ls = max|level| / 63 (ls = 1, exact, when the levels are integers within +-63);
 * - AVX2: a K row's 32 codes become 32 bytes (a byte shuffle puts each code's 16-bit window in a
 *   word, a multiply by a power of two and a shift isolate it, a pack and a shuffle look the
 *   level up; 5-bit codes: 20 bytes, each 128-bit lane loads its own 16, and two shuffles blended
 *   on bit 4 look up the 32 levels); vpmaddubsw (u8 levels x s8 query: pairs <= 2 * 127 * 127,
 *   no saturation) and vpmaddwd with ones give 8 int32 sums of 4 products (lanes 0-3: the first
 *   16 dims, 4-7: the next 16);
 * - AVX-512: 64 codes become 64 bytes in three ops (vpermb moves the bytes holding codes 8Q ..
 *   8Q+7 into qword Q, vpmultishiftqb puts code j's bits at the bottom of byte j, vpermb looks the
 *   level up in a 64-entry replicated table); 16 tokens' level rows are transposed as dwords
 *   (tokens in the lanes), and vpdpbusd (VNNI; without it vpmaddubsw + vpmaddwd) against 4 query
 *   bytes broadcast adds 4 products to each token's lane: no horizontal sums;
 * - the offset 64 is taken out exactly (the accumulator starts at -64 * the query's sum over the
 *   same dims, precomputed); then one fp32 multiply / FMA per 8 / 16 lanes applies the group
 *   scales.
 * Score error: |ds| <= (sq / 2) * sum_d |k_d| + (ls / 2) * sum_d |q_d| * scale_group(d)
 * (the query's rounding against the stored key, the level's rounding against the query); the
 * test derives its tolerance from this bound. Measured gains: ops/cpu/__init__.py (docstring). */

/* The 7-bit image of a side's levels: lut[e] = round(table[e] / ls) + 64 for the 64 first entries
   of the replicated table, *ls the value of one unit. 0: this side has no integer path. */
static int i8_levels(const pkv_side *sd, int D, float *ls, uint8_t lut[64]) {
    if (sd->kind != EK_LUT || sd->bits > 5 || !sd->group || D % 32) return 0;
    float amax = 0.0f;
    int integral = 1;
    for (int e = 0; e < 32; e++) {  /* every level (tables are replicated: entry e = code e mod 2^bits) */
        float v = fabsf(sd->table[e]);
        amax = v > amax ? v : amax;
        integral &= sd->table[e] == rintf(sd->table[e]);
    }
    if (!(amax > 0.0f) || !isfinite(amax)) return 0;
    *ls = integral && amax <= 63.0f ? 1.0f : amax / 63.0f;
    for (int e = 0; e < 64; e++) {
        long v = lrintf(sd->table[e] / *ls);
        v = v < -63 ? -63 : v > 63 ? 63 : v;
        lut[e] = (uint8_t)(v + 64);
    }
    return 1;
}

/* Quantize the n query vectors q[n][D] into q8[n][D], qc[n][D/4] (-64 * sum of each 4 dims: the
   accumulator's start) and qmul[n] = sq * ls (the factor a raw integer score is multiplied by). */
static void i8_prepare_queries(float ls, const float *q, int n, int D, int8_t *q8, int32_t *qc, float *qmul) {
    for (int m = 0; m < n; m++) {
        const float *x = q + (int64_t)m * D;
        float amax = 0.0f;
        for (int d = 0; d < D; d++) amax = fabsf(x[d]) > amax ? fabsf(x[d]) : amax;
        const float sq = amax > 0.0f && isfinite(amax) ? amax / 127.0f : 1.0f;
        int8_t *y = q8 + (int64_t)m * D;
        for (int d = 0; d < D; d++) {
            long v = lrintf(x[d] / sq);
            y[d] = (int8_t)(v < -127 ? -127 : v > 127 ? 127 : v);
        }
        for (int j = 0; j < D / 4; j++)
            qc[(int64_t)m * (D / 4) + j] = -64 * (y[4 * j] + y[4 * j + 1] + y[4 * j + 2] + y[4 * j + 3]);
        qmul[m] = sq * ls;
    }
}

#ifdef PKV_AVX2
typedef struct {
    __m256i lut8;         /* 16-entry u8 level table (levels / ls + 64), both lanes */
    __m256i lut8hi;       /* 5-bit codes: entries 16-31, both lanes */
    __m256i idx_a, idx_b;  /* byte shuffles: word k of lane L <- the window of code 16L + k (+8 for b);
                             5-bit codes: lane 1 holds the chunk's bytes from I8_LANE1_5 on */
    __m256i mul_a, mul_b;  /* 2^(16 - bits - shift) per word */
    __m128i tail;         /* dword mask of a chunk's 4 * bits bytes (the row's last chunk) */
    float ls;             /* value of one level unit */
    int ok;               /* 1: this side takes the integer path */
} i8_ctx;

#define I8_LANE1_5 4  /* 5-bit codes: lane 1 loads bytes 4-19 of the chunk's 20 (codes 16-31 are in 10-19) */
static void i8_ctx_init(i8_ctx *c, const pkv_side *sd, int H, int D) {
    (void)H;
    memset(c, 0, sizeof *c);
    uint8_t lut[64], ia[32], ib[32];
    if (!i8_levels(sd, D, &c->ls, lut)) return;
    const int bits = sd->bits;
    int16_t ma[16], mb[16];
    for (int L = 0; L < 2; L++)
        for (int k = 0; k < 8; k++)
            for (int half = 0; half < 2; half++) {
                const int j = 16 * L + 8 * half + k, s = (bits * j) % 8;
                const int p = (bits * j) / 8 - (bits == 5 && L ? I8_LANE1_5 : 0);
                uint8_t *ix = half ? ib : ia;
                int16_t *mu = half ? mb : ma;
                ix[16 * L + 2 * k] = (uint8_t)p;
                ix[16 * L + 2 * k + 1] = s + bits > 8 ? (uint8_t)(p + 1) : 0x80;
                mu[8 * L + k] = (int16_t)(1 << (16 - bits - s));
            }
    c->lut8hi = _mm256_loadu_si256((const __m256i *)(lut + 16));  /* before lut[16..31] is overwritten */
    c->lut8hi = _mm256_permute2x128_si256(c->lut8hi, c->lut8hi, 0x00);
    memcpy(lut + 16, lut, 16);
    c->lut8 = _mm256_loadu_si256((const __m256i *)lut);
    c->idx_a = _mm256_loadu_si256((const __m256i *)ia);
    c->idx_b = _mm256_loadu_si256((const __m256i *)ib);
    c->mul_a = _mm256_loadu_si256((const __m256i *)ma);
    c->mul_b = _mm256_loadu_si256((const __m256i *)mb);
    int32_t tm[4];
    for (int w = 0; w < 4; w++) tm[w] = w < bits ? -1 : 0;
    c->tail = _mm_loadu_si128((const __m128i *)tm);
    c->ok = 1;
}
/* 32 codes (chunk c of a row of rd bytes) -> 32 u8 levels */
PKV_INLINE __m256i i8_levels32(const int bits, const i8_ctx *c, const uint8_t *drow, int ch, int rd) {
    const int off = 4 * bits * ch;
    __m256i w;
    if (bits == 5) {  /* 20 bytes: lane 0 loads bytes 0-15, lane 1 bytes 4-19 (nothing past the chunk) */
        const __m128i x0 = _mm_loadu_si128((const __m128i *)(drow + off));
        const __m128i x1 = _mm_loadu_si128((const __m128i *)(drow + off + I8_LANE1_5));
        w = _mm256_inserti128_si256(_mm256_castsi128_si256(x0), x1, 1);
    } else {
        const __m128i x = off + 16 <= rd ? _mm_loadu_si128((const __m128i *)(drow + off))
                                         : _mm_maskload_epi32((const int *)(drow + off), c->tail);
        w = _mm256_broadcastsi128_si256(x);
    }
    const __m256i a = _mm256_srli_epi16(_mm256_mullo_epi16(_mm256_shuffle_epi8(w, c->idx_a), c->mul_a), 16 - bits);
    const __m256i b = _mm256_srli_epi16(_mm256_mullo_epi16(_mm256_shuffle_epi8(w, c->idx_b), c->mul_b), 16 - bits);
    const __m256i codes = _mm256_packus_epi16(a, b);
    if (bits < 5) return _mm256_shuffle_epi8(c->lut8, codes);
    /* 32 levels: vpshufb reads 4 index bits; bit 4 (moved to bit 7 of its byte) picks the half */
    return _mm256_blendv_epi8(_mm256_shuffle_epi8(c->lut8, codes), _mm256_shuffle_epi8(c->lut8hi, codes),
                              _mm256_slli_epi16(codes, 3));
}

/* Raw scores S[m][i] ~ q_m . k_i of the nt rows of a chunk (M <= SMALL_M query vectors), as
   scores_dot_t but in integers; partial vectors [M][BSP][8] reduced 8 tokens at a time. */
PKV_INLINE void scores_i8_t(const int bits, const pkv_side *sd, const i8_ctx *c, const pkv_rows *rw, int h,
                            int nt, int H, int D, int M, const int8_t *q8, const int32_t *qc,
                            const float *qmul, float *part, float *S, int BSP) {
    const int n32 = D >> 5, nc = D >> 4, rd = sd->row_data_bytes;
    const int64_t hoff = (int64_t)h * rd;
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i sidx = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    for (int i = 0; i < nt; i++) {
        prefetch_next(rw, i, hoff, rd);
        const uint8_t *drow = rw->data[i] + hoff;
        const float *scl = rw->scl + ((int64_t)i * H + h) * nc;
        int ch = 0;
        for (; ch + 2 <= n32; ch += 2) {  /* 64 dims per pass: one store per query */
            const __m256i k0 = i8_levels32(bits, c, drow, ch, rd), k1 = i8_levels32(bits, c, drow, ch + 1, rd);
            const __m256 s0 = _mm256_permutevar8x32_ps(_mm256_castpd_ps(_mm256_broadcast_sd((const double *)(scl + 2 * ch))), sidx);
            const __m256 s1 = _mm256_permutevar8x32_ps(_mm256_castpd_ps(_mm256_broadcast_sd((const double *)(scl + 2 * ch + 2))), sidx);
            for (int m = 0; m < M; m++) {
                const int8_t *qm = q8 + (int64_t)m * D + 32 * ch;
                const int32_t *cm = qc + (int64_t)m * (D / 4) + 8 * ch;
                __m256i t0 = _mm256_madd_epi16(_mm256_maddubs_epi16(k0, _mm256_loadu_si256((const __m256i *)qm)), ones);
                __m256i t1 = _mm256_madd_epi16(_mm256_maddubs_epi16(k1, _mm256_loadu_si256((const __m256i *)(qm + 32))), ones);
                t0 = _mm256_add_epi32(t0, _mm256_loadu_si256((const __m256i *)cm));
                t1 = _mm256_add_epi32(t1, _mm256_loadu_si256((const __m256i *)(cm + 8)));
                __m256 acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t1), s1, _mm256_mul_ps(_mm256_cvtepi32_ps(t0), s0));
                float *dst = part + ((int64_t)m * BSP + i) * 8;
                if (ch) acc = _mm256_add_ps(acc, _mm256_load_ps(dst));
                _mm256_store_ps(dst, acc);
            }
        }
        for (; ch < n32; ch++) {  /* the last 32 dims (D an odd multiple of 32) */
            const __m256i k = i8_levels32(bits, c, drow, ch, rd);
            const __m256 sv = _mm256_permutevar8x32_ps(_mm256_castpd_ps(_mm256_broadcast_sd((const double *)(scl + 2 * ch))), sidx);
            for (int m = 0; m < M; m++) {
                const __m256i qv = _mm256_loadu_si256((const __m256i *)(q8 + (int64_t)m * D + 32 * ch));
                __m256i t = _mm256_madd_epi16(_mm256_maddubs_epi16(k, qv), ones);
                t = _mm256_add_epi32(t, _mm256_loadu_si256((const __m256i *)(qc + (int64_t)m * (D / 4) + 8 * ch)));
                float *dst = part + ((int64_t)m * BSP + i) * 8;
                const __m256 prev = ch ? _mm256_load_ps(dst) : _mm256_setzero_ps();
                _mm256_store_ps(dst, _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), sv, prev));
            }
        }
    }
    for (int m = 0; m < M; m++) {
        float *pm = part + (int64_t)m * BSP * 8;
        const __m256 f = _mm256_set1_ps(qmul[m]);
        for (int i = nt; i < BSP; i++) _mm256_store_ps(pm + 8 * i, _mm256_setzero_ps());
        for (int g = 0; g < BSP / 8; g++) _mm256_store_ps(S + (int64_t)m * BSP + 8 * g, _mm256_mul_ps(hsum8(pm + 64 * g), f));
    }
}

static void scores_i8(const pkv_side *sd, const i8_ctx *c, const pkv_rows *rw, int h, int nt, int H, int D, int M,
                      const int8_t *q8, const int32_t *qc, const float *qmul, float *part, float *S, int BSP) {
    switch (sd->bits) {
    case 2: scores_i8_t(2, sd, c, rw, h, nt, H, D, M, q8, qc, qmul, part, S, BSP); break;
    case 3: scores_i8_t(3, sd, c, rw, h, nt, H, D, M, q8, qc, qmul, part, S, BSP); break;
    case 5: scores_i8_t(5, sd, c, rw, h, nt, H, D, M, q8, qc, qmul, part, S, BSP); break;
    default: scores_i8_t(4, sd, c, rw, h, nt, H, D, M, q8, qc, qmul, part, S, BSP); break;
    }
}
#endif /* PKV_AVX2 */

#ifdef PKV_AVX512
typedef struct {
    __m512i spread;  /* vpermb: qword Q <- the code bytes bits * Q .. bits * Q + 7 (codes 8Q .. 8Q+7) */
    __m512i mshift;  /* vpmultishiftqb: byte j of a qword <- its bits from bits * j */
    __m512i lut;     /* 64-entry u8 level table (levels / ls + 64, replicated) */
    __m512i sidx[4]; /* i8_scales_t: byte 16u + t <- t * n + 4r + u (sidx[r], n scales per token) */
    int sfast;       /* 1: a block's scale bytes transpose by byte permutes (E4M3, one per chunk, n <= 16) */
    float ls;        /* value of one level unit */
    int ok;          /* 1: this side takes the integer path */
} i8_ctx;

static void i8_ctx_init(i8_ctx *c, const pkv_side *sd, int H, int D) {
    memset(c, 0, sizeof *c);
    uint8_t lut[64], sp[64], ms[64], si[64];
    if (!i8_levels(sd, D, &c->ls, lut)) return;
    const int bits = sd->bits;
    for (int Q = 0; Q < 8; Q++)
        for (int k = 0; k < 8; k++) {
            sp[8 * Q + k] = (uint8_t)imin(bits * Q + k, 63);
            ms[8 * Q + k] = (uint8_t)(bits * k);
        }
    c->lut = _mm512_loadu_si512(lut);
    c->spread = _mm512_loadu_si512(sp);
    c->mshift = _mm512_loadu_si512(ms);
    const int n = H * (D >> 4);
    c->sfast = sd->scale_kind == SC_E4M3 && sd->group == 16 && n <= 16;
    for (int r = 0; r < 4 && c->sfast; r++) {
        for (int u = 0; u < 4; u++)
            for (int t = 0; t < 16; t++) si[16 * u + t] = (uint8_t)(4 * r + u < n ? t * n + 4 * r + u : 0);
        c->sidx[r] = _mm512_loadu_si512(si);
    }
    c->ok = 1;
}

/* The K side's group scales of a chunk for scores_i8_t, transposed: rows->sclt[o][i] = the scale
   of chunk o = h * nc + c of token i (zero-padded to 16 tokens). A 16-token group whose scales are
   one run of bytes (a block's, E4M3, one per 16 values, at most 16 per token: SmolLM2's 3 heads x 4)
   takes 3 byte permutes per 4 outputs from up to 256 raw bytes, then E4M3 -> fp32 per 16: no
   decode into rows->scl. Otherwise the scales are decoded there (decode_scales) and transposed
   16 x 16 in registers. Replaces 4 gathers per 16 tokens and kv head (~13% of scores_i8_t). */
static void i8_scales_t(const pkv_side *sd, const i8_ctx *c, pkv_rows *rows, int nt, int H, int D) {
    const int nc = D >> 4, n = H * nc, ld = rows->sclt_ld;
    float *out = rows->sclt;
    int decoded = 0;
    for (int g0 = 0; g0 < nt; g0 += 16) {
        const int n16 = imin(16, nt - g0);
        const uint8_t *s0 = rows->sraw[g0];
        int run = c->sfast;
        for (int t = 1; t < n16 && run; t++) run = rows->sraw[g0 + t] == s0 + (int64_t)t * n;
        if (run) {
            __m512i x[4];
            for (int q = 0; q < 4; q++) {
                const int nb = imin(64, imax(0, n16 * n - 64 * q));
                x[q] = nb ? _mm512_maskz_loadu_epi8(nb == 64 ? ~0ull : (1ull << nb) - 1u, s0 + 64 * q) : _mm512_setzero_si512();
            }
            for (int r = 0; 4 * r < n; r++) {
                const __m512i lo = _mm512_permutex2var_epi8(x[0], c->sidx[r], x[1]);
                const __m512i hi = _mm512_permutex2var_epi8(x[2], c->sidx[r], x[3]);
                const __m512i y = _mm512_mask_mov_epi8(lo, _mm512_movepi8_mask(c->sidx[r]), hi);
                const __m128i l4[4] = {_mm512_castsi512_si128(y), _mm512_extracti32x4_epi32(y, 1),
                                       _mm512_extracti32x4_epi32(y, 2), _mm512_extracti32x4_epi32(y, 3)};
                for (int u = 0; u < 4 && 4 * r + u < n; u++)
                    _mm512_store_ps(out + (int64_t)(4 * r + u) * ld + g0, _mm512_mul_ps(e4m3x16(l4[u]), _mm512_set1_ps(256.0f)));
            }
            continue;
        }
        if (!decoded) decode_scales(sd, rows, nt, H, D), decoded = 1;
        for (int o0 = 0; o0 < n; o0 += 16) {
            const int w = imin(16, n - o0);
            const __mmask16 k = (__mmask16)(w == 16 ? 0xffff : (1u << w) - 1u);
            __m512 r[16];
            for (int t = 0; t < 16; t++)
                r[t] = t < n16 ? _mm512_maskz_loadu_ps(k, rows->scl + (int64_t)(g0 + t) * n + o0) : _mm512_setzero_ps();
            transpose16_regs(r);
            for (int o = 0; o < w; o++) _mm512_store_ps(out + (int64_t)(o0 + o) * ld + g0, r[o]);
        }
    }
}

/* 64 codes (dims 64p .. 64p+63 of a row; n <= 64 of them read, the rest of the bytes zero) -> 64
   bytes, byte j's low bits holding code j (the next code's bits above): 8 * bits bytes loaded
   (n = 32: 4 * bits; load_codes), vpermb + vpmultishiftqb (a vpermb through c->lut then gives the
   7-bit levels: see the file comment; its 64 entries repeat every 2^bits, so the next code's bits
   above a code's are harmless there too). */
PKV_INLINE __m512i i8_codes64(const int bits, const i8_ctx *c, const uint8_t *drow, int p, int n) {
    const __m512i x = load_codes(bits, n / 8 * bits, drow + 8 * bits * p);
    return _mm512_multishift_epi64_epi8(c->mshift, _mm512_permutexvar_epi8(c->spread, x));
}

/* acc + 16 sums of 4 products u8 a x s8 b */
PKV_INLINE __m512i i8_dot(__m512i acc, __m512i a, __m512i b) {
#ifdef __AVX512VNNI__
    return _mm512_dpbusd_epi32(acc, a, b);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(a, b), _mm512_set1_epi16(1)));
#endif
}

/* 16 vectors of 16 dwords transposed in registers: x[k] lane t <- x[t] lane k (transpose16_regs
   on integer data). */
PKV_INLINE void transpose16i(__m512i x[16]) {
    __m512 r[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_castsi512_ps(x[i]);
    transpose16_regs(r);
    for (int i = 0; i < 16; i++) x[i] = _mm512_castps_si512(r[i]);
}

/* The 16 rows g0 .. g0+15 of a 64-dim pass (n dims read), transposed as dwords: L[k] lane t holds
   dims 4k .. 4k+3 of row g0 + t, as code bytes (levels = 0: byte j's low bits hold code j, the
   next code's bits above) or as their 7-bit levels (levels = 1); rows past n16 are zero and read
   nothing; the first pass prefetches the next chunk's 16 rows (prefetch16). */
PKV_INLINE void i8_pass16(const int bits, const int levels, const i8_ctx *c, const pkv_rows *rw, int g0, int n16,
                          int64_t hoff, int rd, int p, int n, __m512i L[16]) {
    if (p == 0) prefetch16(rw, g0, hoff, rd);
    const uint8_t *const *dp = rw->data + g0;
    if (n16 == 16) {  /* a full group: no per-row test */
#pragma GCC unroll 16
        for (int t = 0; t < 16; t++) {
            const __m512i x = i8_codes64(bits, c, dp[t] + hoff, p, n);
            L[t] = levels ? _mm512_permutexvar_epi8(x, c->lut) : x;
        }
    } else {
#pragma GCC unroll 16
        for (int t = 0; t < 16; t++) {
            if (t < n16) {
                const __m512i x = i8_codes64(bits, c, dp[t] + hoff, p, n);
                L[t] = levels ? _mm512_permutexvar_epi8(x, c->lut) : x;
            } else {
                L[t] = _mm512_setzero_si512();
            }
        }
    }
    transpose16i(L);
}

/* Raw scores S[m][i] ~ q_m . k_i of the nt rows of a chunk (MM query vectors, compile-time), 16
   tokens at a time with the tokens in the lanes: the 16 rows' levels of a 64-dim pass (one
   register each, i8_pass16) are transposed as dwords, so that register k holds dims 4k .. 4k+3
   of every token; then per query one vpdpbusd per 4 dims against the query's 4 bytes broadcast
   (an embedded broadcast) accumulates each token's score in its own lane: no horizontal sums.
   Per 16-dim group the accumulator starts at the offset correction (-64 * the group's query
   sum), and one fp32 FMA with the 16 tokens' group scales (one load from rows->sclt,
   i8_scales_t) adds it to the query's scores. A last 32 dims (D an odd multiple of 32) read 32 codes (the
   other bytes zero) against the zero-padded query (stride D64 = D rounded up to 64). */
PKV_INLINE void scores_i8_t(const int bits, const int MM, const pkv_side *sd, const i8_ctx *ic, const pkv_rows *rw,
                            int h, int nt, int H, int D, const int8_t *q8, const int32_t *qc,
                            const float *qmul, float *S, int BSP) {
    const i8_ctx c = *ic;  /* a local copy, kept in registers (see scores_dot_t) */
    const int np = (D + 63) >> 6, D64 = np * 64, nc = D >> 4, rd = sd->row_data_bytes, ld = rw->sclt_ld;
    const int64_t hoff = (int64_t)h * rd;
    (void)H;
    for (int g0 = 0; g0 < nt; g0 += 16) {
        const int n16 = imin(16, nt - g0);
        const __mmask16 tm = (__mmask16)(n16 == 16 ? 0xffff : (1u << n16) - 1u);
        __m512 facc[4];
        for (int m = 0; m < MM; m++) facc[m] = _mm512_setzero_ps();
        for (int p = 0; p < np; p++) {
            const int n = imin(64, D - 64 * p);
            __m512i L[16];
            i8_pass16(bits, 1, &c, rw, g0, n16, hoff, rd, p, n, L);
            const float *sb = rw->sclt + ((int64_t)h * nc + 4 * p) * ld + g0;
            for (int z = 0; z < n / 16; z++) {
                const __m512 sv = _mm512_maskz_load_ps(tm, sb + (int64_t)z * ld);
                for (int m = 0; m < MM; m++) {
                    const int32_t *qw = (const int32_t *)(q8 + (int64_t)m * D64 + 64 * p) + 4 * z;
                    const int32_t *cz = qc + (int64_t)m * (D64 / 4) + 16 * p + 4 * z;
                    __m512i acc = _mm512_set1_epi32(cz[0] + cz[1] + cz[2] + cz[3]);
                    for (int k = 0; k < 4; k++) acc = i8_dot(acc, L[4 * z + k], _mm512_set1_epi32(qw[k]));
                    facc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), sv, facc[m]);
                }
            }
        }
        for (int m = 0; m < MM; m++) _mm512_store_ps(S + (int64_t)m * BSP + g0, _mm512_mul_ps(facc[m], _mm512_set1_ps(qmul[m])));
    }
}

/* EXACT fp32 scores over the same keys (2/3/4/5-bit table codes with group scales, head_dim a multiple
   of 64, MM <= 4 query vectors; the default path, not an approximation), with the integer path's
   layout: the 16 tokens' code bytes of a 64-dim pass (i8_pass16: byte j holds code j in its low
   bits, the next code's bits above) transposed as dwords, so register k holds dims 4k .. 4k+3 of
   every token; each dim's 16 codes are then one shift (byte b of the dword) + vpermps from the
   16-entry table away from 16 fp32 key values, and one FMA per query against the query's value
   broadcast adds them to 16 tokens' partial scores at once; per 16-dim group, one FMA with the 16
   tokens' scales (rows->sclt) adds the group to the scores. vpermps reads the index's low 4 bits
   only: the code's, with the next code's bits above bit `bits`, which the table replicated to 16
   entries ignores (5-bit codes: vpermt2ps reads 5 bits over the 32-entry table, lut16). Against
   scores_dot_t (decode64, a scale multiply per 16 values, partial vectors per token and a
   16-token reduction tree): no horizontal sums, no partial stores, the scale
   once per 16 tokens. Sums in another order than scores_dot_t's: exact fp32 both. Two
   accumulators per query (the 16-dim group's even and odd registers) halve the FMA chains
   (measured with benchmarks/perf/ab_decode_kernel.py: docs/performance.md). */
#ifndef PKV_LUT_ACC2
#define PKV_LUT_ACC2 1  /* 0: one accumulator per query, no unroll hint (A/B builds) */
#endif
PKV_INLINE void scores_lut_t(const int bits, const int MM, const pkv_side *sd, const i8_ctx *ic, const pkv_rows *rw,
                             int h, int nt, int D, const float *qv, float *S, int BSP) {
    const i8_ctx c = *ic;  /* a local copy, kept in registers (see scores_dot_t) */
    const __m512 table = _mm512_loadu_ps(sd->table), table_hi = _mm512_loadu_ps(sd->table + 16);
    const int np = D >> 6, nc = D >> 4, rd = sd->row_data_bytes, ld = rw->sclt_ld;
    const int64_t hoff = (int64_t)h * rd;
    for (int g0 = 0; g0 < nt; g0 += 16) {
        const int n16 = imin(16, nt - g0);
        const __mmask16 tm = (__mmask16)(n16 == 16 ? 0xffff : (1u << n16) - 1u);
        __m512 sacc[4];
        for (int m = 0; m < MM; m++) sacc[m] = _mm512_setzero_ps();
        for (int p = 0; p < np; p++) {
            __m512i L[16];
            i8_pass16(bits, 0, &c, rw, g0, n16, hoff, rd, p, 64, L);
            const float *sb = rw->sclt + ((int64_t)h * nc + 4 * p) * ld + g0;
#if PKV_LUT_ACC2
#pragma GCC unroll 4
#endif
            for (int z = 0; z < 4; z++) {
                __m512 acc[2][4];  /* two accumulators per query (alternate registers): shorter FMA chains */
                for (int u = 0; u < 2; u++)
                    for (int m = 0; m < MM; m++) acc[u][m] = _mm512_setzero_ps();
                for (int k = 0; k < 4; k++) {
                    const __m512i w = L[4 * z + k];
                    const __m512 v[4] = {lut16(bits, w, table, table_hi),
                                         lut16(bits, _mm512_srli_epi32(w, 8), table, table_hi),
                                         lut16(bits, _mm512_srli_epi32(w, 16), table, table_hi),
                                         lut16(bits, _mm512_srli_epi32(w, 24), table, table_hi)};
                    const int d = 64 * p + 16 * z + 4 * k, u = PKV_LUT_ACC2 ? k & 1 : 0;
                    for (int b = 0; b < 4; b++)
                        for (int m = 0; m < MM; m++)
                            acc[u][m] = _mm512_fmadd_ps(_mm512_set1_ps(qv[(int64_t)m * D + d + b]), v[b], acc[u][m]);
                }
                const __m512 sv = _mm512_maskz_load_ps(tm, sb + (int64_t)z * ld);
                for (int m = 0; m < MM; m++)
                    sacc[m] = _mm512_fmadd_ps(PKV_LUT_ACC2 ? _mm512_add_ps(acc[0][m], acc[1][m]) : acc[0][m], sv, sacc[m]);
            }
        }
        for (int m = 0; m < MM; m++) _mm512_store_ps(S + (int64_t)m * BSP + g0, sacc[m]);
    }
}

#define PKV_LUT_M(B)                                                                   \
    switch (M) {                                                                       \
    case 1: scores_lut_t(B, 1, sd, c, rw, h, nt, D, qv, S, BSP); break;               \
    case 2: scores_lut_t(B, 2, sd, c, rw, h, nt, D, qv, S, BSP); break;               \
    case 3: scores_lut_t(B, 3, sd, c, rw, h, nt, D, qv, S, BSP); break;               \
    default: scores_lut_t(B, 4, sd, c, rw, h, nt, D, qv, S, BSP); break;              \
    }
/* scores_lut_t for M <= LUT_MAX_M query vectors (the caller checks; see run_task). */
#define LUT_MAX_M 4
static void scores_lut(const pkv_side *sd, const i8_ctx *c, const pkv_rows *rw, int h, int nt, int D, int M,
                       const float *qv, float *S, int BSP) {
    switch (sd->bits) {
    case 2: PKV_LUT_M(2) break;
    case 3: PKV_LUT_M(3) break;
    case 5: PKV_LUT_M(5) break;
    default: PKV_LUT_M(4) break;
    }
}
#undef PKV_LUT_M

#define PKV_I8_M(B)                                                                                          \
    for (int m0 = 0; m0 < M; m0 += 4) {                                                                      \
        const int mm = imin(4, M - m0);                                                                      \
        const int8_t *a8 = q8 + (int64_t)m0 * D64;                                                           \
        const int32_t *ac = qc + (int64_t)m0 * (D64 / 4);                                                    \
        float *ss = S + (int64_t)m0 * BSP;                                                                   \
        if (mm == 4) scores_i8_t(B, 4, sd, c, rw, h, nt, H, D, a8, ac, qmul + m0, ss, BSP);                   \
        else if (mm == 3) scores_i8_t(B, 3, sd, c, rw, h, nt, H, D, a8, ac, qmul + m0, ss, BSP);              \
        else if (mm == 2) scores_i8_t(B, 2, sd, c, rw, h, nt, H, D, a8, ac, qmul + m0, ss, BSP);              \
        else scores_i8_t(B, 1, sd, c, rw, h, nt, H, D, a8, ac, qmul + m0, ss, BSP);                           \
    }
static void scores_i8(const pkv_side *sd, const i8_ctx *c, const pkv_rows *rw, int h, int nt, int H, int D, int M,
                      const int8_t *q8, const int32_t *qc, const float *qmul, float *S, int BSP) {
    const int D64 = (D + 63) & ~63;
    switch (sd->bits) {
    case 2: PKV_I8_M(2) break;
    case 3: PKV_I8_M(3) break;
    case 5: PKV_I8_M(5) break;
    default: PKV_I8_M(4) break;
    }
}
#undef PKV_I8_M
#endif /* PKV_AVX512 */
