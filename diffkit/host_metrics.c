/* One pass over a reference and a candidate range on the CPU: every statistic diffkit's Stats needs.
 *
 * Built by diffkit/host_kernel.py with the system C compiler and called through ctypes (which
 * releases the GIL, so worker threads measure side by side).  No Python or torch headers.
 *
 * dk_partials(r, r_is_double, c, c_is_double, lo, hi, atol, rtol, out) fills out[0..15] with the
 * slots of diffkit.metric_slots.Part for elements lo..hi-1 of the flat arrays r and c (float32 or
 * float64 each), with the same per-element rules as `_partials` (torch.allclose's, in float64):
 *   diff     |c - r| where both are finite, else 0
 *   bound    atol + rtol |r|
 *   bad      diff > bound where both are finite; a NaN on either side, or unequal infinities.  When
 *            both sides are float32 the rule is torch.isclose's own, in float32 arithmetic (what
 *            KernelBench's torch.allclose decides): close when c == r, or |c - r| is finite and at most
 *            atol + |rtol r|, each operation rounded to float32
 *   excess   diff - bound, NaN taken as -inf and +-inf as the largest finite value (torch.nan_to_num)
 *   rel      diff / |r| where both are finite and r != 0, else 0
 * The sums of r*c, r*r and c*c count a non-finite value as 0.  Maxima keep the first index holding
 * them.  Blocks of finite values run eight float64 lanes at a time (GCC/Clang vector extensions); a block
 * holding a NaN or an infinity is done element by element by the rules above.  A pair of two float32 sides
 * runs its blocks in sixteen float32 lanes instead (block32: float32 arithmetic, as the GPU kernel's, each lane
 * summing eight terms before a block's sums go into float64; 1.5x the bytes a second of the float64 lanes), and
 * a block whose sums leave float32's range, whose ratio |c| / |r| does, or whose values are so small their squares
 * may, in float64 lanes.  Maxima and their indices stay those of the float64 rules: a block whose float32 maximum
 * could hide a new float64 one (a tie after rounding, an excess within its rounding margin) is searched again in
 * float64 lanes (block_arg32).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

enum {
    MISMATCHES, MAX_ABS, MAX_ABS_AT, SUM_ABS, MAX_REL, DOT, REF_SQ, CAND_SQ,
    REF_NAN, REF_INF, CAND_NAN, CAND_INF, MAX_EXCESS, MAX_EXCESS_AT, FIRST_DISAGREE_AT, DIFF_SQ, NSLOTS
};

typedef double v8d __attribute__((vector_size(64)));
typedef long long v8l __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
typedef int v8i __attribute__((vector_size(32)));

#define LANES 8
#define BLOCK 512 /* elements per block: a multiple of LANES */

#ifdef __cplusplus /* built as C++ where it can be: vector ?: selects with a blend (AVX-512: a mask register) */
static inline v8d sel(v8l m, v8d x, v8d y) { return m ? x : y; }
#define EXPORT extern "C"
#else
static inline v8d sel(v8l m, v8d x, v8d y) { return (v8d)(((v8l)x & m) | ((v8l)y & ~m)); }
#define EXPORT
#endif
static inline v8d vabs(v8d x) { return (v8d)((v8l)x & ((v8l){0} + 0x7fffffffffffffffLL)); }
static inline double hsum(v8d x) {
    double s = 0.0;
    for (int i = 0; i < LANES; i++) s += x[i];
    return s;
}
static inline double hmax(v8d x) {
    double m = x[0];
    for (int i = 1; i < LANES; i++) m = x[i] > m ? x[i] : m;
    return m;
}

static inline v8d load(const void *p, int is_double, int64_t i) {
    if (is_double) {
        v8d v;
        memcpy(&v, (const double *)p + i, sizeof v);
        return v;
    }
    v8f f;
    memcpy(&f, (const float *)p + i, sizeof f);
    return __builtin_convertvector(f, v8d);
}

static inline double at(const void *p, int is_double, int64_t i) {
    return is_double ? ((const double *)p)[i] : (double)((const float *)p)[i];
}

