/*
 * qsched native INT8 kernels: TFLite reference-kernel arithmetic, bit for bit, over
 * stacked tensors (a leading set axis S: 1, or P perturbed copies).
 *
 * Built on first use by qsched.zo.native with the system C compiler and loaded with
 * ctypes. The Python side (qsched.zo.kernels_int8) is the specification; this file
 * computes the same integers faster:
 *
 * - convolution and dense: im2col of a few output pixels at a time into a small int16
 *   buffer (x - zero_point, padding cells 0), then an integer GEMM against weights
 *   packed as int16 pairs (k, k+1) per output channel, accumulated in int32;
 * - depthwise convolution: per output pixel, taps accumulated over contiguous channels;
 * - requantisation fused into the store (see requant_row);
 * - and, apart from the INT8 engine, the float32 sum of an update's terms
 *   (qs_accumulate_signed) and the perturbations' sign bits (qs_rademacher_rows).
 *
 * Bounds. |x - zp| <= 255 and |w| <= 128, so a product is below 2^15 and the sum of a
 * pair below 2^16: int16 operands and the pairwise int32 multiply-add (vpmaddwd) are
 * exact. The int32 accumulator of K products and the bias (TFLite's too) cannot overflow
 * while K * 128 * 255 + |bias| < 2^31; the Python side refuses layers beyond that.
 *
 * Convolution patches come from a centred int16 copy of the input with its padding
 * cells (zero) around it; depthwise interior pixels take two taps per multiply-add.
 * No allocation happens per pixel: each call allocates its packed weights and one
 * scratch block per thread, and frees them before returning.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>

#if defined(__AVX2__)
#include <immintrin.h>
#define QS_SIMD 1
#else
#define QS_SIMD 0
#endif

/* Output pixels per GEMM tile: 16 accumulators fit AVX-512's 32 vector registers. */
#if defined(__AVX512VL__)
#define MR 8
#else
#define MR 4
#endif
#define NR 8          /* output channels per vector (int32 x 8) */
#define MAX_THREADS 64

static int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

static void *alloc64(size_t bytes) {
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes ? bytes : 64) != 0) return NULL;
    return p;
}

/* ------------------------------------------------------------- requantisation
 *
 * Per output channel the Python side precomputes five int64 values (rows of rq, each
 * row `stride` long): left shift, multiplier, additive term, threshold, right shift.
 * With them TFLite's MultiplyByQuantizedMultiplier is
 *
 *     xs = (int32)(x << left)                       (the C code shifts in int32)
 *     t  = xs * multiplier + add
 *     t -= 2^31 if t < threshold
 *     y  = t >> right
 *
 * For the reference (double rounding) build, add = 2^30 + half * 2^31 with
 * half = 2^(e-1) for a right shift e = -shift > 0, threshold = half * 2^31, right =
 * 31 + e: SaturatingRoundingDoublingHighMul followed by RoundingDivideByPOT fused into
 * one shift (proof in fixedpoint._double_rounding_right_shift). For the single-rounding
 * build, add = 2^(right - 1), right = 31 - shift, and a threshold no t reaches. Every
 * term stays below 2^63: |xs * m| < 2^62 and add <= 2^61.
 */
static void requant_row(const int32_t *restrict acc, int64_t n, const int64_t *restrict rq,
                        int64_t stride, int32_t zp, int32_t lo, int32_t hi, int8_t *restrict out) {
    const int64_t *restrict left = rq, *restrict mult = rq + stride, *restrict add = rq + 2 * stride;
    const int64_t *restrict thr = rq + 3 * stride, *restrict right = rq + 4 * stride;
#pragma GCC ivdep
    for (int64_t j = 0; j < n; j++) {
        const int32_t xs = (int32_t)((uint32_t)acc[j] << left[j]);
        int64_t t = (int64_t)xs * mult[j] + add[j];
        t -= (t < thr[j]) ? ((int64_t)1 << 31) : 0;
        t >>= right[j];
        t += zp;
        t = t < lo ? lo : t;
        t = t > hi ? hi : t;
        out[j] = (int8_t)t;
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define RQ_SPLIT 1
#else
#define RQ_SPLIT 0
#endif

/* Row length of a tiled requantisation table for len values (whole blocks of 16). */
static int64_t rq_stride(int64_t len) { return round_up(len, 16); }

/*
 * rq (rows of `stride`) for channels [0, n) repeated `times` times, in rows of
 * rq_stride(n * times). With AVX-512 each block of 16 values is stored split, the 8 even
 * positions first, then the 8 odd ones: the layout of the two int64 halves that
 * requant_tiled computes in.
 */
static int64_t *tile_rq(const int64_t *rq, int64_t stride, int64_t n, int64_t times) {
    const int64_t len = n * times, rs = rq_stride(len);
    int64_t *t = alloc64(sizeof(int64_t) * 5 * rs);
    if (!t) return NULL;
    memset(t, 0, sizeof(int64_t) * 5 * rs);
    for (int64_t r = 0; r < 5; r++)
        for (int64_t i = 0; i < len; i++) {
            const int64_t k = i % 16;
            const int64_t pos = RQ_SPLIT ? i - k + (k % 2 ? 8 + k / 2 : k / 2) : i;
            t[r * rs + pos] = rq[r * stride + i % n];
        }
    return t;
}

#if RQ_SPLIT
/*
 * requant_row over a table from tile_rq, 16 values per step: the even and the odd int32
 * lanes are taken as int64 lanes in place (a signed 32 x 32 -> 64 multiply reads the low
 * half of each 64-bit lane, and the left shift happens in that half, so it wraps as in
 * int32), clamped in int64 (a single-rounding result may exceed int32), then interleaved
 * back.
 */
static void requant_tiled(const int32_t *restrict acc, int64_t n, const int64_t *restrict rq,
                          int64_t stride, int32_t zp, int32_t lo, int32_t hi,
                          int8_t *restrict out) {
    const __m512i c31 = _mm512_set1_epi64((int64_t)1 << 31);
    const __m512i vlo = _mm512_set1_epi64((int64_t)lo - zp);
    const __m512i vhi = _mm512_set1_epi64((int64_t)hi - zp);
    const __m512i vzp = _mm512_set1_epi32(zp);
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 k = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1);
        const __m512i x = _mm512_maskz_loadu_epi32(k, acc + j);
        __m512i half[2];
        for (int h = 0; h < 2; h++) {
            const int64_t *q = rq + j + 8 * h;
            __m512i v = h ? _mm512_srli_epi64(x, 32) : x;
            v = _mm512_sllv_epi64(v, _mm512_loadu_si512(q));
            __m512i t = _mm512_mul_epi32(v, _mm512_loadu_si512(q + stride));
            t = _mm512_add_epi64(t, _mm512_loadu_si512(q + 2 * stride));
            const __mmask8 neg = _mm512_cmplt_epi64_mask(t, _mm512_loadu_si512(q + 3 * stride));
            t = _mm512_mask_sub_epi64(t, neg, t, c31);
            t = _mm512_srav_epi64(t, _mm512_loadu_si512(q + 4 * stride));
            half[h] = _mm512_min_epi64(_mm512_max_epi64(t, vlo), vhi);
        }
        __m512i r = _mm512_mask_blend_epi32((__mmask16)0xAAAA, half[0],
                                            _mm512_slli_epi64(half[1], 32));
        r = _mm512_add_epi32(r, vzp);
        _mm512_mask_cvtepi32_storeu_epi8(out + j, k, r);
    }
}
#else
#define requant_tiled requant_row
#endif

