/* Approximate integer scores for the AVX2 decode path (included by attention_kernel.c inside its
 * AVX2 section; `AttentionParams.int8_scores`, off by default).
 *
 * Only for K sides whose codes are 2/3/4-bit table lookups with per-group scales (turbo*, q4_0,
 * ...), head_dim a multiple of 32, few query vectors per task (decode). What changes:
 * - each query vector q (fp32, already scaled) is quantized once per call: q8 = round(q / sq),
 *   sq = max|q| / 127;
 * - the code levels become 7-bit integers: L = round(level / ls) + 64 in [1, 127] with
 *   ls = max|level| / 63 (ls = 1, exact, when the levels are integers within +-63);
 * - a K row's 32 codes become 32 bytes (a byte shuffle puts each code's 16-bit window in a word,
 *   a multiply by a power of two and a shift isolate it, a pack and a shuffle look the level up);
 *   vpmaddubsw (u8 levels x s8 query: pairs <= 2 * 127 * 127, no saturation) and vpmaddwd with
 *   ones give 8 int32 sums of 4 products (lanes 0-3: the first 16 dims, 4-7: the next 16); the
 *   offset 64 is taken out exactly (64 * the query's sum over the same 4 dims, precomputed);
 *   then one fp32 FMA per 8 lanes applies the group scales.
 * Score error: |ds| <= (sq / 2) * sum_d |k_d| + (ls / 2) * sum_d |q_d| * scale_group(d)
 * (the query's rounding against the stored key, the level's rounding against the query); the
 * test derives its tolerance from this bound. Measured gain: see the commit message. */

typedef struct {
    __m256i lut8;         /* 16-entry u8 level table (levels / ls + 64), both lanes */
    __m256i idx_a, idx_b;  /* byte shuffles: word k of lane L <- the window of code 16L + k (+8 for b) */
    __m256i mul_a, mul_b;  /* 2^(16 - bits - shift) per word */
    __m128i tail;         /* dword mask of a chunk's 4 * bits bytes (the row's last chunk) */
    float ls;             /* value of one level unit */
    int ok;               /* 1: this side takes the integer path */
} i8_ctx;

static void i8_ctx_init(i8_ctx *c, const pkv_side *sd, int D) {
    memset(c, 0, sizeof *c);
    if (sd->kind != EK_LUT || sd->bits > 4 || !sd->group || D % 32) return;
    const int bits = sd->bits;
    float amax = 0.0f;
    int integral = 1;
    for (int e = 0; e < 16; e++) {
        float v = fabsf(sd->table[e]);
        amax = v > amax ? v : amax;
        integral &= sd->table[e] == rintf(sd->table[e]);
    }
    if (!(amax > 0.0f) || !isfinite(amax)) return;
    c->ls = integral && amax <= 63.0f ? 1.0f : amax / 63.0f;
    uint8_t lut[32], ia[32], ib[32];
    int16_t ma[16], mb[16];
    for (int e = 0; e < 16; e++) {
        long v = lrintf(sd->table[e] / c->ls);
        v = v < -63 ? -63 : v > 63 ? 63 : v;
        lut[e] = lut[16 + e] = (uint8_t)(v + 64);
    }
    for (int L = 0; L < 2; L++)
        for (int k = 0; k < 8; k++)
            for (int half = 0; half < 2; half++) {
                const int j = 16 * L + 8 * half + k, p = (bits * j) / 8, s = (bits * j) % 8;
                uint8_t *ix = half ? ib : ia;
                int16_t *mu = half ? mb : ma;
                ix[16 * L + 2 * k] = (uint8_t)p;
                ix[16 * L + 2 * k + 1] = s + bits > 8 ? (uint8_t)(p + 1) : 0x80;
                mu[8 * L + k] = (int16_t)(1 << (16 - bits - s));
            }
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

/* Quantize the n query vectors q[n][D] into q8[n][D], qc[n][D/4] (64 * sum of each 4 dims) and
   qmul[n] = sq * ls (the factor a raw integer score is multiplied by). */
static void i8_prepare_queries(const i8_ctx *c, const float *q, int n, int D, int8_t *q8, int32_t *qc,
                               float *qmul) {
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
            qc[(int64_t)m * (D / 4) + j] = 64 * (y[4 * j] + y[4 * j + 1] + y[4 * j + 2] + y[4 * j + 3]);
        qmul[m] = sq * c->ls;
    }
}

/* 32 codes (chunk c of a row of rd bytes) -> 32 u8 levels */
PKV_INLINE __m256i i8_levels32(const int bits, const i8_ctx *c, const uint8_t *drow, int ch, int rd) {
    const int off = 4 * bits * ch;
    const __m128i x = off + 16 <= rd ? _mm_loadu_si128((const __m128i *)(drow + off))
                                     : _mm_maskload_epi32((const int *)(drow + off), c->tail);
    const __m256i w = _mm256_broadcastsi128_si256(x);
    const __m256i a = _mm256_srli_epi16(_mm256_mullo_epi16(_mm256_shuffle_epi8(w, c->idx_a), c->mul_a), 16 - bits);
    const __m256i b = _mm256_srli_epi16(_mm256_mullo_epi16(_mm256_shuffle_epi8(w, c->idx_b), c->mul_b), 16 - bits);
    return _mm256_shuffle_epi8(c->lut8, _mm256_packus_epi16(a, b));
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
                t0 = _mm256_sub_epi32(t0, _mm256_loadu_si256((const __m256i *)cm));
                t1 = _mm256_sub_epi32(t1, _mm256_loadu_si256((const __m256i *)(cm + 8)));
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
                t = _mm256_sub_epi32(t, _mm256_loadu_si256((const __m256i *)(qc + (int64_t)m * (D / 4) + 8 * ch)));
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
    default: scores_i8_t(4, sd, c, rw, h, nt, H, D, M, q8, qc, qmul, part, S, BSP); break;
    }
}
