/* One-pass figures of a piece of tensor values for `ckpt stats` (ckpt_cli.tensors.moments).
 *
 * piece(values, dtype, hist) gives the count of finite values, their mean, M2 (sum of squared
 * deviations from the mean), sum of squares, min and max, and the counts of zeros, NaN, +Inf
 * and -Inf; it adds each non-zero finite value's binade floor(log2|x|) (clamped to
 * [HIST_LO, HIST_HI]) to hist. pieces(values, dtype, spans, make) does the same for many
 * small pieces of one buffer in one call (a header of a million tiny tensors: one call per run
 * of them, not per tensor). diff_sumsq(a, b, dtype) gives sum((a - b)**2). Same figures
 * as moments.numpy_piece_moments, within rounding; plain C99, no intrinsics, no fast-math
 * (NaN checks and the order of the sums must stay as written).
 *
 * Accuracy: the values are taken in blocks of BLOCK elements (they stay in the L1 cache). A
 * first pass over a block gives its float64 sum (LANES partial sums, written as loops over
 * the lanes so the compiler vectorises them without reordering a sum) and extremes; the
 * block's provisional mean c is sum / count, and a second pass over the cached block gives
 * the sums of (x - c) and (x - c)**2: the block's mean is c + sum(x - c) / count, kept as two
 * doubles, its M2 sum((x - c)**2) - sum(x - c)**2 / count, and its sum of squares
 * sum((x - c)**2) + 2c sum(x - c) + count c**2 (non-negative terms but a tiny one: no
 * cancellation). Blocks are merged with Chan et al.'s update through a binary counter (a
 * partial is merged with one of the same size, as in pairwise summation), so rounding grows
 * with log2(blocks), not with the number of values; the two-double means keep the update
 * exact for values close together (a LayerNorm weight, 1 +- 1e-7 in FP64).
 *
 * The histogram counts the raw exponent fields in four interleaved copies (no store-to-load
 * stall when neighbours share a binade), folded into binades at the end; zeros and
 * subnormals share the field 0, and a block that has any is scanned for them (subnormals get
 * their true binade from the leading zeros of the mantissa). A block holding a NaN or Inf
 * (seen in its exponent counts before the first pass) takes a slower path that skips them.
 * FP16 and BF16 blocks are widened exactly to FP32 first. The loop counting exponents also
 * prefetches the next block. The GIL is released while computing.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 2048
#define LANES 32
#define HIST_LO (-150)
#define HIST_HI 128
#define HIST_BINS (HIST_HI - HIST_LO + 1)
/* Exponent slots: FP32's 8-bit field (255: NaN/Inf); FP64's binade already clamped to the
 * bins (279: NaN/Inf). Slot 0 holds zeros and subnormals (FP64: also binades below HIST_LO). */
#define SLOTS 280
#define COPIES 4
#define STACK 64

enum kind { K_F32, K_F64, K_F16, K_BF16 };
static const char *const KIND_NAMES[] = {"float32", "float64", "float16", "bfloat16"};
static const Py_ssize_t KIND_SIZES[] = {4, 8, 2, 2};

/* The vector loops are compiled twice on x86-64 Linux with GCC, for AVX2 and the baseline
 * (SSE2), and picked when the module loads. Each lane adds the same values in the same order
 * in both (no FMA: setup.py turns contraction off), so the figures are the same bits on every CPU. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__) && \
    !defined(CKPT_NO_CLONES)
#define VECTOR __attribute__((target_clones("avx2", "default")))
#else
#define VECTOR
#endif

#ifdef PREFETCH
/* given by the build */
#elif defined(__GNUC__) || defined(__clang__)
#define PREFETCH(p) __builtin_prefetch(p)
#else
#define PREFETCH(p) ((void)(p))
#endif

static uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static uint64_t f64_bits(double f) {
    uint64_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* Index of the highest set bit of m (m > 0). */
static int top_bit(uint32_t m) {
#if defined(__GNUC__) || defined(__clang__)
    return 31 - __builtin_clz(m);
#else
    int b = 0;
    while (m >>= 1) {
        b++;
    }
    return b;
#endif
}

/* ---- merging (count, mean, M2, sumsq) partials ------------------------------------------ */

/* A part's mean is kept as a sum of two doubles, mean + lo (lo: what rounding the mean to a
 * double lost). Chan's update multiplies the difference of two means by the counts; for
 * values close together (a LayerNorm weight: 1 +- 1e-7) that difference is ~1e-9 and a
 * mean's rounding (~1e-16) alone would cost ~1e-11 of M2 over a thousand merges. */
typedef struct {
    int64_t n;
    double mean, lo, m2, sumsq;
    int level;
} part;

static part empty_part(void) {
    part p;
    memset(&p, 0, sizeof p);
    return p;
}

/* s + e == a + b exactly (Knuth's two-sum; needs strict IEEE arithmetic, no fast-math). */
static void two_sum(double a, double b, double *s, double *e) {
    double sum = a + b;
    double bb = sum - a;
    *e = (a - (sum - bb)) + (b - bb);
    *s = sum;
}

/* A part from a block's count n, the sum s of its values, provisional mean c (s / n), and the
 * sums over its values x of (x - c), |x - c| and (x - c)**2.
 *
 * The mean is c plus a correction, taken from whichever of two sources is exact here. Where
 * the values lie close to c (a LayerNorm weight, 1 +- 1e-7), each x - c is exact (Sterbenz)
 * and so nearly is their sum: c + dev / n. Where they spread around a mean near zero (Adam's
 * exp_avg: +-1e-5 around 4e-10), x - c rounds at the scale of x, and that sum's error would
 * be thousands of times the mean's last digit; there the sum s (FP32 values add exactly in
 * float64 over a block unless their exponents span ~29 binades) divided exactly by n is:
 * c + (s - n * c) / n, the remainder computed exactly with an fma. */
static part block_part(int64_t n, double s, double c, double dev, double absdev, double dev2) {
    part p = empty_part();
    p.n = n;
    if (!isfinite(dev2)) {
        /* Squared deviations past DBL_MAX: M2 and the sum of squares are too (the values
         * reach 1e154; only FP64 ones can). */
        p.mean = c;
        p.m2 = p.sumsq = INFINITY;
        return p;
    }
    double q = dev / (double)n; /* the true mean is c + q */
    if (absdev <= 0.5 * (double)n * fabs(c) || !isfinite(s)) {
        two_sum(c, q, &p.mean, &p.lo);
    } else {
        two_sum(c, fma(-c, (double)n, s) / (double)n, &p.mean, &p.lo);
    }
    p.m2 = dev2 - dev * q; /* about the true mean */
    p.m2 = p.m2 < 0.0 ? 0.0 : p.m2;
    p.sumsq = dev2 + 2.0 * c * dev + (double)n * c * c;
    if (isnan(p.sumsq)) {
        p.sumsq = INFINITY; /* inf - inf: n * c * c passed DBL_MAX, and so does the sum */
    }
    return p;
}

/* a's values followed by b's (Chan et al.). */
static part merge(part a, part b) {
    if (b.n == 0) {
        return a;
    }
    if (a.n == 0) {
        b.level = a.level;
        return b;
    }
    part r = a;
    double n = (double)a.n + (double)b.n;
    double delta = (b.mean - a.mean) + (b.lo - a.lo);
    double e;
    r.n = a.n + b.n;
    r.m2 = a.m2 + b.m2 + delta * delta * ((double)a.n * (double)b.n / n);
    if (isfinite(delta)) {
        two_sum(a.mean, delta * ((double)b.n / n), &r.mean, &e);
        two_sum(r.mean, e + a.lo, &r.mean, &r.lo);
    } else { /* means of opposite signs near DBL_MAX */
        r.mean = a.mean * ((double)a.n / n) + b.mean * ((double)b.n / n);
        r.lo = 0.0;
    }
    r.sumsq = a.sumsq + b.sumsq;
    return r;
}

typedef struct {
    part stack[STACK];
    int depth;
} counter;

static void push(counter *c, part p) {
    p.level = 0;
    while (c->depth > 0 && c->stack[c->depth - 1].level == p.level) {
        int level = p.level + 1;
        p = merge(c->stack[--c->depth], p);
        p.level = level;
    }
    if (c->depth == STACK) { /* unreachable below 2**64 blocks; never write past the end */
        p = merge(c->stack[--c->depth], p);
    }
    c->stack[c->depth++] = p;
}

static part total(const counter *c) {
    part r = empty_part();
    for (int k = c->depth - 1; k >= 0; k--) {
        r = merge(c->stack[k], r);
    }
    return r;
}

/* ---- the figures of a piece ------------------------------------------------------------- */

typedef struct {
    counter parts;
    double min, max;
    int64_t zeros, nan, posinf, neginf;
    uint64_t slots[COPIES][SLOTS];
    int64_t hist[HIST_BINS];
} figures;

static void start(figures *f) {
    memset(f, 0, sizeof *f);
    f->min = INFINITY;
    f->max = -INFINITY;
}

/* The mean of a block's finite values whose float64 sum overflowed (their mean cannot; only
 * FP64 values get there). */
#define SCALED_MEAN(T)                                                                      \
    static double scaled_mean_##T(const T *x, Py_ssize_t n, int64_t count) {               \
        double s = 0.0;                                                                     \
        for (Py_ssize_t i = 0; i < n; i++) {                                                \
            if (isfinite(x[i])) {                                                           \
                s += (double)x[i] * 0x1p-64;                                                \
            }                                                                               \
        }                                                                                   \
        return s / (double)count * 0x1p64;                                                  \
    }

SCALED_MEAN(float)
SCALED_MEAN(double)

/* Pass 1 over a block of finite values: sum and extremes. Each of the LANES partial sums
 * takes every LANES-th value; written as loops over the lanes (not unrolled by hand) so that
 * the compiler turns each into vector instructions without reordering a sum: the figures do
 * not depend on the vector width. */