static inline double excess_of(double d, double bound) {
    double e = d - bound;
    if (e != e) return -INFINITY;
    if (e == INFINITY) return DBL_MAX;
    if (e == -INFINITY) return -DBL_MAX;
    return e;
}

/* One element by the full rules (NaN and infinities included). */
/* torch.isclose's rule in float32 (both sides float32): whether the element is out of tolerance */
static inline int bad32(double a, double b, float at32, float rt32) {
    float a32 = (float)a, b32 = (float)b;
    float actual = fabsf(b32 - a32), allowed = at32 + fabsf(rt32 * a32);
    return !(a32 == b32 || (isfinite(actual) && actual <= allowed));
}

static inline void element(double a, double b, int64_t i, double atol, double rtol, int f32, double *o) {
    int an = isnan(a) != 0, bn = isnan(b) != 0, ai = isinf(a) != 0, bi = isinf(b) != 0;
    int special = an | bn | ai | bi;
    int disagree = special && !(ai && bi && a == b);
    double ra = fabs(a);
    double d = special ? 0.0 : fabs(b - a);
    double bound = atol + rtol * ra;
    int bad = f32 ? bad32(a, b, (float)atol, (float)rtol) : ((!special && d > bound) || disagree);
    o[MISMATCHES] += bad ? 1.0 : 0.0;
    o[REF_NAN] += an;
    o[REF_INF] += ai;
    o[CAND_NAN] += bn;
    o[CAND_INF] += bi;
    double fa = (an | ai) ? 0.0 : a, fb = (bn | bi) ? 0.0 : b;
    o[DOT] += fa * fb;
    o[REF_SQ] += fa * fa;
    o[CAND_SQ] += fb * fb;
    o[SUM_ABS] += d;
    o[DIFF_SQ] += d * d;
    if (!special && ra > 0.0) {
        double rel = d / ra;
        if (rel > o[MAX_REL]) o[MAX_REL] = rel;
    }
    if (d > o[MAX_ABS]) {
        o[MAX_ABS] = d;
        o[MAX_ABS_AT] = (double)i;
    }
    double e = excess_of(d, bound);
    if (e > o[MAX_EXCESS]) {
        o[MAX_EXCESS] = e;
        o[MAX_EXCESS_AT] = (double)i;
    }
    if (disagree && i < o[FIRST_DISAGREE_AT]) o[FIRST_DISAGREE_AT] = (double)i;
}

/* The first index of the largest |c - r| (which = 0) or excess (which = 1) in a finite block. */
static void block_arg(const void *r, int rd, const void *c, int cd, int64_t lo, int64_t hi, double atol, double rtol,
                      int which, double *best, int64_t *where) {
    double m = -INFINITY;
    int64_t w = lo;
    for (int64_t i = lo; i < hi; i++) {
        double a = at(r, rd, i), b = at(c, cd, i);
        double d = fabs(b - a);
        double v = which ? d - (atol + rtol * fabs(a)) : d;
        if (v > m) {
            m = v;
            w = i;
        }
    }
    *best = m;
    *where = w;
}

/* The running per-lane statistics of finite values; UNROLL of them side by side in a block, so no one
 * chain of dependent operations limits the loop. */
typedef struct {
    v8d m_abs, m_ex;      /* largest d and excess */
    v8d m_rel;            /* largest d / |r| where r != 0 */
    v8d s_abs, s_dsq, s_rsq, s_csq, s_dot;
    v8l bad;
    v8i bad32;            /* the count of a float32 pair (at most BLOCK / LANES a lane) */
} lanes_t;
#define UNROLL 4

static inline void lanes_init(lanes_t *x) {
    const v8d zero = {0};
    x->m_abs = zero - 1.0;
    x->m_ex = zero - INFINITY;
    x->m_rel = zero;
    x->s_abs = x->s_dsq = x->s_rsq = x->s_csq = x->s_dot = zero;
    x->bad = (v8l){0};
    x->bad32 = (v8i){0};
}