/* ------------------------------------------------------------------- threads */

typedef void (*work_fn)(void *ctx, int64_t lo, int64_t hi);
typedef struct { work_fn fn; void *ctx; int64_t lo, hi; } job_t;

static void *job_main(void *arg) {
    job_t *j = (job_t *)arg;
    j->fn(j->ctx, j->lo, j->hi);
    return NULL;
}

/* Split [0, total) into `threads` contiguous ranges; the calling thread takes the first. */
static void parallel_for(work_fn fn, void *ctx, int64_t total, int64_t threads) {
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > total) threads = total;
    if (threads <= 1) { fn(ctx, 0, total); return; }
    job_t jobs[MAX_THREADS];
    pthread_t tid[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int64_t t = 0; t < threads; t++) {
        jobs[t] = (job_t){fn, ctx, total * t / threads, total * (t + 1) / threads};
    }
    for (int64_t t = 1; t < threads; t++)
        started[t] = pthread_create(&tid[t], NULL, job_main, &jobs[t]) == 0;
    fn(ctx, jobs[0].lo, jobs[0].hi);
    for (int64_t t = 1; t < threads; t++) {
        if (started[t]) pthread_join(tid[t], NULL);
        else fn(ctx, jobs[t].lo, jobs[t].hi); /* could not start: run it here */
    }
}

/* ---------------------------------------------------------------- GEMM tile
 *
 * acc[MR][opad] = bias + X[MR][kp] . W, with W packed as [kp/2][opad][2] int16 (the
 * pair k, k+1 of channel o adjacent), X rows of kp int16 (kp even, a zero pad at the end
 * when K is odd).
 */
#if QS_SIMD
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DOT2(acc, x, w) _mm256_dpwssd_epi32((acc), (x), (w))
#else
#define DOT2(acc, x, w) _mm256_add_epi32((acc), _mm256_madd_epi16((x), (w)))
#endif

static inline __m256i bcast_pair(const int16_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm256_set1_epi32(v);
}

static void gemm_tile(const int16_t *X, int64_t kp, const int16_t *W, int64_t opad,
                      const int32_t *bias, int32_t *acc) {
    const int64_t kh = kp / 2;
    int64_t o0 = 0;
    for (; o0 + 2 * NR <= opad; o0 += 2 * NR) {
        const __m256i b0 = _mm256_loadu_si256((const __m256i *)(bias + o0));
        const __m256i b1 = _mm256_loadu_si256((const __m256i *)(bias + o0 + NR));
        __m256i a[MR][2];
#pragma GCC unroll 16
        for (int r = 0; r < MR; r++) { a[r][0] = b0; a[r][1] = b1; }
        for (int64_t k = 0; k < kh; k++) {
            const int16_t *wp = W + (k * opad + o0) * 2;
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)wp);
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(wp + 2 * NR));
#pragma GCC unroll 16
            for (int r = 0; r < MR; r++) {
                const __m256i x = bcast_pair(X + r * kp + 2 * k);
                a[r][0] = DOT2(a[r][0], x, w0);
                a[r][1] = DOT2(a[r][1], x, w1);
            }
        }