#define FAST_PASS1(T)                                                                       \
    VECTOR static double fast_pass1_##T(const T *x, Py_ssize_t n, double *mn, double *mx) {       \
        double s[LANES];                                                                    \
        T lo[LANES], hi[LANES];                                                             \
        for (int j = 0; j < LANES; j++) {                                                   \
            s[j] = 0.0;                                                                     \
            lo[j] = (T)INFINITY;                                                            \
            hi[j] = (T)-INFINITY;                                                           \
        }                                                                                   \
        Py_ssize_t i = 0;                                                                   \
        for (; i + LANES <= n; i += LANES) {                                                \
            const T *y = x + i;                                                             \
            for (int j = 0; j < LANES; j++) {                                               \
                s[j] += (double)y[j];                                                       \
            }                                                                               \
            for (int j = 0; j < LANES; j++) {                                               \
                lo[j] = y[j] < lo[j] ? y[j] : lo[j];                                        \
            }                                                                               \
            for (int j = 0; j < LANES; j++) {                                               \
                hi[j] = y[j] > hi[j] ? y[j] : hi[j];                                        \
            }                                                                               \
        }                                                                                   \
        double sum = 0.0;                                                                   \
        for (; i < n; i++) {                                                                \
            sum += (double)x[i];                                                            \
            lo[0] = x[i] < lo[0] ? x[i] : lo[0];                                            \
            hi[0] = x[i] > hi[0] ? x[i] : hi[0];                                            \
        }                                                                                   \
        for (int j = 0; j < LANES; j++) {                                                   \
            sum += s[j];                                                                    \
            *mn = (double)lo[j] < *mn ? (double)lo[j] : *mn;                                \
            *mx = (double)hi[j] > *mx ? (double)hi[j] : *mx;                                \
        }                                                                                   \
        return sum;                                                                         \
    }

/* Pass 2 over a block of finite values: the sums of (x - c) and (x - c)**2. */
#define FAST_PASS2(T)                                                                       \
    VECTOR static double fast_pass2_##T(const T *x, Py_ssize_t n, double c, double *dev,          \
                                        double *absdev) {                                   \
        double s[LANES], s2[LANES], a[LANES];                                               \
        for (int j = 0; j < LANES; j++) {                                                   \
            s[j] = 0.0;                                                                     \
            s2[j] = 0.0;                                                                    \
            a[j] = 0.0;                                                                     \
        }                                                                                   \
        Py_ssize_t i = 0;                                                                   \
        for (; i + LANES <= n; i += LANES) {                                                \
            const T *y = x + i;                                                             \
            for (int j = 0; j < LANES; j++) {                                               \
                double d = (double)y[j] - c;                                                \
                s[j] += d;                                                                  \
                s2[j] += d * d;                                                             \
                a[j] += fabs(d);                                                            \
            }                                                                               \
        }                                                                                   \
        double d1 = 0.0, d2 = 0.0, da = 0.0;                                                \
        for (; i < n; i++) {                                                                \
            double d = (double)x[i] - c;                                                    \
            d1 += d;                                                                        \
            d2 += d * d;                                                                    \
            da += fabs(d);                                                                  \
        }                                                                                   \
        for (int j = 0; j < LANES; j++) {                                                   \
            d1 += s[j];                                                                     \
            d2 += s2[j];                                                                    \
            da += a[j];                                                                     \
        }                                                                                   \
        *dev = d1;                                                                          \
        *absdev = da;                                                                       \
        return d2;                                                                          \
    }

FAST_PASS1(float)
FAST_PASS1(double)
FAST_PASS2(float)
FAST_PASS2(double)

/* A block holding NaN or Inf: the same two passes over its finite values (the others masked
 * out: x - x is 0 only for a finite x), and the non-finite ones counted. */