/* the statistics in float64, the out-of-tolerance count aside */
static inline void lanes_common(lanes_t *x, v8d a, v8d b, v8d d, v8d ra, v8d vatol, v8d vrtol) {
    const v8d zero = {0};
    v8d e = d - (vatol + vrtol * ra);
    x->s_abs += d;
    x->s_dsq += d * d;
    x->s_rsq += a * a;
    x->s_csq += b * b;
    x->s_dot += a * b;
    v8d rel = sel(ra > zero, d / ra, zero); /* (0/0 and d/0 computed, then masked) */
    x->m_rel = sel(rel > x->m_rel, rel, x->m_rel);
    x->m_abs = sel(d > x->m_abs, d, x->m_abs);
    x->m_ex = sel(e > x->m_ex, e, x->m_ex);
}

/* a pair with a float64 side: the rule in float64 */
static inline void lanes_step(lanes_t *x, v8d a, v8d b, v8d vatol, v8d vrtol) {
    v8d d = vabs(b - a), ra = vabs(a);
    x->bad -= (v8l)(d > vatol + vrtol * ra);
    lanes_common(x, a, b, d, ra, vatol, vrtol);
}

/* a float32 pair: torch.isclose's rule in float32 (finite values here: c == r gives 0 <= allowed) */
static inline void lanes_step32(lanes_t *x, v8f a32, v8f b32, v8d vatol, v8d vrtol, v8f at32, v8f rt32) {
    v8f actual = (v8f)((v8i)(b32 - a32) & 0x7fffffff), allowed = at32 + (v8f)((v8i)(rt32 * a32) & 0x7fffffff);
    x->bad32 -= (v8i)(actual > allowed);
    v8d a = __builtin_convertvector(a32, v8d), b = __builtin_convertvector(b32, v8d);
    lanes_common(x, a, b, vabs(b - a), vabs(a), vatol, vrtol);
}

static inline void lanes_merge(lanes_t *x, const lanes_t *y) {
    x->bad += y->bad;
    x->bad32 += y->bad32;
    x->s_abs += y->s_abs;
    x->s_dsq += y->s_dsq;
    x->s_rsq += y->s_rsq;
    x->s_csq += y->s_csq;
    x->s_dot += y->s_dot;
    x->m_rel = sel(y->m_rel > x->m_rel, y->m_rel, x->m_rel);
    x->m_abs = sel(y->m_abs > x->m_abs, y->m_abs, x->m_abs);
    x->m_ex = sel(y->m_ex > x->m_ex, y->m_ex, x->m_ex);
}

/* the running sums of a range, over its blocks of finite values (float64 lanes) */
typedef struct {
    v8d s_abs, s_dsq, s_rsq, s_csq, s_dot;
    v8l bad;
    float best32_abs, best32_ex; /* the largest float32 block maxima seen (block32's test for a new maximum) */
} run_t;

/* block_arg of a finite float32 block, eight float64 lanes at a time: each lane keeps its first maximum and
 * where it is, and the first index among the lanes holding the largest is the block's. */
static void block_arg32(const float *r, const float *c, int64_t lo, double atol, double rtol, int which,
                        double *best, int64_t *where) {
    const v8d zero = {0}, vatol = zero + atol, vrtol = zero + rtol;
    v8d m = zero - INFINITY;
    v8l at = {0}, j = {0, 1, 2, 3, 4, 5, 6, 7};
    for (int64_t i = lo; i < lo + BLOCK; i += LANES, j += LANES) {
        v8f a32, b32;
        memcpy(&a32, r + i, sizeof a32);
        memcpy(&b32, c + i, sizeof b32);
        v8d a = __builtin_convertvector(a32, v8d), b = __builtin_convertvector(b32, v8d);
        v8d v = vabs(b - a);
        if (which) v = v - (vatol + vrtol * vabs(a));
        v8l more = (v8l)(v > m);
        m = sel(more, v, m);
        at = (more & j) | (~more & at);
    }
    double top = hmax(m);
    int64_t first = lo + BLOCK;
    for (int k = 0; k < LANES; k++)
        if (m[k] == top && at[k] < first) first = at[k];
    *best = top;
    *where = lo + first;
}