#pragma GCC unroll 16
        for (int r = 0; r < MR; r++) {
            _mm256_storeu_si256((__m256i *)(acc + r * opad + o0), a[r][0]);
            _mm256_storeu_si256((__m256i *)(acc + r * opad + o0 + NR), a[r][1]);
        }
    }
    for (; o0 < opad; o0 += NR) {
        const __m256i b0 = _mm256_loadu_si256((const __m256i *)(bias + o0));
        __m256i a[MR];
#pragma GCC unroll 16
        for (int r = 0; r < MR; r++) a[r] = b0;
        for (int64_t k = 0; k < kh; k++) {
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)(W + (k * opad + o0) * 2));
#pragma GCC unroll 16
            for (int r = 0; r < MR; r++) a[r] = DOT2(a[r], bcast_pair(X + r * kp + 2 * k), w0);
        }
#pragma GCC unroll 16
        for (int r = 0; r < MR; r++) _mm256_storeu_si256((__m256i *)(acc + r * opad + o0), a[r]);
    }
}
#else
static void gemm_tile(const int16_t *X, int64_t kp, const int16_t *W, int64_t opad,
                      const int32_t *bias, int32_t *acc) {
    for (int64_t r = 0; r < MR; r++) {
        int32_t *a = acc + r * opad;
        for (int64_t o = 0; o < opad; o++) a[o] = bias[o];
        for (int64_t k = 0; k < kp / 2; k++) {
            const int32_t x0 = X[r * kp + 2 * k], x1 = X[r * kp + 2 * k + 1];
            const int16_t *wp = W + k * opad * 2;
            for (int64_t o = 0; o < opad; o++) a[o] += x0 * wp[2 * o] + x1 * wp[2 * o + 1];
        }
    }
}
#endif

/* --------------------------------------------------------------- convolution */

typedef struct {
    const int8_t *x; int64_t sx, n, h, w, c;
    int64_t sw, o, kh, kw, groups;
    int64_t sh, sww, pt, pl, oh, ow;
    int32_t in_zp, zp, lo, hi;
    const int64_t *rq;
    int64_t so;           /* output sets */
    int64_t ig, og, k, kp, opad;
    int pointwise;        /* 1x1 kernel, stride 1, no padding, groups 1 */
    int64_t hp, wp;       /* padded image size */
    const int16_t *wpack; /* [sw][groups][kp/2][opad][2] */
    const int64_t *rqt;   /* requantisation tiled MR times (groups == 1, opad == o), or NULL */
    const int32_t *bpack; /* [sb][groups][opad] */
    int64_t sb;
    int8_t *out;
    int status;
} conv_ctx;

/*
 * Samples [n0, n1) of one set, centred (x - zp) as int16, in an image with the padding
 * cells around it. The borders are zeroed once, when the buffer is allocated, and never
 * written: padding contributes 0, as the reference kernel skips it.
 */
static void centre_padded(const conv_ctx *c, const int8_t *xs, int64_t n0, int64_t n1,
                          int16_t *restrict xpad) {
    const int64_t rowlen = c->w * c->c, zp = c->in_zp;
    for (int64_t nn = n0; nn < n1; nn++)
        for (int64_t y = 0; y < c->h; y++) {
            const int8_t *restrict src = xs + (nn * c->h + y) * rowlen;
            int16_t *restrict dst = xpad + (((nn - n0) * c->hp + y + c->pt) * c->wp + c->pl) * c->c;
            for (int64_t t = 0; t < rowlen; t++) dst[t] = (int16_t)(src[t] - zp);
        }
}

/*
 * Patches of output pixels m0 .. m0+rows-1 (flat over samples, the first sample n0) for
 * group g into X (rows of kp; the zero pad column when K is odd is never written).
 */
static void gather(const conv_ctx *c, const int8_t *xs, const int16_t *xpad, int64_t n0,
                   int64_t m0, int64_t rows, int64_t g, int16_t *restrict X) {
    const int64_t ohw = c->oh * c->ow;
    if (c->pointwise) {  /* 1x1, stride 1, no padding, one group: patches are input rows */
        const int8_t *restrict src = xs + m0 * c->c;
        const int64_t zp = c->in_zp;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t t = 0; t < c->k; t++) X[r * c->kp + t] = (int16_t)(src[r * c->k + t] - zp);
        return;
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t m = m0 + r, nn = m / ohw - n0, oy = (m % ohw) / c->ow, ox = m % c->ow;
        const int16_t *base = xpad + ((nn * c->hp + oy * c->sh) * c->wp + ox * c->sww) * c->c;
        int16_t *row = X + r * c->kp;
        for (int64_t i = 0; i < c->kh; i++) {
            const int16_t *src = base + i * c->wp * c->c;
            if (c->groups == 1) {  /* a kernel row's taps are adjacent in the image */
                memcpy(row + i * c->kw * c->c, src, sizeof(int16_t) * c->kw * c->c);
                continue;
            }
            for (int64_t j = 0; j < c->kw; j++)
                memcpy(row + (i * c->kw + j) * c->ig, src + j * c->c + g * c->ig, sizeof(int16_t) * c->ig);
        }
    }
}

