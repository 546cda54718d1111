/* Chunked-prefill tile for the AVX2 and AVX-512 builds (issue 14 item 3): entry point
 * pkv_prefill, included at the end of attention_kernel.c (it reuses that file's decode, exp and
 * chunk helpers).
 *
 * Why a separate path: the general kernel (run_task / chunk_head) gives a prefill task ~96 query
 * vectors; each task decodes every K/V row of its context again (~11% of the time at 512 queries
 * after 3.5k), masks every score tile and rescales its softmax state in passes over all 96
 * vectors. Here a task is (sequence, kv head, up to PF_VECTORS query vectors, i.e. every query
 * row of a typical chunk): each 64-token chunk of K/V rows is decoded ONCE into an fp32 panel (K
 * transposed to [keys / L][D][L], L the vector width: 8 on AVX2, 16 on AVX-512), then swept by
 * micro-blocks of PF_MR (6) query vectors while it stays in L1/L2:
 *   scores  AVX2: 6 queries x 16 keys of register accumulators (12 ymm), AVX-512: 6 queries x 64
 *           keys (24 zmm), broadcast-FMA over D;
 *   softmax per micro-block (online: max, rescale factor, exp, sum) on the 6 x 64 tile while it
 *           is in L1; a tile that no query of the micro-block sees is skipped (the causal tail,
 *           the sliding window's head), a tile that every query sees fully is not masked;
 *   values  AVX2: 6 queries x 16 dims of register accumulators over the chunk's keys, AVX-512:
 *           6 queries x 64 dims (24 zmm).
 * Exact: fp32 throughout (the same decode, exp256 / exp512 and softcap256 / softcap512 as the
 * general kernel), so the result equals the reference within fp32 rounding. Not covered (the
 * caller routes these to pkv_attention): sparse V thresholds, the approximate integer scores,
 * the portable (non-SIMD) build.
 * Approximate, opt-in (AttentionParams.bf16_dots; entry pkv_prefill_bf16, AVX-512 BF16 builds):
 * the same tiles with vdpbf16ps (2 products per fp32 lane, the FMA's rate): q and the K panel as
 * bf16 pairs of dims for the scores, p and the V panel as bf16 pairs of keys for the values; the
 * output bound is derived in tests/test_cpu_prefill.py (bf16_bound). */

#if defined(PKV_AVX2) || defined(PKV_AVX512)
#define PF_MR 6
#define PF_CHUNK 64 /* tokens per decoded chunk (several blocks when block_size < 64) */

int pkv_prefill_available(void) { return 1; }

/* Query positions a micro-block sees in keys [jlo, jhi): 0 none, 1 some (mask), 2 all. */
static inline int pf_visibility(int plo, int phi, int W, int kstart, int jlo, int jhi) {
    const int lo_first = imax(kstart, W > 0 ? plo - W + 1 : 0), lo_last = imax(kstart, W > 0 ? phi - W + 1 : 0);
    if (jlo > phi || jhi - 1 < lo_first) return 0;
    return (jhi - 1 <= plo && jlo >= lo_last) ? 2 : 1;
}

#ifdef PKV_AVX2
/* K panel: decoded rows[BSP][D] transposed to kt[BSP/8][D][8]. */
static void pf_panel(const float *rows, int BSP, int D, float *kt) {
    for (int g = 0; g < BSP / 8; g++)
        for (int c = 0; c < D / 8; c++)
            transpose8(rows + (int64_t)g * 8 * D + 8 * c, D, kt + ((int64_t)g * D + 8 * c) * 8, 8);
}

/* S[z][BSP] = q_z . k_i (z < nz) for the 6 query vectors qz and the decoded, transposed K panel
   kt[BSP/8][D][8] (BSP a multiple of 16): 12 accumulators in named variables (an indexed array
   was kept on the stack by gcc), 2 K loads + 6 broadcasts per dim. Also the general kernel's
   prefill scores (scores_tile). */
#define PF_SFMA(z, a, b)                                                                           \
    w = _mm256_broadcast_ss(qz[z] + d);                                                            \
    a = _mm256_fmadd_ps(w, x, a);                                                                  \
    b = _mm256_fmadd_ps(w, y, b);
#define PF_SSTORE(z, a, b)                                                                         \
    if (z < nz) {                                                                                  \
        _mm256_store_ps(s + (int64_t)(z) * BSP, a);                                                \
        _mm256_store_ps(s + (int64_t)(z) * BSP + 8, b);                                            \
    }
static void pf_scores(const float *kt, int BSP, int D, const float *const *qz, float *S, int nz) {
    for (int g = 0; g < BSP / 8; g += 2) {
        const float *ka = kt + (int64_t)g * D * 8, *kb = ka + (int64_t)D * 8;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
        __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0;
        for (int d = 0; d < D; d++) {
            const __m256 x = _mm256_load_ps(ka + 8 * d), y = _mm256_load_ps(kb + 8 * d);
            __m256 w;
            PF_SFMA(0, a0, b0) PF_SFMA(1, a1, b1) PF_SFMA(2, a2, b2)
            PF_SFMA(3, a3, b3) PF_SFMA(4, a4, b4) PF_SFMA(5, a5, b5)
        }
        float *s = S + 8 * g;
        PF_SSTORE(0, a0, b0) PF_SSTORE(1, a1, b1) PF_SSTORE(2, a2, b2)
        PF_SSTORE(3, a3, b3) PF_SSTORE(4, a4, b4) PF_SSTORE(5, a5, b5)
    }
}
#undef PF_SFMA
#undef PF_SSTORE

/* acc_z = alpha_z acc_z + sum_i P[z][i] v_i for the 6 accumulator rows accz (V panel rows[nt][D]):
   12 accumulators (6 queries x 16 dims) per pass. */