#define SLOW_BLOCK(T)                                                                       \
    VECTOR static double slow_pass1_##T(const T *x, Py_ssize_t n, double *mn, double *mx) { \
        double s[LANES];                                                                    \
        T lo[LANES], hi[LANES];                                                             \
        for (int j = 0; j < LANES; j++) {                                                   \
            s[j] = 0.0;                                                                     \
            lo[j] = (T)INFINITY;                                                            \
            hi[j] = (T)-INFINITY;                                                           \
        }                                                                                   \
        Py_ssize_t i = 0;                                                                   \
        for (; i + LANES <= n; i += LANES) {                                                \
            const T *y = x + i;                                                             \
            for (int j = 0; j < LANES; j++) {                                               \
                double v = (double)y[j];                                                    \
                s[j] += v - v == 0.0 ? v : 0.0;                                             \
            }                                                                               \
            for (int j = 0; j < LANES; j++) {                                               \
                T v = y[j];                                                                 \
                lo[j] = (v - v == 0) & (v < lo[j]) ? v : lo[j];                             \
            }                                                                               \
            for (int j = 0; j < LANES; j++) {                                               \
                T v = y[j];                                                                 \
                hi[j] = (v - v == 0) & (v > hi[j]) ? v : hi[j];                             \
            }                                                                               \
        }                                                                                   \
        double sum = 0.0;                                                                   \
        for (; i < n; i++) {                                                                \
            if (x[i] - x[i] == 0) {                                                         \
                sum += (double)x[i];                                                        \
                lo[0] = x[i] < lo[0] ? x[i] : lo[0];                                        \
                hi[0] = x[i] > hi[0] ? x[i] : hi[0];                                        \
            }                                                                               \
        }                                                                                   \
        for (int j = 0; j < LANES; j++) {                                                   \
            sum += s[j];                                                                    \
            *mn = (double)lo[j] < *mn ? (double)lo[j] : *mn;                                \
            *mx = (double)hi[j] > *mx ? (double)hi[j] : *mx;                                \
        }                                                                                   \
        return sum;                                                                         \
    }                                                                                       \
                                                                                            \
    VECTOR static double slow_pass2_##T(const T *x, Py_ssize_t n, double c, double *dev, \
                                        double *absdev) {                                   \
        double s[LANES], s2[LANES], a[LANES];                                               \
        for (int j = 0; j < LANES; j++) {                                                   \
            s[j] = 0.0;                                                                     \
            s2[j] = 0.0;                                                                    \
            a[j] = 0.0;                                                                     \
        }                                                                                   \
        Py_ssize_t i = 0;                                                                   \
        for (; i + LANES <= n; i += LANES) {                                                \
            const T *y = x + i;                                                             \
            for (int j = 0; j < LANES; j++) {                                               \
                double v = (double)y[j];                                                    \
                double d = v - c;                                                           \
                d = v - v == 0.0 ? d : 0.0;                                                 \
                s[j] += d;                                                                  \
                s2[j] += d * d;                                                             \
                a[j] += fabs(d);                                                            \
            }                                                                               \
        }                                                                                   \
        double d1 = 0.0, d2 = 0.0, da = 0.0;                                                \
        for (; i < n; i++) {                                                                \
            double d = x[i] - x[i] == 0 ? (double)x[i] - c : 0.0;                           \
            d1 += d;                                                                        \
            d2 += d * d;                                                                    \
            da += fabs(d);                                                                  \
        }                                                                                   \
        for (int j = 0; j < LANES; j++) {                                                   \
            d1 += s[j];                                                                     \
            d2 += s2[j];                                                                    \
            da += a[j];                                                                     \
        }                                                                                   \
        *dev = d1;                                                                          \
        *absdev = da;                                                                       \
        return d2;                                                                          \
    }                                                                                       \
                                                                                            \
    static part slow_block_##T(const T *x, Py_ssize_t n, figures *f) {                     \
        int64_t nan = 0, posinf = 0, neginf = 0;                                            \
        for (Py_ssize_t i = 0; i < n; i++) {                                                \
            nan += x[i] != x[i];                                                            \
            posinf += x[i] == (T)INFINITY;                                                  \
            neginf += x[i] == (T)-INFINITY;                                                 \
        }                                                                                   \
        f->nan += nan;                                                                      \
        f->posinf += posinf;                                                                \
        f->neginf += neginf;                                                                \
        int64_t count = n - nan - posinf - neginf;                                          \
        if (count == 0) {                                                                   \
            return empty_part();                                                            \
        }                                                                                   \
        double sum = slow_pass1_##T(x, n, &f->min, &f->max), dev, absdev;                   \
        double c = sum / (double)count;                                                     \
        if (!isfinite(c)) {                                                                 \
            c = scaled_mean_##T(x, n, count);                                               \
        }                                                                                   \
        double dev2 = slow_pass2_##T(x, n, c, &dev, &absdev);                               \
        return block_part(count, sum, c, dev, absdev, dev2);                                \
    }

SLOW_BLOCK(float)
SLOW_BLOCK(double)

/* The slots (0: zero or subnormal, 255: NaN/Inf, else the exponent field) of FP32 values. */
static void slots_f32(const float *x, Py_ssize_t n, uint64_t (*slots)[SLOTS], Py_ssize_t ahead) {
    Py_ssize_t i = 0;
    for (; i + COPIES <= n; i += COPIES) {
        if ((i & 15) == 0 && i < ahead) {
            PREFETCH(x + n + i); /* the next block, a cache line per 16 values (the hardware's
                                  * stream prefetcher alone leaves this loop waiting) */
        }
        for (int j = 0; j < COPIES; j++) {
            slots[j][(f32_bits(x[i + j]) >> 23) & 0xFFu]++;
        }
    }
    for (; i < n; i++) {
        slots[0][(f32_bits(x[i]) >> 23) & 0xFFu]++;
    }
}

static size_t slot_f64(double v) {
    int64_t e = (int64_t)((f64_bits(v) >> 52) & 0x7FFu);
    int64_t b = e - 1023 - HIST_LO;
    b = b < 0 ? 0 : b;
    b = b > HIST_BINS - 1 ? HIST_BINS - 1 : b;
    return e == 0x7FF ? (size_t)HIST_BINS : (size_t)b;
}

/* The slots of FP64 values: the bin (0 also for zeros; subnormals are below HIST_LO), 279
 * for NaN/Inf. */
static void slots_f64(const double *x, Py_ssize_t n, uint64_t (*slots)[SLOTS], Py_ssize_t ahead) {
    Py_ssize_t i = 0;
    for (; i + COPIES <= n; i += COPIES) {
        if ((i & 7) == 0 && i < ahead) {
            PREFETCH(x + n + i); /* the next block, a cache line per 8 values */
        }
        for (int j = 0; j < COPIES; j++) {
            slots[j][slot_f64(x[i + j])]++;
        }
    }
    for (; i < n; i++) {
        slots[0][slot_f64(x[i])]++;
    }
}