static void conv_tile(conv_ctx *c, int64_t s, int64_t g, int64_t m0, int64_t rows,
                      const int16_t *X, int32_t *acc) {
    const int64_t ohw = c->oh * c->ow;
    const int64_t wsz = c->groups * (c->kp / 2) * c->opad * 2, bsz = c->groups * c->opad;
    const int16_t *W = c->wpack + (c->sw > 1 ? s : 0) * wsz + g * (c->kp / 2) * c->opad * 2;
    const int32_t *B = c->bpack + (c->sb > 1 ? s : 0) * bsz + g * c->opad;
    gemm_tile(X, c->kp, W, c->opad, B, acc);
    int8_t *dst = c->out + (s * c->n * ohw + m0) * c->o + g * c->og;
    if (c->rqt) {  /* the tile's rows are contiguous in the output */
        requant_tiled(acc, rows * c->o, c->rqt, rq_stride(MR * c->o), c->zp, c->lo, c->hi, dst);
        return;
    }
    for (int64_t r = 0; r < rows; r++)
        requant_row(acc + r * c->opad, c->og, c->rq + g * c->og, c->o, c->zp, c->lo, c->hi,
                    dst + r * c->o);
}

static void conv_work(void *arg, int64_t n0, int64_t n1) {
    conv_ctx *c = (conv_ctx *)arg;
    const int64_t ohw = c->oh * c->ow, xsz = c->n * c->h * c->w * c->c;
    const int64_t padsz = c->pointwise ? 1 : (n1 - n0) * c->hp * c->wp * c->c;
    int16_t *X = alloc64(sizeof(int16_t) * MR * c->kp);
    int32_t *acc = alloc64(sizeof(int32_t) * MR * c->opad);
    int16_t *xpad = alloc64(sizeof(int16_t) * padsz);
    if (!X || !acc || !xpad) { c->status = 1; free(X); free(acc); free(xpad); return; }
    memset(X, 0, sizeof(int16_t) * MR * c->kp);
    memset(xpad, 0, sizeof(int16_t) * padsz);
    const int64_t mbeg = n0 * ohw, mend = n1 * ohw;
    if (c->sx == 1) {  /* shared input: each tile's patches serve every set */
        if (!c->pointwise) centre_padded(c, c->x, n0, n1, xpad);
        for (int64_t m0 = mbeg; m0 < mend; m0 += MR) {
            const int64_t rows = mend - m0 < MR ? mend - m0 : MR;
            for (int64_t g = 0; g < c->groups; g++) {
                gather(c, c->x, xpad, n0, m0, rows, g, X);
                for (int64_t s = 0; s < c->so; s++) conv_tile(c, s, g, m0, rows, X, acc);
            }
        }
    } else {
        for (int64_t s = 0; s < c->so; s++) {
            const int8_t *xs = c->x + s * xsz;
            if (!c->pointwise) centre_padded(c, xs, n0, n1, xpad);
            for (int64_t m0 = mbeg; m0 < mend; m0 += MR) {
                const int64_t rows = mend - m0 < MR ? mend - m0 : MR;
                for (int64_t g = 0; g < c->groups; g++) {
                    gather(c, xs, xpad, n0, m0, rows, g, X);
                    conv_tile(c, s, g, m0, rows, X, acc);
                }
            }
        }
    }
    free(X);
    free(acc);
    free(xpad);
}

/*
 * Per-channel int8 convolution (reference_integer_ops::ConvPerChannel), also used for
 * FULLY_CONNECTED (a 1x1 kernel on a 1x1 image).
 *   x:    [sx][n][h][w][c] int8            weight: [sw][o][kh][kw][c/groups] int8
 *   bias: [sb][o] int32                    rq:     [5][o] int64 (see requant_row)
 *   out:  [so][n][oh][ow][o] int8, so = max(sx, sw, sb); sets of 1 broadcast.
 * Returns 0, or 1 when scratch memory could not be allocated.
 */
int qs_conv(const int8_t *x, int64_t sx, int64_t n, int64_t h, int64_t w, int64_t c,
            const int8_t *weight, int64_t sw, int64_t o, int64_t kh, int64_t kw, int64_t groups,
            const int32_t *bias, int64_t sb, int64_t sh, int64_t sww, int64_t pt, int64_t pl,
            int64_t oh, int64_t ow, int64_t in_zp, const int64_t *rq, int64_t zp, int64_t lo,
            int64_t hi, int8_t *out, int64_t threads) {
    conv_ctx cx = {x, sx, n, h, w, c, sw, o, kh, kw, groups, sh, sww, pt, pl, oh, ow,
                   (int32_t)in_zp, (int32_t)zp, (int32_t)lo, (int32_t)hi, rq, 0,
                   0, 0, 0, 0, 0, 0, 0, 0, NULL, NULL, NULL, sb, out, 0};
    cx.so = sx > sw ? sx : sw;
    cx.so = cx.so > sb ? cx.so : sb;
    cx.ig = c / groups;
    cx.og = o / groups;
    cx.k = kh * kw * cx.ig;
    cx.kp = round_up(cx.k, 2);
    cx.opad = round_up(cx.og, NR);
    const int64_t pb = (oh - 1) * sh + kh - pt - h, pr = (ow - 1) * sww + kw - pl - w;
    cx.hp = h + pt + (pb > 0 ? pb : 0);
    cx.wp = w + pl + (pr > 0 ? pr : 0);
    cx.pointwise = kh == 1 && kw == 1 && sh == 1 && sww == 1 && pt == 0 && pl == 0 && groups == 1 &&
                   oh == h && ow == w;
    const int64_t wsz = groups * (cx.kp / 2) * cx.opad * 2;
    int16_t *wpack = alloc64(sizeof(int16_t) * sw * wsz);
    int32_t *bpack = alloc64(sizeof(int32_t) * sb * groups * cx.opad);
    int64_t *rqt = groups == 1 && cx.opad == o ? tile_rq(rq, o, o, MR) : NULL;
    if (!wpack || !bpack || (groups == 1 && cx.opad == o && !rqt)) {
        free(wpack); free(bpack); free(rqt);
        return 1;
    }
    cx.rqt = rqt;
    memset(wpack, 0, sizeof(int16_t) * sw * wsz);
    memset(bpack, 0, sizeof(int32_t) * sb * groups * cx.opad);
    for (int64_t s = 0; s < sw; s++)
        for (int64_t oc = 0; oc < o; oc++) {
            const int64_t g = oc / cx.og, oo = oc % cx.og;
            const int8_t *src = weight + (s * o + oc) * cx.k;
            int16_t *dst = wpack + s * wsz + g * (cx.kp / 2) * cx.opad * 2;
            for (int64_t k = 0; k < cx.k; k++) dst[((k / 2) * cx.opad + oo) * 2 + (k & 1)] = src[k];
        }
    for (int64_t s = 0; s < sb; s++)
        for (int64_t oc = 0; oc < o; oc++)
            bpack[(s * groups + oc / cx.og) * cx.opad + oc % cx.og] = bias[s * o + oc];
    cx.wpack = wpack;
    cx.bpack = bpack;
    parallel_for(conv_work, &cx, n, threads);
    free(wpack);
    free(bpack);
    free(rqt);
    return cx.status;
}