#define PF_VLOAD(z, c0, c1)                                                                        \
    const __m256 al##z = _mm256_set1_ps(alpha[z]);                                                 \
    __m256 c0 = _mm256_mul_ps(_mm256_load_ps(accz[z] + dc), al##z);                                \
    __m256 c1 = _mm256_mul_ps(_mm256_load_ps(accz[z] + dc + 8), al##z);
#define PF_VFMA(z, c0, c1)                                                                         \
    w = _mm256_broadcast_ss(P + (int64_t)(z) * BSP + i);                                           \
    c0 = _mm256_fmadd_ps(w, x, c0);                                                                \
    c1 = _mm256_fmadd_ps(w, y, c1);
#define PF_VSTORE(z, c0, c1)                                                                       \
    _mm256_store_ps(accz[z] + dc, c0);                                                             \
    _mm256_store_ps(accz[z] + dc + 8, c1);
static inline void pf_values(const float *rows, int nt, int D, const float *P, int BSP, float *const *accz,
                             const float *alpha) {
    for (int dc = 0; dc < D; dc += 16) {
        PF_VLOAD(0, c00, c01) PF_VLOAD(1, c10, c11) PF_VLOAD(2, c20, c21)
        PF_VLOAD(3, c30, c31) PF_VLOAD(4, c40, c41) PF_VLOAD(5, c50, c51)
        for (int i = 0; i < nt; i++) {
            const __m256 x = _mm256_load_ps(rows + (int64_t)i * D + dc), y = _mm256_load_ps(rows + (int64_t)i * D + dc + 8);
            __m256 w;
            PF_VFMA(0, c00, c01) PF_VFMA(1, c10, c11) PF_VFMA(2, c20, c21)
            PF_VFMA(3, c30, c31) PF_VFMA(4, c40, c41) PF_VFMA(5, c50, c51)
        }
        PF_VSTORE(0, c00, c01) PF_VSTORE(1, c10, c11) PF_VSTORE(2, c20, c21)
        PF_VSTORE(3, c30, c31) PF_VSTORE(4, c40, c41) PF_VSTORE(5, c50, c51)
    }
}
#undef PF_VLOAD
#undef PF_VFMA
#undef PF_VSTORE
#define PF_LW 1 /* floats of a row's denominator state (AVX-512: one per lane) */
static void pf_fold_l(float *l, int n) { (void)l; (void)n; }

static inline float pf_hmax(__m256 v) {
    __m128 v4 = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    v4 = _mm_max_ps(v4, _mm_movehl_ps(v4, v4));
    return _mm_cvtss_f32(_mm_max_ss(v4, _mm_shuffle_ps(v4, v4, 1)));
}

/* Bias, soft-cap and visibility mask of one micro-block's score rows (only what applies). */
static void pf_adjust(const pkv_args *a, float *S, int BSP, int nz, const float *bias, const int *pos, int jlo,
                      int jhi, int masked) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int z = 0; z < nz; z++)
        for (int g = 0; g < BSP / 8; g++) {
            float *sp = S + (int64_t)z * BSP + 8 * g;
            __m256 s = _mm256_load_ps(sp);
            if (bias) s = _mm256_add_ps(s, _mm256_set1_ps(bias[z]));
            if (a->soft_cap > 0) s = softcap256(s, a->soft_cap);
            if (masked) {  /* key j = jlo + 8g + lane: j < jhi, key_start <= j <= pos, j > pos - W */
                const __m256i j = _mm256_add_epi32(lane, _mm256_set1_epi32(jlo + 8 * g));
                __m256i ok = _mm256_and_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(jhi), j),
                                              _mm256_cmpgt_epi32(_mm256_set1_epi32(pos[z] + 1), j));
                ok = _mm256_and_si256(ok, _mm256_cmpgt_epi32(j, _mm256_set1_epi32(a->key_start - 1)));
                if (a->window > 0) ok = _mm256_and_si256(ok, _mm256_cmpgt_epi32(j, _mm256_set1_epi32(pos[z] - a->window)));
                s = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s, _mm256_castsi256_ps(ok));
            }
            _mm256_store_ps(sp, s);
        }
}

/* Online softmax of one micro-block: S rows become p = exp(s - m_new) (0 where masked), alpha
   the rescale factors of the accumulators; st_m / st_l updated. */
static void pf_softmax(float *S, int BSP, int nz, int masked, float *st_m, float *st_l, float *alpha) {
    for (int z = 0; z < nz; z++) {
        float *sr = S + (int64_t)z * BSP;
        __m256 vm = _mm256_set1_ps(st_m[z]);
        for (int g = 0; g < BSP / 8; g++) vm = _mm256_max_ps(vm, _mm256_load_ps(sr + 8 * g));
        const float mx = pf_hmax(vm);
        if (mx == -INFINITY) {  /* nothing visible yet for this query vector */
            alpha[z] = 1.0f;
            memset(sr, 0, sizeof(float) * BSP);
            continue;
        }
        alpha[z] = st_m[z] == -INFINITY ? 0.0f : (st_m[z] == mx ? 1.0f : expf(st_m[z] - mx));
        const __m256 vmx = _mm256_set1_ps(mx);
        __m256 vsum = _mm256_setzero_ps();
        for (int g = 0; g < BSP / 8; g++) {
            const __m256 s = _mm256_load_ps(sr + 8 * g);
            __m256 p = exp256(_mm256_sub_ps(s, vmx));
            if (masked) p = _mm256_and_ps(_mm256_cmp_ps(s, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ), p);
            vsum = _mm256_add_ps(vsum, p);
            _mm256_store_ps(sr + 8 * g, p);
        }
        float t8[8];
        _mm256_storeu_ps(t8, vsum);
        st_l[z] = st_l[z] * alpha[z] + (((t8[0] + t8[1]) + (t8[2] + t8[3])) + ((t8[4] + t8[5]) + (t8[6] + t8[7])));
        st_m[z] = mx;
    }
}

#else /* PKV_AVX512 */
/* ---------------------------------------------------------------- AVX-512 (16 lanes, 32 zmm) */
/* K panel: decoded rows[BSP][D] transposed to kt[BSP/16][D][16]. */
static void pf_panel(const float *rows, int BSP, int D, float *kt) {
    for (int g = 0; g < BSP / 16; g++)
        for (int c = 0; c < D / 16; c++)
            transpose16(rows + (int64_t)g * 16 * D + 16 * c, D, kt + ((int64_t)g * D + 16 * c) * 16, 16);
}

/* S[z][16 NK keys] = q_z . k for the 6 query vectors qz against NK (compile-time, 1..4) groups of
   16 transposed keys (group j at kt + j * 16 D): 6 x NK accumulators in named variables (24 of
   the 32 zmm at NK = 4), NK K loads + 6 broadcast-FMA operands per dim. PF5_STORE (and the value
   tile's PF5_VLOAD / PF5_VSTORE below) also serve the bf16 tiles. */