static uint64_t slot_total(uint64_t (*slots)[SLOTS], int s) {
    uint64_t t = 0;
    for (int j = 0; j < COPIES; j++) {
        t += slots[j][s];
    }
    return t;
}

static void block_f32(const float *x, Py_ssize_t n, figures *f, Py_ssize_t ahead) {
    uint64_t low0 = slot_total(f->slots, 0), bad0 = slot_total(f->slots, 255);
    slots_f32(x, n, f->slots, ahead);
    part p = empty_part();
    if (slot_total(f->slots, 255) != bad0) {
        p = slow_block_float(x, n, f);
    } else {
        double sum = fast_pass1_float(x, n, &f->min, &f->max), dev, absdev;
        double c = sum / (double)n;
        double dev2 = fast_pass2_float(x, n, c, &dev, &absdev);
        p = block_part(n, sum, c, dev, absdev, dev2);
    }
    uint64_t low = slot_total(f->slots, 0) - low0;
    if (low) {
        /* Zeros, and subnormals: value m * 2**-149, binade top_bit(m) - 149. */
        int64_t zeros = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            zeros += (f32_bits(x[i]) << 1) == 0;
        }
        f->zeros += zeros;
        if ((uint64_t)zeros != low) {
            for (Py_ssize_t i = 0; i < n; i++) {
                uint32_t u = f32_bits(x[i]);
                uint32_t m = u & 0x7FFFFFu;
                if ((u & 0x7F800000u) == 0 && m != 0) {
                    f->hist[top_bit(m) - 149 - HIST_LO]++;
                }
            }
        }
    }
    if (p.n) {
        push(&f->parts, p);
    }
}

static void block_f64(const double *x, Py_ssize_t n, figures *f, Py_ssize_t ahead) {
    uint64_t low0 = slot_total(f->slots, 0), bad0 = slot_total(f->slots, HIST_BINS);
    slots_f64(x, n, f->slots, ahead);
    part p = empty_part();
    if (slot_total(f->slots, HIST_BINS) != bad0) {
        p = slow_block_double(x, n, f);
    } else {
        double sum = fast_pass1_double(x, n, &f->min, &f->max), dev, absdev;
        double c = sum / (double)n;
        if (!isfinite(c)) {
            c = scaled_mean_double(x, n, n);
        }
        double dev2 = fast_pass2_double(x, n, c, &dev, &absdev);
        p = block_part(n, sum, c, dev, absdev, dev2);
    }
    if (slot_total(f->slots, 0) != low0) {
        /* Zeros (slot 0's other values, below 2**HIST_LO, are in bin 0 already). */
        int64_t zeros = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            zeros += x[i] == 0.0;
        }
        f->zeros += zeros;
    }
    if (p.n) {
        push(&f->parts, p);
    }
}

/* FP16 bits to FP32, exactly (subnormals become normal FP32 values; NaN keeps its payload). */
VECTOR static void widen_f16(const uint16_t *h, Py_ssize_t n, float *out) {
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t em = (uint32_t)(h[i] & 0x7FFFu) << 13;
        uint32_t sign = (uint32_t)(h[i] & 0x8000u) << 16;
        /* Exponent and mantissa in FP32's places, scaled by 2**(127-15): exact for normal
         * and subnormal values; NaN and Inf get FP32's all-ones exponent instead. */
        uint32_t finite = f32_bits(bits_f32(em) * 0x1p112f);
        uint32_t special = 0u - (uint32_t)(em >= (0x7C00u << 13));
        out[i] = bits_f32(sign | (finite & ~special) | ((em | 0x7F800000u) & special));
    }
}

VECTOR static void widen_bf16(const uint16_t *h, Py_ssize_t n, float *out) {
    for (Py_ssize_t i = 0; i < n; i++) {
        out[i] = bits_f32((uint32_t)h[i] << 16);
    }
}

/* Ask for the cache lines of the next block of 16-bit values (or of diff's two arrays) while
 * this one is worked on; the FP32/FP64 paths do it within their first loop. */
static void prefetch_next(const char *p, Py_ssize_t i, Py_ssize_t m, Py_ssize_t n,
                          Py_ssize_t size) {
    Py_ssize_t end = i + m + BLOCK < n ? i + m + BLOCK : n;
    for (Py_ssize_t k = (i + m) * size; k < end * size; k += 64) {
        PREFETCH(p + k);
    }
}

static void compute(const char *buf, Py_ssize_t n, int kind, figures *f) {
    float wide[BLOCK];
    for (Py_ssize_t i = 0; i < n; i += BLOCK) {
        Py_ssize_t m = n - i < BLOCK ? n - i : BLOCK;
        if (kind == K_F16 || kind == K_BF16) {
            prefetch_next(buf, i, m, n, 2);
        }
        switch (kind) {
        case K_F32:
            block_f32((const float *)buf + i, m, f, n - i - m);
            break;
        case K_F64:
            block_f64((const double *)buf + i, m, f, n - i - m);
            break;
        case K_F16:
            widen_f16((const uint16_t *)buf + i, m, wide);
            block_f32(wide, m, f, 0);
            break;
        default:
            widen_bf16((const uint16_t *)buf + i, m, wide);
            block_f32(wide, m, f, 0);
            break;
        }
    }
    /* Fold the exponent slots into binades. */
    if (kind == K_F64) {
        for (int s = 1; s < HIST_BINS; s++) {
            f->hist[s] += (int64_t)slot_total(f->slots, s);
        }
        f->hist[0] += (int64_t)slot_total(f->slots, 0) - f->zeros;
    } else {
        for (int s = 1; s < 255; s++) {
            f->hist[s - 127 - HIST_LO] += (int64_t)slot_total(f->slots, s);
        }
    }
}