/* ------------------------------------------------------------------ depthwise */

typedef struct {
    const int8_t *x; int64_t sx, n, h, w, c;
    const int8_t *wt; int64_t sw, o, kh, kw;   /* wt: [sw][kh*kw][o] int8 */
    const int32_t *bias; int64_t sb;
    int64_t sh, sww, pt, pl, oh, ow, so;
    int32_t in_zp, zp, lo, hi;
    const int64_t *rqt;                        /* requantisation, tiled to ow * o */
    const int64_t *offs;                       /* tap t's input offset from the window's corner */
    int8_t *out;
    int status;
} dw_ctx;

/* acc[t] += x[t] * w[t] over one output row's taps: a long loop over (ox, channel). */
static void mac_i8(int32_t *restrict acc, const int8_t *restrict x, const int16_t *restrict w,
                   int64_t len, int32_t zp) {
    for (int64_t t = 0; t < len; t++) acc[t] += (int32_t)(int16_t)(x[t] - zp) * w[t];
}

static void mac_i16(int32_t *restrict acc, const int16_t *restrict x, const int16_t *restrict w,
                    int64_t len) {
    for (int64_t t = 0; t < len; t++) acc[t] += (int32_t)x[t] * w[t];
}

/* Centred input under tap column jj for every output column of row iy (0 off the edge). */
static void dw_row(const dw_ctx *d, const int8_t *xrow, int64_t jj, int16_t *restrict xb) {
    const int64_t o = d->o, dm = d->o / d->c;
    for (int64_t ox = 0; ox < d->ow; ox++) {
        const int64_t ix = ox * d->sww - d->pl + jj;
        int16_t *dst = xb + ox * o;
        if (ix < 0 || ix >= d->w) {
            memset(dst, 0, sizeof(int16_t) * o);
            continue;
        }
        const int8_t *src = xrow + ix * d->c;
        if (dm == 1) {
            for (int64_t j = 0; j < o; j++) dst[j] = (int16_t)(src[j] - d->in_zp);
        } else {
            for (int64_t ci = 0; ci < d->c; ci++)
                for (int64_t q = 0; q < dm; q++) dst[ci * dm + q] = (int16_t)(src[ci] - d->in_zp);
        }
    }
}

#if QS_SIMD
/*
 * Weights of one set for the interior path: taps in pairs (t, t+1; a zero tap completes
 * an odd count), 16 channels per block, interleaved as unpacklo/unpackhi interleave the
 * inputs so that one pairwise multiply-add covers two taps of 8 channels.
 * w2: [pairs][o / 16][2][16] int16.
 */
static void dw_pair_weights(const int8_t *ws, int64_t taps, int64_t o, int16_t *w2) {
    const int64_t pairs = (taps + 1) / 2;
    for (int64_t p = 0; p < pairs; p++)
        for (int64_t cb = 0; cb < o / 16; cb++) {
            const int8_t *w0 = ws + 2 * p * o + cb * 16;
            __m256i a = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)w0));
            __m256i b = _mm256_setzero_si256();
            if (2 * p + 1 < taps) b = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w0 + o)));
            int16_t *dst = w2 + (p * (o / 16) + cb) * 32;
            _mm256_storeu_si256((__m256i *)dst, _mm256_unpacklo_epi16(a, b));
            _mm256_storeu_si256((__m256i *)(dst + 16), _mm256_unpackhi_epi16(a, b));
        }
}

/*
 * An output pixel whose window lies inside the image: every tap valid, two taps per
 * multiply-add. |x - zp| * |w| * 2 < 2^17, exact in the int32 lanes.
 */