/* A new maximum of |c - r| or of the excess may lie in [i, i + BLOCK): its first index, by the float64 rules. */
static inline void block_max(const void *r, int rd, const void *c, int cd, int64_t i, double atol, double rtol,
                             int which, double *o) {
    double best;
    int64_t where;
    if (!rd && !cd)
        block_arg32((const float *)r, (const float *)c, i, atol, rtol, which, &best, &where);
    else
        block_arg(r, rd, c, cd, i, i + BLOCK, atol, rtol, which, &best, &where);
    if (which) best = excess_of(best, 0.0);
    const int slot = which ? MAX_EXCESS : MAX_ABS;
    if (best > o[slot]) {
        o[slot] = best;
        o[slot + 1] = (double)where; /* MAX_ABS_AT, MAX_EXCESS_AT */
    }
}

/* One block in float64 lanes (any pair; a block holding a NaN or an infinity element by element). */
static void block64(const void *r, int rd, const void *c, int cd, int64_t i, double atol, double rtol, run_t *run,
                    double *o) {
    const v8d zero = {0}, vatol = zero + atol, vrtol = zero + rtol;
    const int f32 = !rd && !cd;
    const v8f vat32 = (v8f){0} + (float)atol, vrt32 = (v8f){0} + (float)rtol;
    lanes_t acc[UNROLL];
    for (int u = 0; u < UNROLL; u++) lanes_init(&acc[u]);
    if (f32) {
        for (int64_t j = i; j < i + BLOCK; j += LANES * UNROLL)
            for (int u = 0; u < UNROLL; u++) {
                v8f a32, b32;
                memcpy(&a32, (const float *)r + j + u * LANES, sizeof a32);
                memcpy(&b32, (const float *)c + j + u * LANES, sizeof b32);
                lanes_step32(&acc[u], a32, b32, vatol, vrtol, vat32, vrt32);
            }
    } else {
        for (int64_t j = i; j < i + BLOCK; j += LANES * UNROLL)
            for (int u = 0; u < UNROLL; u++)
                lanes_step(&acc[u], load(r, rd, j + u * LANES), load(c, cd, j + u * LANES), vatol, vrtol);
    }
    for (int u = 1; u < UNROLL; u++) lanes_merge(&acc[0], &acc[u]);
    lanes_t *x = &acc[0];
    x->bad += __builtin_convertvector(x->bad32, v8l);
    /* a NaN or an infinity on either side (or a square past float64's range) makes its sum of squares
     * non-finite: that block by the full rules */
    if (!isfinite(hsum(x->s_rsq)) || !isfinite(hsum(x->s_csq))) {
        for (int64_t j = i; j < i + BLOCK; j++) element(at(r, rd, j), at(c, cd, j), j, atol, rtol, f32, o);
        return;
    }
    run->s_abs += x->s_abs;
    run->s_dsq += x->s_dsq;
    run->s_rsq += x->s_rsq;
    run->s_csq += x->s_csq;
    run->s_dot += x->s_dot;
    run->bad += x->bad;
    double rel = hmax(x->m_rel);
    if (rel > o[MAX_REL]) o[MAX_REL] = rel;
    if (hmax(x->m_abs) > o[MAX_ABS]) block_max(r, rd, c, cd, i, atol, rtol, 0, o);
    if (hmax(x->m_ex) > o[MAX_EXCESS]) block_max(r, rd, c, cd, i, atol, rtol, 1, o);
}

/* ---- a float32 pair: the block in float32 arithmetic, sixteen lanes, summed into float64 per block ---- */
typedef float v16f __attribute__((vector_size(64)));
typedef int v16i __attribute__((vector_size(64)));
#define LANES32 16
#define UNROLL32 4

#ifdef __cplusplus
static inline v16f sel32(v16i m, v16f x, v16f y) { return m ? x : y; }
#else
static inline v16f sel32(v16i m, v16f x, v16f y) { return (v16f)((m & (v16i)x) | (~m & (v16i)y)); }
#endif
static inline v16f vabs32(v16f x) { return (v16f)((v16i)x & 0x7fffffff); }
static inline float hmax32(v16f x) {
    float m = x[0];
    for (int i = 1; i < LANES32; i++) m = x[i] > m ? x[i] : m;
    return m;
}
/* the sixteen float32 lanes added into eight float64 ones */
static inline v8d widen_sum(v16f x) {
    v8f lo = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7);
    v8f hi = __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
    return __builtin_convertvector(lo, v8d) + __builtin_convertvector(hi, v8d);
}