/* ---- diff_sumsq ------------------------------------------------------------------------- */

#define DIFF_BLOCK(T)                                                                       \
    VECTOR static double diff_block_##T(const T *a, const T *b, Py_ssize_t n) {                   \
        double s[LANES];                                                                    \
        for (int j = 0; j < LANES; j++) {                                                   \
            s[j] = 0.0;                                                                     \
        }                                                                                   \
        Py_ssize_t i = 0;                                                                   \
        for (; i + LANES <= n; i += LANES) {                                                \
            for (int j = 0; j < LANES; j++) {                                               \
                double d = (double)a[i + j] - (double)b[i + j];                             \
                s[j] += d * d;                                                              \
            }                                                                               \
        }                                                                                   \
        for (int j = 0; i < n; i++, j++) {                                                  \
            double d = (double)a[i] - (double)b[i];                                         \
            s[j] += d * d;                                                                  \
        }                                                                                   \
        double t = 0.0;                                                                     \
        for (int j = 0; j < LANES; j++) {                                                   \
            t += s[j];                                                                      \
        }                                                                                   \
        return t;                                                                           \
    }

DIFF_BLOCK(float)
DIFF_BLOCK(double)

static double diff(const char *a, const char *b, Py_ssize_t n, int kind) {
    float wa[BLOCK], wb[BLOCK];
    counter c;
    c.depth = 0;
    for (Py_ssize_t i = 0; i < n; i += BLOCK) {
        Py_ssize_t m = n - i < BLOCK ? n - i : BLOCK;
        part p = empty_part();
        p.n = m;
        prefetch_next(a, i, m, n, KIND_SIZES[kind]);
        prefetch_next(b, i, m, n, KIND_SIZES[kind]);
        switch (kind) {
        case K_F32:
            p.sumsq = diff_block_float((const float *)a + i, (const float *)b + i, m);
            break;
        case K_F64:
            p.sumsq = diff_block_double((const double *)a + i, (const double *)b + i, m);
            break;
        case K_F16:
            widen_f16((const uint16_t *)a + i, m, wa);
            widen_f16((const uint16_t *)b + i, m, wb);
            p.sumsq = diff_block_float(wa, wb, m);
            break;
        default:
            widen_bf16((const uint16_t *)a + i, m, wa);
            widen_bf16((const uint16_t *)b + i, m, wb);
            p.sumsq = diff_block_float(wa, wb, m);
            break;
        }
        push(&c, p);
    }
    double t = total(&c).sumsq;
    return isfinite(t) ? t : NAN;
}

/* ---- Python ----------------------------------------------------------------------------- */


static int parse_kind(const char *name) {
    for (int k = 0; k < 4; k++) {
        if (strcmp(name, KIND_NAMES[k]) == 0) {
            return k;
        }
    }
    PyErr_Format(PyExc_ValueError, "dtype must be float32, float64, float16 or bfloat16, not %s",
                 name);
    return -1;
}

/* A C-contiguous buffer of whole kind-sized items (BF16/FP16 may come as uint16 views). */
static int get_values(PyObject *obj, int kind, Py_buffer *view, Py_ssize_t *n) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS) < 0) {
        return -1;
    }
    if (view->len % KIND_SIZES[kind] != 0) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_ValueError, "values are not whole %s items", KIND_NAMES[kind]);
        return -1;
    }
    *n = view->len / KIND_SIZES[kind];
    return 0;
}

static PyObject *piece(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *values_obj, *hist_obj;
    const char *name;
    if (!PyArg_ParseTuple(args, "OsO", &values_obj, &name, &hist_obj)) {
        return NULL;
    }
    int kind = parse_kind(name);
    if (kind < 0) {
        return NULL;
    }
    Py_buffer values, hist;
    Py_ssize_t n;
    if (get_values(values_obj, kind, &values, &n) < 0) {
        return NULL;
    }
    if (PyObject_GetBuffer(hist_obj, &hist, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) <
        0) {
        PyBuffer_Release(&values);
        return NULL;
    }
    size_t flen = hist.format == NULL ? 0 : strlen(hist.format);
    if (hist.len != (Py_ssize_t)(HIST_BINS * sizeof(int64_t)) || hist.itemsize != 8 ||
        flen == 0 || (hist.format[flen - 1] != 'l' && hist.format[flen - 1] != 'q')) {
        PyBuffer_Release(&values);
        PyBuffer_Release(&hist);
        PyErr_Format(PyExc_ValueError, "hist must hold %d int64 counts", HIST_BINS);
        return NULL;
    }
    figures *f = PyMem_RawMalloc(sizeof *f);
    if (f == NULL) {
        PyBuffer_Release(&values);
        PyBuffer_Release(&hist);
        return PyErr_NoMemory();
    }
    part p;
    Py_BEGIN_ALLOW_THREADS
    start(f);
    compute((const char *)values.buf, n, kind, f);
    p = total(&f->parts);
    int64_t counts[HIST_BINS];
    memcpy(counts, hist.buf, sizeof counts);
    for (int s = 0; s < HIST_BINS; s++) {
        counts[s] += f->hist[s];
    }
    memcpy(hist.buf, counts, sizeof counts);
    Py_END_ALLOW_THREADS
    PyObject *out = Py_BuildValue("LdddddLLLL", (long long)p.n, p.n ? p.mean + p.lo : 0.0,
                                  p.n ? p.m2 : 0.0, p.n ? p.sumsq : 0.0, f->min, f->max,
                                  (long long)f->zeros, (long long)f->nan,
                                  (long long)f->posinf, (long long)f->neginf);
    PyMem_RawFree(f);
    PyBuffer_Release(&values);
    PyBuffer_Release(&hist);
    return out;
}