static void dw_interior(const dw_ctx *d, const int8_t *base, const int16_t *w2, const int32_t *bs,
                        int32_t *accpix) {
    const int64_t o = d->o, taps = d->kh * d->kw, pairs = (taps + 1) / 2;
    const __m256i zp = _mm256_set1_epi16((int16_t)d->in_zp);
    for (int64_t cb = 0; cb < o / 16; cb++) {
        __m256i alo = _mm256_setzero_si256(), ahi = _mm256_setzero_si256();
        for (int64_t p = 0; p < pairs; p++) {
            const int8_t *x0 = base + d->offs[2 * p] + cb * 16;
            const int8_t *x1 = base + d->offs[2 * p + 1 < taps ? 2 * p + 1 : 2 * p] + cb * 16;
            __m256i a = _mm256_sub_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)x0)), zp);
            __m256i b = _mm256_sub_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)x1)), zp);
            const int16_t *wp = w2 + (p * (o / 16) + cb) * 32;
            alo = DOT2(alo, _mm256_unpacklo_epi16(a, b), _mm256_loadu_si256((const __m256i *)wp));
            ahi = DOT2(ahi, _mm256_unpackhi_epi16(a, b), _mm256_loadu_si256((const __m256i *)(wp + 16)));
        }
        /* alo holds channels 0-3 and 8-11, ahi 4-7 and 12-15 */
        __m256i c0 = _mm256_permute2x128_si256(alo, ahi, 0x20);
        __m256i c1 = _mm256_permute2x128_si256(alo, ahi, 0x31);
        c0 = _mm256_add_epi32(c0, _mm256_loadu_si256((const __m256i *)(bs + cb * 16)));
        c1 = _mm256_add_epi32(c1, _mm256_loadu_si256((const __m256i *)(bs + cb * 16 + 8)));
        _mm256_storeu_si256((__m256i *)(accpix + cb * 16), c0);
        _mm256_storeu_si256((__m256i *)(accpix + cb * 16 + 8), c1);
    }
}

/*
 * One output row, channels in vectors of NR, taps accumulated in registers. Needs
 * depth multiplier 1 and o % NR == 0; w32 holds the set's weights widened, [taps][o].
 */
static void dw_row_simd(const dw_ctx *d, const int8_t *xs, int64_t nn, int64_t oy,
                        const int32_t *w32, const int16_t *w2, const int32_t *bs, int32_t *accrow) {
    const int64_t o = d->o;
    const __m256i zp = _mm256_set1_epi32(d->in_zp);
    int64_t i0 = d->pt - oy * d->sh, i1 = d->h + d->pt - oy * d->sh;
    i0 = i0 < 0 ? 0 : i0;
    i1 = i1 > d->kh ? d->kh : i1;
    for (int64_t ox = 0; ox < d->ow; ox++) {
        int64_t j0 = d->pl - ox * d->sww, j1 = d->w + d->pl - ox * d->sww;
        j0 = j0 < 0 ? 0 : j0;
        j1 = j1 > d->kw ? d->kw : j1;
        const int64_t iy0 = oy * d->sh - d->pt, ix0 = ox * d->sww - d->pl;
        if (w2 && i0 == 0 && i1 == d->kh && j0 == 0 && j1 == d->kw) {
            dw_interior(d, xs + ((nn * d->h + iy0) * d->w + ix0) * o, w2, bs, accrow + ox * o);
            continue;
        }
        for (int64_t c0 = 0; c0 < o; c0 += NR) {
            __m256i acc = _mm256_loadu_si256((const __m256i *)(bs + c0));
            for (int64_t i = i0; i < i1; i++) {
                const int8_t *xr = xs + ((nn * d->h + iy0 + i) * d->w + ix0) * o + c0;
                const int32_t *wr = w32 + i * d->kw * o + c0;
                for (int64_t j = j0; j < j1; j++) {
                    __m128i raw = _mm_loadl_epi64((const __m128i *)(xr + j * o));
                    __m256i xv = _mm256_sub_epi32(_mm256_cvtepi8_epi32(raw), zp);
                    __m256i wv = _mm256_loadu_si256((const __m256i *)(wr + j * o));
                    acc = _mm256_add_epi32(acc, _mm256_mullo_epi32(xv, wv));
                }
            }
            _mm256_storeu_si256((__m256i *)(accrow + ox * o + c0), acc);
        }
    }
}
#endif