typedef struct {
    v16f m_abs, m_ex, m_rel, m_ra, s_abs, s_dsq, s_rsq, s_csq, s_dot;
    v16i bad, bits;
} lanes32_t;

/* Sums of squares below this (a block of values under ~1e-15) may have lost terms below float32's range:
 * such a block is done in float64 lanes. */
#define TINY32 1e-30

/* A block of a float32 pair with every element finite: 1 when done, 0 when it is to be done in float64 lanes (a
 * NaN or an infinity, a square past float32's range, or values so small their squares leave it).  Per element,
 * as lanes_step32 (torch.isclose's rule in float32) with the other statistics in float32 too; each lane sums
 * BLOCK / (LANES32 * UNROLL32) terms in float32 before the block's sums go into float64.  Where its float32 maxima
 * say it may hold a new float64 maximum (see the end), it is searched by the float64 rules. */
static inline int block32(const float *r, const float *c, int64_t i, double atol, double rtol, float at32, float rt32,
                          run_t *run, double *o) {
    const v16f zero = {0}, vat = zero + at32, vrt = zero + rt32;
    lanes32_t acc[UNROLL32];
    for (int u = 0; u < UNROLL32; u++) {
        acc[u].m_abs = acc[u].m_rel = acc[u].m_ra = acc[u].s_abs = acc[u].s_dsq = acc[u].s_rsq = acc[u].s_csq =
            acc[u].s_dot = zero;
        acc[u].m_ex = zero - INFINITY;
        acc[u].bad = acc[u].bits = (v16i){0};
    }
    for (int64_t j = i; j < i + BLOCK; j += LANES32 * UNROLL32)
        for (int u = 0; u < UNROLL32; u++) {
            lanes32_t *x = &acc[u];
            v16f a, b;
            memcpy(&a, r + j + u * LANES32, sizeof a);
            memcpy(&b, c + j + u * LANES32, sizeof b);
            v16f d = vabs32(b - a), ra = vabs32(a);
            v16f allowed = vat + vabs32(vrt * a);
            x->bad -= (v16i)(d > allowed);
            x->s_abs += d;
            x->s_dsq += d * d;
            x->s_rsq += a * a;
            x->s_csq += b * b;
            x->s_dot += a * b;
            x->bits |= (v16i)a | (v16i)b;
            v16f rel = sel32((v16i)(ra > zero), d / ra, zero);
            x->m_rel = sel32((v16i)(rel > x->m_rel), rel, x->m_rel);
            x->m_abs = sel32((v16i)(d > x->m_abs), d, x->m_abs);
            x->m_ra = sel32((v16i)(ra > x->m_ra), ra, x->m_ra);
            v16f e = d - allowed;
            x->m_ex = sel32((v16i)(e > x->m_ex), e, x->m_ex);
        }
    lanes32_t *x = &acc[0];
    for (int u = 1; u < UNROLL32; u++) {
        lanes32_t *y = &acc[u];
        x->bad += y->bad;
        x->bits |= y->bits;
        x->s_abs += y->s_abs;
        x->s_dsq += y->s_dsq;
        x->s_rsq += y->s_rsq;
        x->s_csq += y->s_csq;
        x->s_dot += y->s_dot;
        x->m_rel = sel32((v16i)(y->m_rel > x->m_rel), y->m_rel, x->m_rel);
        x->m_abs = sel32((v16i)(y->m_abs > x->m_abs), y->m_abs, x->m_abs);
        x->m_ra = sel32((v16i)(y->m_ra > x->m_ra), y->m_ra, x->m_ra);
        x->m_ex = sel32((v16i)(y->m_ex > x->m_ex), y->m_ex, x->m_ex);
    }
    v8d s_abs = widen_sum(x->s_abs), s_dsq = widen_sum(x->s_dsq), s_rsq = widen_sum(x->s_rsq),
        s_csq = widen_sum(x->s_csq), s_dot = widen_sum(x->s_dot);
    double rsq = hsum(s_rsq), csq = hsum(s_csq), dsq = hsum(s_dsq);
    double rel = (double)hmax32(x->m_rel);
    /* (a ratio past float32's range: |c| / |r| with r tiny, or denormal) */
    if (!isfinite(rsq) || !isfinite(csq) || !isfinite(dsq) || !isfinite(rel)) return 0;
    int nonzero = 0;
    for (int k = 0; k < LANES32; k++) nonzero |= x->bits[k] & 0x7fffffff;
    if (nonzero && (rsq < TINY32 || csq < TINY32 || (dsq < TINY32 && hsum(s_abs) > 0.0))) return 0;
    run->s_abs += s_abs;
    run->s_dsq += s_dsq;
    run->s_rsq += s_rsq;
    run->s_csq += s_csq;
    run->s_dot += s_dot;
    v8l nbad = {0};
    for (int k = 0; k < LANES32; k++) nbad[k % LANES] += x->bad[k];
    run->bad += nbad;
    if (rel > o[MAX_REL]) o[MAX_REL] = rel;
    /* A block may hold a new maximum.  |c - r| of two float32 values is exact in float64 and rounds to float32
     * monotonically, so a block whose float64 maximum beats the largest so far has a float32 maximum at least
     * the largest float32 maximum so far: a tie is searched too (not a tie at zero: a nonzero difference of two
     * float32 values is never rounded to zero).  The excess (|c - r| less the tolerance) in float32 may be off
     * by a few roundings of |c - r| + atol + rtol |r|: a block within that margin of the largest excess so far
     * is searched when the excess can be positive (the worst element of a pair with mismatches is the one of
     * largest excess; below zero the float32 order serves). */
    float m_abs = hmax32(x->m_abs), m_ex = hmax32(x->m_ex);
    if (m_abs > run->best32_abs || (m_abs == run->best32_abs && m_abs > 0.0f) || o[MAX_ABS] < 0.0) {
        if (m_abs > run->best32_abs) run->best32_abs = m_abs;
        block_max(r, 0, c, 0, i, atol, rtol, 0, o);
    }
    double margin = 0x1p-20 * ((double)m_abs + atol + fabs(rtol) * (double)hmax32(x->m_ra));
    if (m_ex > run->best32_ex || ((double)m_ex + margin > o[MAX_EXCESS] && (double)m_ex + margin > 0.0)) {
        if (m_ex > run->best32_ex) run->best32_ex = m_ex;
        block_max(r, 0, c, 0, i, atol, rtol, 1, o);
    }
    return 1;
}