static PyObject *diff_sumsq(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *a_obj, *b_obj;
    const char *name;
    if (!PyArg_ParseTuple(args, "OOs", &a_obj, &b_obj, &name)) {
        return NULL;
    }
    int kind = parse_kind(name);
    if (kind < 0) {
        return NULL;
    }
    Py_buffer a, b;
    Py_ssize_t na, nb;
    if (get_values(a_obj, kind, &a, &na) < 0) {
        return NULL;
    }
    if (get_values(b_obj, kind, &b, &nb) < 0) {
        PyBuffer_Release(&a);
        return NULL;
    }
    if (na != nb) {
        PyBuffer_Release(&a);
        PyBuffer_Release(&b);
        PyErr_Format(PyExc_ValueError, "%zd values against %zd", na, nb);
        return NULL;
    }
    double t;
    Py_BEGIN_ALLOW_THREADS
    t = diff((const char *)a.buf, (const char *)b.buf, na, kind);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    return PyFloat_FromDouble(t);
}


/* ---- pieces: many small pieces of one buffer in one call -------------------------------- */

/* Figures of one piece, kept until the Python objects are made (with the GIL). */
typedef struct {
    part p;
    double min, max;
    int64_t n, zeros, nan, posinf, neginf;
    int lo, hi; /* used bins: [lo, hi) of the row of hist kept for it */
} result;

#define CHUNK 256 /* pieces worked on per release of the GIL (their histograms: 571 KB) */

/* Shared float objects for the figures most often repeated (a zero-initialised tensor's mean,
 * M2 and sum of squares; the extremes of one with no finite value): floats are immutable. */
static PyObject *ZERO, *POS_INF, *NEG_INF;

static PyObject *number(double v) {
    PyObject *o = NULL;
    if (v == 0.0 && !signbit(v)) {
        o = ZERO;
    } else if (isinf(v)) {
        o = v > 0 ? POS_INF : NEG_INF;
    }
    if (o != NULL) {
        Py_INCREF(o);
        return o;
    }
    return PyFloat_FromDouble(v);
}

/* make(numel, count, mean, m2, sumsq, min, max, zeros, nan, posinf, neginf, hist_lo, bins) */
static PyObject *made(PyObject *make, const result *r, const int64_t *hist) {
    const part *p = &r->p;
    PyObject *args[13];
    int k = 0;
    args[k++] = PyLong_FromLongLong((long long)r->n);
    args[k++] = PyLong_FromLongLong((long long)p->n);
    args[k++] = number(p->n ? p->mean + p->lo : 0.0);
    args[k++] = number(p->n ? p->m2 : 0.0);
    args[k++] = number(p->n ? p->sumsq : 0.0);
    args[k++] = number(r->min);
    args[k++] = number(r->max);
    args[k++] = PyLong_FromLongLong((long long)r->zeros);
    args[k++] = PyLong_FromLongLong((long long)r->nan);
    args[k++] = PyLong_FromLongLong((long long)r->posinf);
    args[k++] = PyLong_FromLongLong((long long)r->neginf);
    args[k++] = PyLong_FromLong(r->hi > r->lo ? r->lo : 0);
    args[k++] = PyList_New(r->hi - r->lo);
    PyObject *out = NULL;
    for (int j = 0; j < k; j++) {
        if (args[j] == NULL) {
            goto done;
        }
    }
    for (int s = r->lo; s < r->hi; s++) {
        PyObject *c = PyLong_FromLongLong((long long)hist[s]);
        if (c == NULL) {
            goto done;
        }
        PyList_SET_ITEM(args[12], s - r->lo, c);
    }
    out = PyObject_Vectorcall(make, args, (size_t)k, NULL);
done:
    for (int j = 0; j < k; j++) {
        Py_XDECREF(args[j]);
    }
    return out;
}