static void dw_work(void *arg, int64_t n0, int64_t n1) {
    dw_ctx *d = (dw_ctx *)arg;
    const int64_t o = d->o, row = d->ow * o, taps = d->kh * d->kw;
    const int64_t xsz = d->n * d->h * d->w * d->c;
    const int fast = d->o == d->c && d->sww == 1;
    int32_t *acc = alloc64(sizeof(int32_t) * row), *btile = alloc64(sizeof(int32_t) * row);
    int16_t *xb = alloc64(sizeof(int16_t) * row), *wtile = alloc64(sizeof(int16_t) * taps * row);
    int32_t *w32 = alloc64(sizeof(int32_t) * taps * o);
    int16_t *w2 = alloc64(sizeof(int16_t) * (taps + 1) * o);
    if (!acc || !btile || !xb || !wtile || !w32 || !w2) {
        d->status = 1;
        free(acc); free(btile); free(xb); free(wtile); free(w32); free(w2);
        return;
    }
    for (int64_t s = 0; s < d->so; s++) {
        if (s == 0 || d->sw > 1) {  /* weights tiled along the output row */
            const int8_t *ws = d->wt + (d->sw > 1 ? s : 0) * taps * o;
            for (int64_t t = 0; t < taps; t++)
                for (int64_t ox = 0; ox < d->ow; ox++)
                    for (int64_t j = 0; j < o; j++) wtile[t * row + ox * o + j] = ws[t * o + j];
        }
        if (s == 0 || d->sb > 1) {
            const int32_t *bs = d->bias + (d->sb > 1 ? s : 0) * o;
            for (int64_t ox = 0; ox < d->ow; ox++) memcpy(btile + ox * o, bs, sizeof(int32_t) * o);
        }
        const int8_t *xs = d->x + (d->sx > 1 ? s : 0) * xsz;
#if QS_SIMD
        if (d->o == d->c && d->o % NR == 0) {
            const int32_t *bs = d->bias + (d->sb > 1 ? s : 0) * o;
            if (s == 0 || d->sw > 1) {
                const int8_t *ws = d->wt + (d->sw > 1 ? s : 0) * taps * o;
                for (int64_t t = 0; t < taps * o; t++) w32[t] = ws[t];
                if (o % 16 == 0) dw_pair_weights(ws, taps, o, w2);
            }
            for (int64_t nn = n0; nn < n1; nn++)
                for (int64_t oy = 0; oy < d->oh; oy++) {
                    dw_row_simd(d, xs, nn, oy, w32, o % 16 == 0 ? w2 : NULL, bs, acc);
                    int8_t *dst = d->out + ((s * d->n + nn) * d->oh + oy) * row;
                    requant_tiled(acc, row, d->rqt, rq_stride(row), d->zp, d->lo, d->hi, dst);
                }
            continue;
        }
#endif
        for (int64_t nn = n0; nn < n1; nn++)
            for (int64_t oy = 0; oy < d->oh; oy++) {
                memcpy(acc, btile, sizeof(int32_t) * row);
                for (int64_t i = 0; i < d->kh; i++) {
                    const int64_t iy = oy * d->sh - d->pt + i;
                    if (iy < 0 || iy >= d->h) continue;
                    const int8_t *xrow = xs + (nn * d->h + iy) * d->w * d->c;
                    for (int64_t jj = 0; jj < d->kw; jj++) {
                        const int16_t *wt = wtile + (i * d->kw + jj) * row;
                        if (fast) {  /* stride 1, multiplier 1: the input row is contiguous */
                            int64_t lo = d->pl - jj, hi = d->w + d->pl - jj;
                            lo = lo < 0 ? 0 : lo;
                            hi = hi > d->ow ? d->ow : hi;
                            if (hi > lo)
                                mac_i8(acc + lo * o, xrow + (lo - d->pl + jj) * o, wt + lo * o,
                                       (hi - lo) * o, d->in_zp);
                        } else {
                            dw_row(d, xrow, jj, xb);
                            mac_i16(acc, xb, wt, row);
                        }
                    }
                }
                int8_t *dst = d->out + ((s * d->n + nn) * d->oh + oy) * row;
                requant_tiled(acc, row, d->rqt, rq_stride(row), d->zp, d->lo, d->hi, dst);
            }
    }
    free(acc); free(btile); free(xb); free(wtile); free(w32); free(w2);
}

/*
 * Per-channel int8 depthwise convolution (DepthwiseConvPerChannel), 1HWO weights.
 *   x: [sx][n][h][w][c]   weight: [sw][kh][kw][o] (o = c * depth multiplier)
 *   bias: [sb][o] int32   out: [so][n][oh][ow][o]
 */
int qs_depthwise(const int8_t *x, int64_t sx, int64_t n, int64_t h, int64_t w, int64_t c,
                 const int8_t *weight, int64_t sw, int64_t o, int64_t kh, int64_t kw,
                 const int32_t *bias, int64_t sb, int64_t sh, int64_t sww, int64_t pt, int64_t pl,
                 int64_t oh, int64_t ow, int64_t in_zp, const int64_t *rq, int64_t zp, int64_t lo,
                 int64_t hi, int8_t *out, int64_t threads) {
    int64_t *rqt = tile_rq(rq, o, o, ow);
    int64_t *offs = alloc64(sizeof(int64_t) * kh * kw);
    if (!rqt || !offs) { free(rqt); free(offs); return 1; }
    for (int64_t t = 0; t < kh * kw; t++) offs[t] = ((t / kw) * w + t % kw) * c;
    int64_t so = sx > sw ? sx : sw;
    so = so > sb ? so : sb;
    dw_ctx d = {x, sx, n, h, w, c, weight, sw, o, kh, kw, bias, sb, sh, sww, pt, pl, oh, ow, so,
                (int32_t)in_zp, (int32_t)zp, (int32_t)lo, (int32_t)hi, rqt, offs, out, 0};
    parallel_for(dw_work, &d, n, threads);
    free(rqt);
    free(offs);
    return d.status;
}

/* ------------------------------------------------------------------------ add */

/* MultiplyByQuantizedMultiplier with fused parameters f = [left, m, add, thr, right]. */
static inline int64_t fused_mbqm(int32_t x, const int64_t *f) {
    const int32_t xs = (int32_t)((uint32_t)x << f[0]);
    int64_t t = (int64_t)xs * f[1] + f[2];
    t -= (t < f[3]) ? ((int64_t)1 << 31) : 0;
    return t >> f[4];
}

/*
 * Element-wise int8 ADD (reference_integer_ops::AddElementwise) of count elements.
 *   p: left_shift, in1 zp, in2 zp, out zp, act min, act max, then fused parameters
 *   (see requant_row) of the in1, in2 and output multipliers, five each.
 */