#define PF5_ROW(z)                                                                                 \
    {                                                                                              \
        const __m512 w = _mm512_set1_ps(q##z[d]);                                                  \
        a##z##0 = _mm512_fmadd_ps(w, k0, a##z##0);                                                 \
        if (NK > 1) a##z##1 = _mm512_fmadd_ps(w, k1, a##z##1);                                     \
        if (NK > 2) a##z##2 = _mm512_fmadd_ps(w, k2, a##z##2);                                     \
        if (NK > 3) a##z##3 = _mm512_fmadd_ps(w, k3, a##z##3);                                     \
    }
#define PF5_STORE(z)                                                                               \
    if (z < nz) {                                                                                  \
        float *sz = s + (int64_t)(z) * BSP;                                                        \
        _mm512_store_ps(sz, a##z##0);                                                              \
        if (NK > 1) _mm512_store_ps(sz + 16, a##z##1);                                             \
        if (NK > 2) _mm512_store_ps(sz + 32, a##z##2);                                             \
        if (NK > 3) _mm512_store_ps(sz + 48, a##z##3);                                             \
    }
PKV_INLINE void pf_scores_nk(const int NK, const float *kt, int D, const float *const *qz, float *s, int BSP,
                             int nz) {
    const float *q0 = qz[0], *q1 = qz[1], *q2 = qz[2], *q3 = qz[3], *q4 = qz[4], *q5 = qz[5];
    const int64_t gs = (int64_t)D * 16;
    const __m512 zero = _mm512_setzero_ps();
    __m512 a00 = zero, a01 = zero, a02 = zero, a03 = zero, a10 = zero, a11 = zero, a12 = zero, a13 = zero;
    __m512 a20 = zero, a21 = zero, a22 = zero, a23 = zero, a30 = zero, a31 = zero, a32 = zero, a33 = zero;
    __m512 a40 = zero, a41 = zero, a42 = zero, a43 = zero, a50 = zero, a51 = zero, a52 = zero, a53 = zero;
    for (int d = 0; d < D; d++) {
        const float *kd = kt + 16 * d;
        const __m512 k0 = _mm512_load_ps(kd);
        const __m512 k1 = NK > 1 ? _mm512_load_ps(kd + gs) : zero;
        const __m512 k2 = NK > 2 ? _mm512_load_ps(kd + 2 * gs) : zero;
        const __m512 k3 = NK > 3 ? _mm512_load_ps(kd + 3 * gs) : zero;
        PF5_ROW(0) PF5_ROW(1) PF5_ROW(2) PF5_ROW(3) PF5_ROW(4) PF5_ROW(5)
    }
    PF5_STORE(0) PF5_STORE(1) PF5_STORE(2) PF5_STORE(3) PF5_STORE(4) PF5_STORE(5)
    (void)a01; (void)a02; (void)a03; (void)a11; (void)a12; (void)a13; (void)a21; (void)a22; (void)a23;
    (void)a31; (void)a32; (void)a33; (void)a41; (void)a42; (void)a43; (void)a51; (void)a52; (void)a53;
}
#undef PF5_ROW

static void pf_scores(const float *kt, int BSP, int D, const float *const *qz, float *S, int nz) {
    const int ng = BSP / 16;
    int g = 0;
    for (; g + 4 <= ng; g += 4) pf_scores_nk(4, kt + (int64_t)g * D * 16, D, qz, S + 16 * g, BSP, nz);
    switch (ng - g) {
    case 3: pf_scores_nk(3, kt + (int64_t)g * D * 16, D, qz, S + 16 * g, BSP, nz); break;
    case 2: pf_scores_nk(2, kt + (int64_t)g * D * 16, D, qz, S + 16 * g, BSP, nz); break;
    case 1: pf_scores_nk(1, kt + (int64_t)g * D * 16, D, qz, S + 16 * g, BSP, nz); break;
    default: break;
    }
}

/* acc_z[dc .. dc + 16 NC) = alpha_z acc_z + sum_i P[z][i] v_i for the 6 accumulator rows accz (V
   panel rows[nt][D]; NC compile-time, 1..4): 6 x NC accumulators, NC V loads + 6 broadcast-FMA
   operands per key. */
#define PF5_VLOAD(z)                                                                               \
    const __m512 al##z = _mm512_set1_ps(alpha[z]);                                                 \
    __m512 c##z##0 = _mm512_mul_ps(_mm512_load_ps(accz[z] + dc), al##z);                           \
    __m512 c##z##1 = NC > 1 ? _mm512_mul_ps(_mm512_load_ps(accz[z] + dc + 16), al##z) : zero;      \
    __m512 c##z##2 = NC > 2 ? _mm512_mul_ps(_mm512_load_ps(accz[z] + dc + 32), al##z) : zero;      \
    __m512 c##z##3 = NC > 3 ? _mm512_mul_ps(_mm512_load_ps(accz[z] + dc + 48), al##z) : zero;
#define PF5_VFMA(z)                                                                                \
    {                                                                                              \
        const __m512 w = _mm512_set1_ps(p##z[i]);                                                  \
        c##z##0 = _mm512_fmadd_ps(w, v0, c##z##0);                                                 \
        if (NC > 1) c##z##1 = _mm512_fmadd_ps(w, v1, c##z##1);                                     \
        if (NC > 2) c##z##2 = _mm512_fmadd_ps(w, v2, c##z##2);                                     \
        if (NC > 3) c##z##3 = _mm512_fmadd_ps(w, v3, c##z##3);                                     \
    }
#define PF5_VSTORE(z)                                                                              \
    _mm512_store_ps(accz[z] + dc, c##z##0);                                                        \
    if (NC > 1) _mm512_store_ps(accz[z] + dc + 16, c##z##1);                                       \
    if (NC > 2) _mm512_store_ps(accz[z] + dc + 32, c##z##2);                                       \
    if (NC > 3) _mm512_store_ps(accz[z] + dc + 48, c##z##3);
PKV_INLINE void pf_values_nc(const int NC, const float *rows, int nt, int D, int dc, const float *P, int BSP,
                             float *const *accz, const float *alpha) {
    const __m512 zero = _mm512_setzero_ps();
    const float *p0 = P, *p1 = P + BSP, *p2 = P + 2 * BSP, *p3 = P + 3 * BSP, *p4 = P + 4 * BSP, *p5 = P + 5 * BSP;
    PF5_VLOAD(0) PF5_VLOAD(1) PF5_VLOAD(2) PF5_VLOAD(3) PF5_VLOAD(4) PF5_VLOAD(5)
    for (int i = 0; i < nt; i++) {
        const float *v = rows + (int64_t)i * D + dc;
        const __m512 v0 = _mm512_load_ps(v);
        const __m512 v1 = NC > 1 ? _mm512_load_ps(v + 16) : zero;
        const __m512 v2 = NC > 2 ? _mm512_load_ps(v + 32) : zero;
        const __m512 v3 = NC > 3 ? _mm512_load_ps(v + 48) : zero;
        PF5_VFMA(0) PF5_VFMA(1) PF5_VFMA(2) PF5_VFMA(3) PF5_VFMA(4) PF5_VFMA(5)
    }
    PF5_VSTORE(0) PF5_VSTORE(1) PF5_VSTORE(2) PF5_VSTORE(3) PF5_VSTORE(4) PF5_VSTORE(5)
}
#undef PF5_VFMA

static void pf_values(const float *rows, int nt, int D, const float *P, int BSP, float *const *accz,
                      const float *alpha) {
    int dc = 0;
    for (; dc + 64 <= D; dc += 64) pf_values_nc(4, rows, nt, D, dc, P, BSP, accz, alpha);
    switch ((D - dc) / 16) {
    case 3: pf_values_nc(3, rows, nt, D, dc, P, BSP, accz, alpha); break;
    case 2: pf_values_nc(2, rows, nt, D, dc, P, BSP, accz, alpha); break;
    case 1: pf_values_nc(1, rows, nt, D, dc, P, BSP, accz, alpha); break;
    default: break;
    }
}

/* Bias, soft-cap and visibility mask of one micro-block's score rows (only what applies). */
static void pf_adjust(const pkv_args *a, float *S, int BSP, int nz, const float *bias, const int *pos, int jlo,
                      int jhi, int masked) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int z = 0; z < nz; z++)
        for (int g = 0; g < BSP / 16; g++) {
            float *sp = S + (int64_t)z * BSP + 16 * g;
            __m512 s = _mm512_load_ps(sp);
            if (bias) s = _mm512_add_ps(s, _mm512_set1_ps(bias[z]));
            if (a->soft_cap > 0) s = softcap512(s, a->soft_cap);
            if (masked) {  /* key j = jlo + 16g + lane: j < jhi, key_start <= j <= pos, j > pos - W */
                const __m512i j = _mm512_add_epi32(lane, _mm512_set1_epi32(jlo + 16 * g));
                __mmask16 ok = _mm512_cmplt_epi32_mask(j, _mm512_set1_epi32(jhi));
                ok &= _mm512_cmple_epi32_mask(j, _mm512_set1_epi32(pos[z]));
                ok &= _mm512_cmpge_epi32_mask(j, _mm512_set1_epi32(a->key_start));
                if (a->window > 0) ok &= _mm512_cmpgt_epi32_mask(j, _mm512_set1_epi32(pos[z] - a->window));
                s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), ok, s);
            }
            _mm512_store_ps(sp, s);
        }
}

/* Online softmax of one micro-block: S rows become p = exp(s - m_new) (0 where masked), alpha
   the rescale factors of the accumulators; st_m / st_l updated. The denominators are kept per lane
   (st_l: 16 partial sums per row, added up by pf_run at the end), and the running max is only
   recomputed (a horizontal max) when some score of the row exceeds it: a lane-wise compare, the
   usual case once a row has seen a few chunks. Both give the same p as the textbook update (the
   max is the same number); only the denominator's summation order differs. */
static void pf_softmax(float *S, int BSP, int nz, int masked, float *st_m, float *st_l, float *alpha) {
    const int ng = BSP / 16;
    for (int z = 0; z < nz; z++) {
        float *sr = S + (int64_t)z * BSP;
        float *lz = st_l + (int64_t)z * 16;
        const __m512 vold = _mm512_set1_ps(st_m[z]);
        __mmask16 up = 0;
        for (int g = 0; g < ng; g++) up |= _mm512_cmp_ps_mask(_mm512_load_ps(sr + 16 * g), vold, _CMP_GT_OQ);
        float mx = st_m[z];
        if (up) {  /* a score above the running max: the new max */
            __m512 vm = vold;
            for (int g = 0; g < ng; g++) vm = _mm512_max_ps(vm, _mm512_load_ps(sr + 16 * g));
            mx = _mm512_reduce_max_ps(vm);
        }
        if (mx == -INFINITY) {  /* nothing visible yet for this query vector */
            alpha[z] = 1.0f;
            memset(sr, 0, sizeof(float) * BSP);
            continue;
        }
        alpha[z] = st_m[z] == -INFINITY ? 0.0f : (st_m[z] == mx ? 1.0f : expf(st_m[z] - mx));
        const __m512 vmx = _mm512_set1_ps(mx);
        __m512 vsum = _mm512_setzero_ps();
        for (int g = 0; g < ng; g++) {
            const __m512 s = _mm512_load_ps(sr + 16 * g);
            __m512 p = exp512(_mm512_sub_ps(s, vmx));
            if (masked) p = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ), p);
            vsum = _mm512_add_ps(vsum, p);
            _mm512_store_ps(sr + 16 * g, p);
        }
        _mm512_store_ps(lz, _mm512_fmadd_ps(_mm512_load_ps(lz), _mm512_set1_ps(alpha[z]), vsum));
        st_m[z] = mx;
    }
}

/* Per-lane denominators (PF_LW floats per row) -> one sum per row, in place: l[m] for m < n. */
static void pf_fold_l(float *l, int n) {
    for (int m = 0; m < n; m++) l[m] = _mm512_reduce_add_ps(_mm512_load_ps(l + (int64_t)m * 16));
}
#define PF_LW 16

#ifdef __AVX512BF16__
#define PF_BF16 1
/* ---------------------------------------------------------------- AVX-512 BF16 (approximate) */
/* K panel in bf16 pairs: rows[BSP][D] fp32 -> kb[BSP][D/2] dwords (a row's dims 2e, 2e + 1 as
   one bf16 pair, RNE) -> kt[BSP/16][D/2][16] dwords (transpose16 moves 32-bit lanes). D % 32 == 0. */
static void pf_panel_bf16(const float *rows, int BSP, int D, float *kb, float *kt) {
    const int D2 = D / 2;
    for (int i = 0; i < BSP; i++)
        for (int c = 0; c < D; c += 32) {
            const float *r = rows + (int64_t)i * D + c;
            const __m512bh h = _mm512_cvtne2ps_pbh(_mm512_load_ps(r + 16), _mm512_load_ps(r));
            _mm512_store_si512((__m512i *)(kb + (int64_t)i * D2 + c / 2), (__m512i)h);
        }
    for (int g = 0; g < BSP / 16; g++)
        for (int c = 0; c < D2 / 16; c++)
            transpose16(kb + (int64_t)g * 16 * D2 + 16 * c, D2, kt + ((int64_t)g * D2 + 16 * c) * 16, 16);
}

/* V panel in bf16 pairs of keys: vb[BSP/2][D] dwords, dword (ip, d) = (v[2 ip][d], v[2 ip + 1][d]). */
static void pf_vpanel_bf16(const float *rows, int BSP, int D, float *vb) {
    const __m512i ix = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                        23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int ip = 0; ip < BSP / 2; ip++)
        for (int c = 0; c < D; c += 16) {
            const __m512bh h = _mm512_cvtne2ps_pbh(_mm512_load_ps(rows + (int64_t)(2 * ip + 1) * D + c),
                                                   _mm512_load_ps(rows + (int64_t)(2 * ip) * D + c));
            _mm512_store_si512((__m512i *)(vb + (int64_t)ip * D + c), _mm512_permutexvar_epi16(ix, (__m512i)h));
        }
}

/* q rows (fp32, D) -> bf16 pairs (D/2 dwords) */
static void pf_rows_bf16(const float *x, int n, int D, float *out) {
    for (int i = 0; i < n; i++)
        for (int c = 0; c < D; c += 32) {
            const float *r = x + (int64_t)i * D + c;
            _mm512_store_si512((__m512i *)(out + (int64_t)i * (D / 2) + c / 2),
                               (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(r + 16), _mm512_load_ps(r)));
        }
}

#define PFB_ROW(z)                                                                                 \
    {                                                                                              \
        const __m512bh w = (__m512bh)_mm512_castps_si512(_mm512_set1_ps(q##z[e]));              \
        a##z##0 = _mm512_dpbf16_ps(a##z##0, w, k0);                                                \
        if (NK > 1) a##z##1 = _mm512_dpbf16_ps(a##z##1, w, k1);                                    \
        if (NK > 2) a##z##2 = _mm512_dpbf16_ps(a##z##2, w, k2);                                    \
        if (NK > 3) a##z##3 = _mm512_dpbf16_ps(a##z##3, w, k3);                                    \
    }
PKV_INLINE void pf_scores_bf_nk(const int NK, const float *kt, int D2, const float *const *qz, float *s, int BSP,
                                int nz) {
    const float *q0 = qz[0], *q1 = qz[1], *q2 = qz[2], *q3 = qz[3], *q4 = qz[4], *q5 = qz[5];
    const int64_t gs = (int64_t)D2 * 16;
    const __m512 zero = _mm512_setzero_ps();
    const __m512bh zb = (__m512bh)_mm512_setzero_si512();
    __m512 a00 = zero, a01 = zero, a02 = zero, a03 = zero, a10 = zero, a11 = zero, a12 = zero, a13 = zero;
    __m512 a20 = zero, a21 = zero, a22 = zero, a23 = zero, a30 = zero, a31 = zero, a32 = zero, a33 = zero;
    __m512 a40 = zero, a41 = zero, a42 = zero, a43 = zero, a50 = zero, a51 = zero, a52 = zero, a53 = zero;
    for (int e = 0; e < D2; e++) {
        const float *kd = kt + 16 * e;
        const __m512bh k0 = (__m512bh)_mm512_load_si512((const __m512i *)kd);
        const __m512bh k1 = NK > 1 ? (__m512bh)_mm512_load_si512((const __m512i *)(kd + gs)) : zb;
        const __m512bh k2 = NK > 2 ? (__m512bh)_mm512_load_si512((const __m512i *)(kd + 2 * gs)) : zb;
        const __m512bh k3 = NK > 3 ? (__m512bh)_mm512_load_si512((const __m512i *)(kd + 3 * gs)) : zb;
        PFB_ROW(0) PFB_ROW(1) PFB_ROW(2) PFB_ROW(3) PFB_ROW(4) PFB_ROW(5)
    }
    PF5_STORE(0) PF5_STORE(1) PF5_STORE(2) PF5_STORE(3) PF5_STORE(4) PF5_STORE(5)
    (void)a01; (void)a02; (void)a03; (void)a11; (void)a12; (void)a13; (void)a21; (void)a22; (void)a23;
    (void)a31; (void)a32; (void)a33; (void)a41; (void)a42; (void)a43; (void)a51; (void)a52; (void)a53;
}
#undef PFB_ROW

/* pf_scores with bf16 pairs: kt from pf_panel_bf16, qz rows of D/2 pairs */
static void pf_scores_bf(const float *kt, int BSP, int D, const float *const *qz, float *S, int nz) {
    const int ng = BSP / 16, D2 = D / 2;
    int g = 0;
    for (; g + 4 <= ng; g += 4) pf_scores_bf_nk(4, kt + (int64_t)g * D2 * 16, D2, qz, S + 16 * g, BSP, nz);
    switch (ng - g) {
    case 3: pf_scores_bf_nk(3, kt + (int64_t)g * D2 * 16, D2, qz, S + 16 * g, BSP, nz); break;
    case 2: pf_scores_bf_nk(2, kt + (int64_t)g * D2 * 16, D2, qz, S + 16 * g, BSP, nz); break;
    case 1: pf_scores_bf_nk(1, kt + (int64_t)g * D2 * 16, D2, qz, S + 16 * g, BSP, nz); break;
    default: break;
    }
}

#define PFB_VFMA(z)                                                                                \
    {                                                                                              \
        const __m512bh w = (__m512bh)_mm512_set1_epi32(p##z[ip]);                                  \
        c##z##0 = _mm512_dpbf16_ps(c##z##0, w, v0);                                                \
        if (NC > 1) c##z##1 = _mm512_dpbf16_ps(c##z##1, w, v1);                                    \
        if (NC > 2) c##z##2 = _mm512_dpbf16_ps(c##z##2, w, v2);                                    \
        if (NC > 3) c##z##3 = _mm512_dpbf16_ps(c##z##3, w, v3);                                    \
    }
/* Pb: 6 rows of BSP/2 bf16 pairs of p (row stride BSP/2 dwords); vb from pf_vpanel_bf16 */
PKV_INLINE void pf_values_bf_nc(const int NC, const float *vb, int np, int D, int dc, const int32_t *Pb, int BSP,
                                float *const *accz, const float *alpha) {
    const __m512 zero = _mm512_setzero_ps();
    const __m512bh zb = (__m512bh)_mm512_setzero_si512();
    const int B2 = BSP / 2;
    const int32_t *p0 = Pb, *p1 = Pb + B2, *p2 = Pb + 2 * B2, *p3 = Pb + 3 * B2, *p4 = Pb + 4 * B2, *p5 = Pb + 5 * B2;
    PF5_VLOAD(0) PF5_VLOAD(1) PF5_VLOAD(2) PF5_VLOAD(3) PF5_VLOAD(4) PF5_VLOAD(5)
    for (int ip = 0; ip < np; ip++) {
        const float *v = vb + (int64_t)ip * D + dc;
        const __m512bh v0 = (__m512bh)_mm512_load_si512((const __m512i *)v);
        const __m512bh v1 = NC > 1 ? (__m512bh)_mm512_load_si512((const __m512i *)(v + 16)) : zb;
        const __m512bh v2 = NC > 2 ? (__m512bh)_mm512_load_si512((const __m512i *)(v + 32)) : zb;
        const __m512bh v3 = NC > 3 ? (__m512bh)_mm512_load_si512((const __m512i *)(v + 48)) : zb;
        PFB_VFMA(0) PFB_VFMA(1) PFB_VFMA(2) PFB_VFMA(3) PFB_VFMA(4) PFB_VFMA(5)
    }
    PF5_VSTORE(0) PF5_VSTORE(1) PF5_VSTORE(2) PF5_VSTORE(3) PF5_VSTORE(4) PF5_VSTORE(5)
}
#undef PFB_VFMA

/* pf_values with bf16 pairs: p rows converted here (into Pb: 6 x BSP/2 dwords), key pairs up to nt */
static void pf_values_bf(const float *vb, int nt, int D, const float *P, int BSP, float *const *accz,
                         const float *alpha, int32_t *Pb) {
    for (int z = 0; z < PF_MR; z++)
        for (int i = 0; i < BSP; i += 32) {
            const float *r = P + (int64_t)z * BSP + i;
            const __m512 lo = _mm512_load_ps(r), hi = i + 16 < BSP ? _mm512_load_ps(r + 16) : _mm512_setzero_ps();
            const __m512i h = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
            if (i + 16 < BSP) _mm512_storeu_si512((__m512i *)(Pb + (int64_t)z * (BSP / 2) + i / 2), h);
            else _mm256_storeu_si256((__m256i *)(Pb + (int64_t)z * (BSP / 2) + i / 2), _mm512_castsi512_si256(h));
        }
    const int np = (nt + 1) / 2;
    int dc = 0;
    for (; dc + 64 <= D; dc += 64) pf_values_bf_nc(4, vb, np, D, dc, Pb, BSP, accz, alpha);
    switch ((D - dc) / 16) {
    case 3: pf_values_bf_nc(3, vb, np, D, dc, Pb, BSP, accz, alpha); break;
    case 2: pf_values_bf_nc(2, vb, np, D, dc, Pb, BSP, accz, alpha); break;
    case 1: pf_values_bf_nc(1, vb, np, D, dc, Pb, BSP, accz, alpha); break;
    default: break;
    }
}
#endif /* __AVX512BF16__ */
#undef PF5_STORE  /* the score and value tiles' shared loads and stores, exact and bf16 */
#undef PF5_VLOAD
#undef PF5_VSTORE
#endif

typedef struct {
    int32_t b, h, r0, r1;
} pf_task;

/* Working memory of one task (M query vectors, chunks of BSP padded tokens). */
typedef struct {
    float *q, *bias, *m, *l, *acc, *krows, *kt, *vrows, *S;
    int32_t *pos;
    int bf;                 /* bf16 route: 1 scores, 2 values, 3 both (PF_BF16 builds) */
    float *qb, *kb, *vb;    /* bf16 pairs: queries [M][D/2], K rows [BSP][D/2], V panel [BSP/2][D] */
    int32_t *pb;            /* [PF_MR][BSP/2] bf16 pairs of p */
    pkv_rows kr[2], vr[2];
} pf_mem;

static void pf_free(pf_mem *w) {
    free(w->q); free(w->bias); free(w->m); free(w->l); free(w->acc); free(w->krows); free(w->kt);
    free(w->vrows); free(w->S); free(w->pos); free(w->qb); free(w->kb); free(w->vb); free(w->pb);
    for (int z = 0; z < 2; z++) {
        free(w->kr[z].data); free(w->kr[z].sraw); free(w->kr[z].scl);
        free(w->vr[z].data); free(w->vr[z].sraw); free(w->vr[z].scl);
    }
}

static int pf_alloc(pf_mem *w, int M, int D, int H, int CH, int BSP, int bf) {
    memset(w, 0, sizeof *w);
    w->bf = bf;
    const int Mp = (M + PF_MR - 1) / PF_MR * PF_MR, nc = D / 16;
    int ok = 1;
    for (int z = 0; z < 2; z++) {
        pkv_rows *r2[2] = {&w->kr[z], &w->vr[z]};
        for (int y = 0; y < 2; y++) {
            r2[y]->data = malloc(sizeof(void *) * CH);
            r2[y]->sraw = malloc(sizeof(void *) * CH);
            r2[y]->scl = xalloc(sizeof(float) * (size_t)CH * H * nc);
            ok &= r2[y]->data && r2[y]->sraw && r2[y]->scl;
        }
    }
    w->q = xalloc(sizeof(float) * (size_t)Mp * D);
    w->bias = xalloc(sizeof(float) * (size_t)Mp);
    w->m = xalloc(sizeof(float) * (size_t)Mp);
    w->l = xalloc(sizeof(float) * (size_t)Mp * PF_LW);
    w->acc = xalloc(sizeof(float) * (size_t)Mp * D);
    w->krows = xalloc(sizeof(float) * (size_t)BSP * D);
    w->kt = xalloc(sizeof(float) * (size_t)BSP * D);
    w->vrows = xalloc(sizeof(float) * (size_t)BSP * D);
    w->S = xalloc(sizeof(float) * (size_t)PF_MR * BSP);
    w->pos = xalloc(sizeof(int32_t) * (size_t)Mp);
    if (bf) {
        w->qb = xalloc(sizeof(float) * (size_t)Mp * D / 2);
        w->kb = xalloc(sizeof(float) * (size_t)BSP * D / 2);
        w->vb = xalloc(sizeof(float) * (size_t)BSP * D / 2);
        w->pb = xalloc(sizeof(int32_t) * (size_t)PF_MR * BSP / 2);
        ok &= w->qb && w->kb && w->vb && w->pb;
    }
    return ok && w->q && w->bias && w->m && w->l && w->acc && w->krows && w->kt && w->vrows && w->S && w->pos;
}

/* One chunk (tokens [jlo, jhi), nt of them, rows already decoded into w) against every micro-block. */
static void pf_chunk(const pkv_args *a, pf_mem *w, int M, int G, int D, int BSP, int jlo, int jhi) {
    const int nt = jhi - jlo;
    float alpha[PF_MR];
    for (int m0 = 0; m0 < M; m0 += PF_MR) {
        const int nz = imin(PF_MR, M - m0);
        const int vis = pf_visibility(w->pos[m0], w->pos[m0 + nz - 1], a->window, a->key_start, jlo, jhi);
        if (vis == 0) continue;
        const int masked = vis == 1 || nt < BSP;
        const float *qz[PF_MR];
        float *accz[PF_MR];
        const int bfs = w->bf & 1, bfv = w->bf & 2;
        (void)bfv;
        for (int z = 0; z < PF_MR; z++) {  /* a short last block repeats its first vector, unused */
            const int m = m0 + (z < nz ? z : 0);
            qz[z] = bfs ? w->qb + (int64_t)m * (D / 2) : w->q + (int64_t)m * D;
            accz[z] = w->acc + (int64_t)(z < nz ? m : M) * D;  /* row M: padding, never read */
        }
#ifdef PF_BF16
        if (bfs) pf_scores_bf(w->kt, BSP, D, qz, w->S, PF_MR);
        else
#endif
        pf_scores(w->kt, BSP, D, qz, w->S, PF_MR);
        if (masked || a->bias || a->soft_cap > 0)
            pf_adjust(a, w->S, BSP, nz, a->bias ? w->bias + m0 : NULL, w->pos + m0, jlo, jhi, masked);
        pf_softmax(w->S, BSP, nz, masked, w->m + m0, w->l + (int64_t)m0 * PF_LW, alpha);
        for (int z = nz; z < PF_MR; z++) {  /* unused rows: nothing accumulated */
            alpha[z] = 0.0f;
            memset(w->S + (int64_t)z * BSP, 0, sizeof(float) * BSP);
        }
#ifdef PF_BF16
        if (bfv) pf_values_bf(w->vb, nt, D, w->S, BSP, accz, alpha, w->pb);
        else
#endif
        pf_values(w->vrows, nt, D, w->S, BSP, accz, alpha);
    }
    (void)G;
}

/* Output rows of a task from its softmax states (row i = r * G + g: running max m[i * ms], sum
   l[i * ms], accumulator acc + i * as): sinks join the denominator, the output is normalised and
   scaled (v tensor scale, E4M3 factor), the log-sum-exp written when asked for. */
static void pf_finish(const pkv_args *a, const pkv_side *vs, const pf_task *t, const float *m, const float *l,
                      const float *acc, int ms, int as) {
    const int D = a->head_dim, Hq = a->num_q_heads, G = Hq / a->num_kv_heads, qs = a->query_start[t->b];
    const float vmul = a->out_scale * (vs->group ? 1.0f : value_mult(vs));
    for (int r = 0; r < t->r1 - t->r0; r++)
        for (int g = 0; g < G; g++) {
            const int i = r * G + g, tok = qs + t->r0 + r, qh = t->h * G + g;
            const float mi = m[(int64_t)i * ms], sm = a->sinks ? a->sinks[qh] : -INFINITY;
            float *o = a->out + ((size_t)tok * Hq + qh) * D;
            float *lse = a->lse ? a->lse + (size_t)tok * Hq + qh : NULL;
            const float mx = mi > sm ? mi : sm;
            if (lse) *lse = -INFINITY;
            if (mx == -INFINITY) {
                memset(o, 0, sizeof(float) * D);
                continue;
            }
            float z = a->sinks ? expf(sm - mx) : 0.0f, wt = 0.0f;
            if (mi != -INFINITY) {
                wt = expf(mi - mx);
                z += l[(int64_t)i * ms] * wt;
            }
            if (lse && z > 0) *lse = mx + logf(z);
            const float f = z > 0 ? vmul / z : 0.0f;
            for (int d = 0; d < D; d++) o[d] = (wt * acc[(int64_t)i * as + d]) * f;
        }
}

static int pf_run(const pkv_args *a, const pkv_side *ks, const pkv_side *vs, const pf_task *t, int64_t *nv, int bf_mode) {
    const int D = a->head_dim, H = a->num_kv_heads, Hq = a->num_q_heads, G = Hq / H, BS = a->block_size;
    const int R = t->r1 - t->r0, M = R * G, h = t->h;
    const int qs = a->query_start[t->b], qlen = a->query_start[t->b + 1] - qs, L = a->seq_lens[t->b];
    const int NB = BS >= PF_CHUNK ? 1 : PF_CHUNK / BS, CH = NB * BS, BSP = (CH + 15) & ~15;
    const int pos_lo = L - qlen + t->r0, pos_hi = L - qlen + t->r1 - 1;
    const int jmin = imax(a->window > 0 ? imax(0, pos_lo - a->window + 1) : 0, a->key_start), jmax = pos_hi;
    const int blk0 = jmin / BS, blk1 = pos_hi >= 0 ? imax(blk0, pos_hi / BS + 1) : blk0;
    if (M <= SMALL_M) {  /* a few vectors (a batch's decode rows): the general kernel's register
                            paths (scores_dot, vacc_fused) beat 6-vector tiles there */
        pkv_args a1 = *a;
        a1.heads_per_task = 1;
        pkv_task t1 = {t->b, h, t->r0, t->r1, blk0, blk1, 0};
        float *part = malloc(sizeof(float) * (size_t)M * (D + 2));
        int64_t nskip = 0;
        const int rc = part ? run_task(&a1, ks, vs, &t1, part, nv, &nskip) : -1;
        if (rc == 0) pf_finish(a, vs, t, part, part + 1, part + 2, D + 2, D + 2);
        free(part);
        return rc;
    }
    pf_mem w;
    const int bf = D % 32 == 0 ? bf_mode : bf_mode & 2;  /* the bf16 K panel pairs dims: D % 32 == 0 */
    if (!pf_alloc(&w, M + 1, D, H, CH, BSP, bf)) { pf_free(&w); return -1; }
    const float fq = ks->group ? 1.0f : value_mult(ks);
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) {
            const int m = r * G + g, tok = qs + t->r0 + r, qh = h * G + g;
            const float *sq = a->q + ((size_t)tok * Hq + qh) * D;
            for (int d = 0; d < D; d++) w.q[(int64_t)m * D + d] = sq[d] * fq;
            w.bias[m] = a->bias ? a->bias[(size_t)tok * Hq + qh] : 0.0f;
            w.m[m] = -INFINITY;
            w.pos[m] = L - qlen + t->r0 + r;
        }
#ifdef PF_BF16
    if (bf & 1) pf_rows_bf16(w.q, M, D, w.qb);
#endif
    lut_ctx klc, vlc;
    lut_ctx_init(&klc, ks);
    lut_ctx_init(&vlc, vs);
    const int32_t *bt = a->block_tables + (int64_t)t->b * a->bt_stride;
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr & ~0x8040u);  /* DAZ and FTZ off: IEEE results whatever the caller set */
    int cur = 0, jlo = 0, jhi = 0;
    int nt = blk0 < blk1 ? fill_chunk(a, ks, vs, bt, blk0, blk1, NB, jmin, jmax, &jlo, &jhi, &w.kr[0], &w.vr[0]) : 0;
    for (int lb = blk0; lb < blk1; lb += NB) {
        int jlo2 = 0, jhi2 = 0;
        const int nt2 = lb + NB < blk1 ? fill_chunk(a, ks, vs, bt, lb + NB, blk1, NB, jmin, jmax, &jlo2, &jhi2,
                                                    &w.kr[cur ^ 1], &w.vr[cur ^ 1]) : 0;
        pkv_rows *kr = &w.kr[cur], *vr = &w.vr[cur];
        kr->pf_data = w.kr[cur ^ 1].data; kr->pf_sraw = w.kr[cur ^ 1].sraw; kr->pf_nt = nt2;
        vr->pf_data = w.vr[cur ^ 1].data; vr->pf_sraw = w.vr[cur ^ 1].sraw; vr->pf_nt = nt2;
        if (nt > 0) {
            decode_scales(ks, kr, nt, H, D);
            decode_scales(vs, vr, nt, H, D);
            decode_rows(ks, &klc, kr, h, nt, H, D, w.krows, NULL);
            decode_rows(vs, &vlc, vr, h, nt, H, D, w.vrows, NULL);
            for (int i = nt; i < BSP; i++) {  /* padding keys: finite zeros (their p is 0) */
                memset(w.krows + (int64_t)i * D, 0, sizeof(float) * D);
                memset(w.vrows + (int64_t)i * D, 0, sizeof(float) * D);
            }
#ifdef PF_BF16
            if (bf & 1) pf_panel_bf16(w.krows, BSP, D, w.kb, w.kt);
            else pf_panel(w.krows, BSP, D, w.kt);
            if (bf & 2) pf_vpanel_bf16(w.vrows, BSP, D, w.vb);
#else
            pf_panel(w.krows, BSP, D, w.kt);
#endif
            pf_chunk(a, &w, M, G, D, BSP, jlo, jhi);
            *nv += nt;
        }
        nt = nt2; jlo = jlo2; jhi = jhi2; cur ^= 1;
    }
    _mm_setcsr(csr);
    pf_fold_l(w.l, M);
    pf_finish(a, vs, t, w.m, w.l, w.acc, 1, D);
    pf_free(&w);
    return 0;
}

/* pkv_prefill / pkv_prefill_bf16 (bf_mode: 0 exact, bits 1 / 2: bf16 scores / values). */
static int pf_prefill(const pkv_args *a, const pkv_side *ks, const pkv_side *vs, int bf_mode) {
    const int B = a->num_seqs, H = a->num_kv_heads, Hq = a->num_q_heads, D = a->head_dim;
    if (B < 0 || H <= 0 || Hq % H || D <= 0 || D % 16 || D > 1024 || a->block_size <= 0 || a->rows_per_tile <= 0 ||
        a->sparse_thr > 0 || a->int8_scores)
        return -2;
    if (!side_ok(ks, D)) return -3;
    if (!side_ok(vs, D)) return -4;
    const int RT = a->rows_per_tile;
    int64_t ntask = 0;
    for (int b = 0; b < B; b++) ntask += (int64_t)H * ((a->query_start[b + 1] - a->query_start[b] + RT - 1) / RT);
    pf_task *tasks = malloc(sizeof(pf_task) * (size_t)(ntask ? ntask : 1));
    if (!tasks) return -1;
    int64_t it = 0;
    for (int b = 0; b < B; b++) {
        const int qlen = a->query_start[b + 1] - a->query_start[b];
        for (int r0 = 0; r0 < qlen; r0 += RT)
            for (int h = 0; h < H; h++) {
                pf_task *t = &tasks[it++];
                t->b = b; t->h = h; t->r0 = r0; t->r1 = imin(qlen, r0 + RT);
            }
    }
    int failed = 0;
    int64_t nv = 0;
    const int threads = a->num_threads > 0 ? a->num_threads : 1;
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) reduction(+ : nv) reduction(| : failed)
#endif
    for (int64_t i = 0; i < ntask; i++) failed |= pf_run(a, ks, vs, &tasks[i], &nv, bf_mode) != 0;
    (void)threads;
    if (a->stats) a->stats[0] += nv;
    free(tasks);
    return failed ? -1 : 0;
}

/* Prefill attention of packed varlen queries (see pkv_attention for the arguments; rows_per_tile
 * = query rows per task here). Returns 0, -1 (out of memory), -2 (bad arguments or a case this
 * tile does not cover: sparse V, integer scores), -3 / -4 (a K / V side the kernel does not read). */
int pkv_prefill(const pkv_args *a, const pkv_side *ks, const pkv_side *vs) { return pf_prefill(a, ks, vs, 0); }

/* pkv_prefill with bf16 products (AttentionParams.bf16_dots; AVX-512 BF16 builds): q and the K
 * panel rounded to bf16 (RNE) for the scores, p and the V panel for the values, products summed in
 * fp32 by vdpbf16ps; softmax, denominators and everything else as pkv_prefill. head_dim not a
 * multiple of 32: exact scores, bf16 values. The error bound is derived in tests/test_cpu_prefill.py
 * (bf16_bound).
 * Builds without AVX512_BF16: -2. */
int pkv_prefill_bf16(const pkv_args *a, const pkv_side *ks, const pkv_side *vs) {
#ifdef PF_BF16
    return pf_prefill(a, ks, vs, 3);
#else
    (void)a; (void)ks; (void)vs;
    return -2;
#endif
}
int pkv_prefill_bf16_available(void) {
#ifdef PF_BF16
    return 1;
#else
    return 0;
#endif
}
#else
int pkv_prefill_available(void) { return 0; }
int pkv_prefill(const pkv_args *a, const pkv_side *ks, const pkv_side *vs) {
    (void)a; (void)ks; (void)vs;
    return -2;
}
int pkv_prefill_bf16_available(void) { return 0; }
int pkv_prefill_bf16(const pkv_args *a, const pkv_side *ks, const pkv_side *vs) {
    (void)a; (void)ks; (void)vs;
    return -2;
}
#endif /* PKV_AVX2 || PKV_AVX512 */