static PyObject *pieces(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *values_obj, *spans_obj, *make;
    const char *name;
    if (!PyArg_ParseTuple(args, "OsOO", &values_obj, &name, &spans_obj, &make)) {
        return NULL;
    }
    int kind = parse_kind(name);
    if (kind < 0) {
        return NULL;
    }
    Py_ssize_t size = KIND_SIZES[kind];
    Py_buffer values, spans;
    if (PyObject_GetBuffer(values_obj, &values, PyBUF_C_CONTIGUOUS) < 0) {
        return NULL;
    }
    if (PyObject_GetBuffer(spans_obj, &spans, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&values);
        return NULL;
    }
    size_t flen = spans.format == NULL ? 0 : strlen(spans.format);
    PyObject *out = NULL;
    figures *f = NULL;
    result *res = NULL;
    int64_t *hist = NULL;
    if (spans.itemsize != 8 || spans.len % 16 != 0 || flen == 0 ||
        (spans.format[flen - 1] != 'l' && spans.format[flen - 1] != 'q')) {
        PyErr_SetString(PyExc_ValueError, "spans must be int64 (byte offset, count) pairs");
        goto done;
    }
    const int64_t *sp = (const int64_t *)spans.buf;
    Py_ssize_t count = spans.len / 16;
    for (Py_ssize_t k = 0; k < count; k++) {
        int64_t off = sp[2 * k], n = sp[2 * k + 1];
        if (off < 0 || n < 0 || off % size != 0 || off > values.len ||
            n > (values.len - off) / size) {
            PyErr_Format(PyExc_ValueError, "span %zd (%lld, %lld) is not whole aligned %s "
                         "items of the buffer", k, (long long)off, (long long)n,
                         KIND_NAMES[kind]);
            goto done;
        }
    }
    if (((uintptr_t)values.buf) % (uintptr_t)size != 0) {
        PyErr_SetString(PyExc_ValueError, "values are not aligned");
        goto done;
    }
    f = PyMem_RawMalloc(sizeof *f);
    res = PyMem_RawMalloc(sizeof *res * CHUNK);
    hist = PyMem_RawMalloc(sizeof *hist * HIST_BINS * CHUNK);
    if (f == NULL || res == NULL || hist == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    out = PyList_New(count);
    if (out == NULL) {
        goto done;
    }
    for (Py_ssize_t first = 0; first < count; first += CHUNK) {
        Py_ssize_t m = count - first < CHUNK ? count - first : CHUNK;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t j = 0; j < m; j++) {
            const int64_t *s = sp + 2 * (first + j);
            result *r = &res[j];
            start(f);
            compute((const char *)values.buf + s[0], (Py_ssize_t)s[1], kind, f);
            r->p = total(&f->parts);
            r->n = s[1];
            r->min = f->min;
            r->max = f->max;
            r->zeros = f->zeros;
            r->nan = f->nan;
            r->posinf = f->posinf;
            r->neginf = f->neginf;
            int lo = 0, hi = HIST_BINS;
            while (lo < hi && f->hist[lo] == 0) {
                lo++;
            }
            while (hi > lo && f->hist[hi - 1] == 0) {
                hi--;
            }
            r->lo = lo;
            r->hi = hi;
            memcpy(hist + (size_t)j * HIST_BINS, f->hist, sizeof f->hist);
        }
        Py_END_ALLOW_THREADS
        for (Py_ssize_t j = 0; j < m; j++) {
            PyObject *o = made(make, &res[j], hist + (size_t)j * HIST_BINS);
            if (o == NULL) {
                Py_CLEAR(out);
                goto done;
            }
            PyList_SET_ITEM(out, first + j, o);
        }
    }
done:
    PyMem_RawFree(f);
    PyMem_RawFree(res);
    PyMem_RawFree(hist);
    PyBuffer_Release(&values);
    PyBuffer_Release(&spans);
    return out;
}

static PyMethodDef methods[] = {
    {"piece", piece, METH_VARARGS,
     "piece(values, dtype, hist) -> (count, mean, m2, sumsq, min, max, zeros, nan, posinf, "
     "neginf): figures of the C-contiguous values (dtype: float32, float64, float16 or "
     "bfloat16; 16-bit values may come as uint16 views), moments over the finite ones; adds "
     "the binade counts of |x| to hist (279 int64)."},
    {"pieces", pieces, METH_VARARGS,
     "pieces(values, dtype, spans, make) -> list: make(numel, count, mean, m2, sumsq, min, "
     "max, zeros, nan, posinf, neginf, hist_lo, bins) for each (byte offset, count) pair of "
     "spans (int64) into the buffer values: piece's figures of each, its histogram trimmed to "
     "the bins it uses (hist_lo: the first; 0 and [] when none)."},
    {"diff_sumsq", diff_sumsq, METH_VARARGS,
     "diff_sumsq(a, b, dtype) -> float: sum((a - b)**2) in float64 over two equally long "
     "C-contiguous buffers of dtype; NaN when a term is not finite."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_moments", "One-pass figures of tensor values (ckpt stats).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__moments(void) {
    ZERO = PyFloat_FromDouble(0.0);
    POS_INF = PyFloat_FromDouble(INFINITY);
    NEG_INF = PyFloat_FromDouble(-INFINITY);
    if (ZERO == NULL || POS_INF == NULL || NEG_INF == NULL) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "HIST_LO", HIST_LO) < 0 ||
        PyModule_AddIntConstant(m, "HIST_BINS", HIST_BINS) < 0 ||
        PyModule_AddObject(m, "available", PyBool_FromLong(1)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