int qs_add(const int8_t *restrict a, const int8_t *restrict b, int64_t count, const int64_t *p,
           int8_t *restrict out) {
    const int64_t ls = p[0], z1 = p[1], z2 = p[2], zo = p[3], lo = p[4], hi = p[5];
    const int64_t f1[5] = {p[6], p[7], p[8], p[9], p[10]};
    const int64_t f2[5] = {p[11], p[12], p[13], p[14], p[15]};
    const int64_t fo[5] = {p[16], p[17], p[18], p[19], p[20]};
    for (int64_t i = 0; i < count; i++) {
        /* |a - zp| <= 255, shifted by 20: below 2^28, an int32 as in the reference. */
        const int32_t x1 = (int32_t)(((int64_t)a[i] - z1) * ((int64_t)1 << ls));
        const int32_t x2 = (int32_t)(((int64_t)b[i] - z2) * ((int64_t)1 << ls));
        const int64_t y = fused_mbqm(x1, f1) + fused_mbqm(x2, f2);
        int64_t r = fused_mbqm((int32_t)y, fo) + zo;
        r = r < lo ? lo : r;
        r = r > hi ? hi : r;
        out[i] = (int8_t)r;
    }
    return 0;
}

/*
 * The sum of a ZO update's terms (qsched.zo.update.accumulate_delta; SPEC section 4.2):
 * delta[i] += negative[r][i] ? -c[r] : c[r] for r = 0, 1, ... in turn, in float32. Each
 * element's additions run in row order, one rounding each, as numpy's row-by-row sum
 * does (no -ffast-math: the compiler may not reassociate them; -c is exact).
 */
int qs_accumulate_signed(float *restrict delta, const uint8_t *restrict negative,
                         const float *restrict coefficients, int64_t rows, int64_t size) {
    for (int64_t r = 0; r < rows; r++) {
        const float c = coefficients[r], minus_c = -c;
        const uint8_t *row = negative + r * size;
        for (int64_t i = 0; i < size; i++) delta[i] += row[i] ? minus_c : c;
    }
    return 0;
}

/*
 * The sign bits of perturbations (qsched.zo.prng.rademacher_rows; SPEC section "PRNG"):
 * row r, element i is bit (i mod 32) of word ((i mod 128) div 32) of Philox4x32-10 on
 * counter (i div 128, step, ks[r], 0) under key (seed_lo, seed_hi), one byte (0 or 1)
 * each. numpy spends most of a small model's update in the per-call overhead of its
 * ten vectorised rounds; here a block is a few dozen integer operations. The board's
 * firmware has its own Philox (firmware/core/prng.c): this library is built from this
 * one file and the firmware from its own tree, and neither may depend on the other;
 * both are checked against the numpy reference and its known-answer vectors.
 */
static inline void philox_block(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                                uint32_t k0, uint32_t k1, uint32_t out[4]) {
    for (int round = 0; round < 10; round++) {
        if (round) {
            k0 += 0x9E3779B9u; /* uint32 wrap-around is the specified key schedule */
            k1 += 0xBB67AE85u;
        }
        const uint64_t p0 = (uint64_t)0xD2511F53u * c0;
        const uint64_t p1 = (uint64_t)0xCD9E8D57u * c2;
        c0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0;
        c1 = (uint32_t)p1;
        c2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
        c3 = (uint32_t)p0;
    }
    out[0] = c0;
    out[1] = c1;
    out[2] = c2;
    out[3] = c3;
}

/* Byte v spread to eight bytes, bit j of v in byte j (a little-endian uint64). */
static uint64_t spread_table[256];
static pthread_once_t spread_once = PTHREAD_ONCE_INIT;

static void fill_spread_table(void) {
    for (uint64_t v = 0; v < 256; v++) {
        uint64_t bytes = 0;
        for (int j = 0; j < 8; j++) bytes |= ((v >> j) & 1u) << (8 * j);
        spread_table[v] = bytes;
    }
}

/* The 128 bits of one block, one byte each, 8 at a time through the table. */
static void spread_block(const uint32_t words[4], uint8_t *restrict out) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    for (int w = 0; w < 4; w++)
        for (int b = 0; b < 4; b++)
            memcpy(out + 32 * w + 8 * b, &spread_table[(words[w] >> (8 * b)) & 0xFFu], 8);
#else
    for (int i = 0; i < 128; i++) out[i] = (words[i >> 5] >> (i & 31)) & 1u;
#endif
}

int qs_rademacher_rows(uint32_t seed_lo, uint32_t seed_hi, uint32_t step,
                       const uint32_t *restrict ks, int64_t rows, int64_t size,
                       uint8_t *restrict out) {
    pthread_once(&spread_once, fill_spread_table);
    for (int64_t r = 0; r < rows; r++) {
        uint8_t *row = out + r * size;
        for (int64_t start = 0; start < size; start += 128) {
            uint32_t words[4];
            philox_block((uint32_t)(start / 128), step, ks[r], 0, seed_lo, seed_hi, words);
            if (size - start >= 128) {
                spread_block(words, row + start);
                continue;
            }
            for (int64_t i = 0; i < size - start; i++)
                row[start + i] = (words[i >> 5] >> (i & 31)) & 1u;
        }
    }
    return 0;
}

/* Which GEMM path this build uses (for the benchmark's report). */
const char *qs_build_info(void) {
#if QS_SIMD && defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return "avx512-vnni";
#elif QS_SIMD
    return "avx2";
#else
    return "portable";
#endif
}