EXPORT void dk_partials(const void *r, int rd, const void *c, int cd, int64_t lo, int64_t hi, double atol, double rtol,
                 double *o) {
    for (int k = 0; k < NSLOTS; k++) o[k] = 0.0;
    o[MAX_ABS] = -1.0; /* every |c - r| is >= 0: the first element sets it */
    o[MAX_ABS_AT] = (double)lo;
    o[MAX_EXCESS] = -INFINITY;
    o[MAX_EXCESS_AT] = (double)lo;
    o[FIRST_DISAGREE_AT] = INFINITY;
    const v8d zero = {0};
    const int f32 = !rd && !cd;
    run_t run = {zero, zero, zero, zero, zero, {0}, -INFINITY, -INFINITY};
    int64_t i = lo;
    for (; i + BLOCK <= hi; i += BLOCK) {
        if (f32 && block32((const float *)r, (const float *)c, i, atol, rtol, (float)atol, (float)rtol, &run, o))
            continue;
        block64(r, rd, c, cd, i, atol, rtol, &run, o);
    }
    for (; i < hi; i++) element(at(r, rd, i), at(c, cd, i), i, atol, rtol, f32, o);
    o[SUM_ABS] += hsum(run.s_abs);
    o[DIFF_SQ] += hsum(run.s_dsq);
    o[REF_SQ] += hsum(run.s_rsq);
    o[CAND_SQ] += hsum(run.s_csq);
    o[DOT] += hsum(run.s_dot);
    long long nbad = 0;
    for (int k = 0; k < LANES; k++) nbad += run.bad[k];
    o[MISMATCHES] += (double)nbad;
}
