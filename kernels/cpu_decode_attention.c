/* Decode attention over the packed base plus the fp16 overlay on a CPU: one fused pass per (request, KV head, chunk
 * of pages) that reads the packed codes, never a dequantized context. The C counterpart of attention_pages.py (the
 * same algebra), checked against attention_ref.ref_decode (tests/test_kernels_cpu_decode.py).
 *
 * Layouts (sgl_kvq/plan.py LayerKV and PagedPlan, one layer; asserted by the launcher, cpu_decode_attention.py):
 *   q, out     [B, Hq, D]      fp32 / fp16 / bf16 (dtype code 0 / 1 / 2), contiguous
 *   k_codes    [S, H, D*b/8]   uint8, b-bit codes packed along D (sgl_kvq/quant/pack.py: element i in byte
 *   v_codes                    i / (8/b) at bit (i % (8/b)) * b; b = 3: a 2-bit plane of D/4 bytes, then a
 *                              1-bit plane of D/8 bytes, code = low | high << 2); keys at k_bits, values at
 *                              v_bits (a recipe's layer may store them at different widths)
 *   k_scale    [P, H, D]       fp16 per page and channel: key = code * scale + zero
 *   k_zero
 *   v_scale    [S, H, NG]      fp16 per token and group of D / NG channels: value = code * scale + zero
 *   v_zero
 *   ov_k, ov_v [F, G, H, D]    fp32 / fp16 / bf16 overlay frames (the model's dtype), as stored; frame f starts
 *                              at element f * ov_stride of ov_k, f * ov_v_stride of ov_v (pooled kivi3 frames lie
 *                              k pages' codes apart, more than a frame; under a recipe a layer's key and value
 *                              codes differ in width), each frame contiguous
 *   plan       kv_indptr [B+1], kv_indices, kv_last [B]; ov_indptr [B+1], ov_indices, ov_last [B]: int32
 * Request b's context is its base pages then its overlay frames; the last page of each list holds *_last tokens.
 * window: a sliding layer's W (-1: none): the query, at the context's last position i, sees i - W .. i; the tokens
 * before are neither read nor counted, and units wholly before them make no task.
 *
 * A base page folds its scales into the query instead of dequantizing its keys: q . k_t = (q * s) . c_t + q . z.
 * Query head i reads KV head i / g (g = Hq / H). Work is split into tasks of up to `chunk` units (pages or frames)
 * of one request and KV head; each task leaves its running max, sum and weighted values in `partial`, and a second
 * pass merges a (request, head)'s tasks. Threads: OpenMP over tasks, resolved against the libgomp torch already
 * loaded (the same soname, one thread pool), `threads` of them: the launcher passes torch.get_num_threads(), as
 * torch's own parallel loops do (a thread's default OpenMP count ignores torch.set_num_threads). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { F32 = 0, F16 = 1, BF16 = 2 };

/* Forced inline, so that each (key, value) width pair's task (kvq_cpu_decode's switch) unpacks with constant widths:
 * left to itself GCC clones run_task for five constant pairs and runs the others on a generic copy. */
#define SPECIALIZED static inline __attribute__((always_inline))

static inline float f16_to_f32(uint16_t x) {
    _Float16 h;
    memcpy(&h, &x, 2);
    return (float)h;
}

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float load(const void *p, long i, int dtype) {
    if (dtype == F32) return ((const float *)p)[i];
    if (dtype == F16) return f16_to_f32(((const uint16_t *)p)[i]);
    return bf16_to_f32(((const uint16_t *)p)[i]);
}

static inline void store(void *p, long i, float x, int dtype) {
    if (dtype == F32) {
        ((float *)p)[i] = x;
    } else if (dtype == F16) {
        _Float16 h = (_Float16)x;
        memcpy((uint16_t *)p + i, &h, 2);
    } else {  /* round to nearest even, as torch's float -> bfloat16 */
        uint32_t u;
        memcpy(&u, &x, 4);
        uint16_t r = isnan(x) ? 0x7fc0 : (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
        ((uint16_t *)p)[i] = r;
    }
}

typedef struct {
    const void *q;
    void *out;
    const uint8_t *k_codes, *v_codes;
    const uint16_t *k_scale, *k_zero, *v_scale, *v_zero;
    const uint16_t *ov_k, *ov_v;
    const int32_t *kv_indptr, *kv_indices, *kv_last, *ov_indptr, *ov_indices, *ov_last;
    int H, Hq, D, G, NG, q_dtype, ov_dtype;
    long ov_stride, ov_v_stride;
    float sm_scale;
    int window; /* a sliding layer's W (the query at position i sees i - W .. i), -1 for none */
} Args;

/* Byte value -> its 8 / b codes as floats, in element order (a copy per packed byte instead of a shift, mask and
 * convert per code: the unpack was most of a token's work). */
static float LUT1[256][8], LUT2[256][4], LUT4[256][2];
/* 3-bit rows' high plane: a byte's 8 bits as 0 or 4 (the high bit's weight), added onto the low plane's codes */
static float LUT1_HIGH3[256][8];

__attribute__((constructor)) static void init_luts(void) {
    for (int v = 0; v < 256; v++) {
        for (int s = 0; s < 8; s++) LUT1[v][s] = (float)((v >> s) & 1);
        for (int s = 0; s < 8; s++) LUT1_HIGH3[v][s] = (float)(((v >> s) & 1) << 2);
        for (int s = 0; s < 4; s++) LUT2[v][s] = (float)((v >> (2 * s)) & 3);
        for (int s = 0; s < 2; s++) LUT4[v][s] = (float)((v >> (4 * s)) & 15);
    }
}

/* One row of b-bit codes -> D floats (b: the bit width as a constant, so each case has its own loop). */
SPECIALIZED void unpack_row(const uint8_t *restrict p, float *restrict c, int D, const int b) {
    if (b == 8) {
        for (int d = 0; d < D; d++) c[d] = (float)p[d];
        return;
    }
    /* 3 bits: 8 codes at a time from two low-plane bytes and one high-plane byte, in one pass (one layer of
     * SmolLM2's geometry, B=8, 1k tokens, one thread: 3.2 ms, kivi2 3.1, kivi4 3.4; a copy pass then an add pass
     * took 4.3) */
    if (b == 3) {
        const uint8_t *high = p + D / 4;
        for (int j = 0; j < D / 8; j++) {
            const float *lo0 = LUT2[p[2 * j]], *lo1 = LUT2[p[2 * j + 1]], *hi = LUT1_HIGH3[high[j]];
            for (int s = 0; s < 4; s++) {
                c[j * 8 + s] = lo0[s] + hi[s];
                c[j * 8 + 4 + s] = lo1[s] + hi[4 + s];
            }
        }
        return;
    }
    const int k = 8 / b;
    const float *lut = b == 1 ? LUT1[0] : b == 2 ? LUT2[0] : LUT4[0];
    for (int j = 0; j < D / k; j++) memcpy(c + j * k, lut + p[j] * k, sizeof(float) * k);
}

SPECIALIZED float dot(const float *restrict a, const float *restrict b, int D) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int d = 0; d < D; d++) s += a[d] * b[d];
    return s;
}

/* Online softmax over one unit's scores s[j * G + t], t0 <= t < n, per query head j: rescale the running state to
 * the new max, turn the scores into weights in place. */
static inline void softmax_step(float *restrict s, float *restrict m, float *restrict l, float *restrict acc,
                                int g, int t0, int n, int G, int D) {
    for (int j = 0; j < g; j++) {
        float mx = m[j];
        for (int t = t0; t < n; t++) mx = fmaxf(mx, s[j * G + t]);
        if (mx > m[j]) {
            const float alpha = m[j] == -INFINITY ? 0.f : expf(m[j] - mx);
            l[j] *= alpha;
            for (int d = 0; d < D; d++) acc[j * D + d] *= alpha;
            m[j] = mx;
        }
        float sum = 0.f;
        for (int t = t0; t < n; t++) {
            const float e = expf(s[j * G + t] - mx);
            s[j * G + t] = e;
            sum += e;
        }
        l[j] += sum;
    }
}

SPECIALIZED void axpy(float *restrict y, const float *restrict x, float a, int D) {
#pragma omp simd
    for (int d = 0; d < D; d++) y[d] += a * x[d];
}

/* A base page's tokens t0 .. n - 1 of KV head h for the g query rows qh (already scaled by sm_scale). */
SPECIALIZED void base_page(const Args *a, int page, int t0, int n, int h, const float *restrict qh,
                           float *restrict m, float *restrict l, float *restrict acc, float *restrict s,
                           const int kb, const int vb) {
    const int D = a->D, H = a->H, G = a->G, NG = a->NG, g = a->Hq / a->H, VG = D / NG;
    const int Dpk = D * kb / 8, Dpv = D * vb / 8;
    float qs[g * D], qz[g], c[D], v[D];
    const long kp = ((long)page * H + h) * D;
    for (int j = 0; j < g; j++) {
        float z = 0.f;
        for (int d = 0; d < D; d++) {
            qs[j * D + d] = qh[j * D + d] * f16_to_f32(a->k_scale[kp + d]);
            z += qh[j * D + d] * f16_to_f32(a->k_zero[kp + d]);
        }
        qz[j] = z;
    }
    for (int t = t0; t < n; t++) {
        unpack_row(a->k_codes + ((long)(page * G + t) * H + h) * Dpk, c, D, kb);
        for (int j = 0; j < g; j++) s[j * G + t] = dot(qs + j * D, c, D) + qz[j];
    }
    softmax_step(s, m, l, acc, g, t0, n, G, D);
    for (int t = t0; t < n; t++) {
        const long row = (long)(page * G + t) * H + h;
        unpack_row(a->v_codes + row * Dpv, c, D, vb);
        for (int grp = 0; grp < NG; grp++) {
            const float sc = f16_to_f32(a->v_scale[row * NG + grp]), zr = f16_to_f32(a->v_zero[row * NG + grp]);
            for (int d = grp * VG; d < (grp + 1) * VG; d++) v[d] = c[d] * sc + zr;
        }
        for (int j = 0; j < g; j++) axpy(acc + j * D, v, s[j * G + t], D);
    }
}

/* An overlay frame's tokens t0 .. n - 1 of KV head h, as stored. Out of line: it reads no codes, and a copy in
 * every width pair's task made the uniform widths 3-8% slower (bench/decode_work.py --widths, one run, not kept). */
static void overlay_frame(const Args *a, int frame, int t0, int n, int h, const float *restrict qh,
                          float *restrict m, float *restrict l, float *restrict acc, float *restrict s) {
    const int D = a->D, H = a->H, G = a->G, g = a->Hq / a->H;
    float c[D];
    for (int t = t0; t < n; t++) {
        const long row = frame * a->ov_stride + ((long)t * H + h) * D;
        for (int d = 0; d < D; d++) c[d] = load(a->ov_k, row + d, a->ov_dtype);
        for (int j = 0; j < g; j++) s[j * G + t] = dot(qh + j * D, c, D);
    }
    softmax_step(s, m, l, acc, g, t0, n, G, D);
    for (int t = t0; t < n; t++) {
        const long row = frame * a->ov_v_stride + ((long)t * H + h) * D;
        for (int d = 0; d < D; d++) c[d] = load(a->ov_v, row + d, a->ov_dtype);
        for (int j = 0; j < g; j++) axpy(acc + j * D, c, s[j * G + t], D);
    }
}

/* Request b's units: its base pages, then its overlay frames. */
static inline int units_of(const Args *a, int b) {
    return a->kv_indptr[b + 1] - a->kv_indptr[b] + a->ov_indptr[b + 1] - a->ov_indptr[b];
}

/* The first token request b's query sees, as (unit, token in it): 0, 0 without a window. Every unit but the
 * context's last is whole (G tokens), so positions map to units by division. */
static inline void window_start(const Args *a, int b, int *unit, int *tok) {
    const int G = a->G, np = a->kv_indptr[b + 1] - a->kv_indptr[b], nf = a->ov_indptr[b + 1] - a->ov_indptr[b];
    const int base = np ? (np - 1) * G + a->kv_last[b] : 0, len = base + (nf ? (nf - 1) * G + a->ov_last[b] : 0);
    const int lo = a->window < 0 || len - 1 - a->window < 0 ? 0 : len - 1 - a->window;
    if (lo < base) {
        *unit = lo / G;
        *tok = lo % G;
    } else {
        *unit = np + (lo - base) / G;
        *tok = (lo - base) % G;
    }
}

/* Units [u0, u1) of request b for KV head h into one partial state; unit u0 from token t0 on. */
SPECIALIZED void run_task(const Args *a, int b, int h, int u0, int t0, int u1, float *restrict part,
                          const int kb, const int vb) {
    const int D = a->D, G = a->G, g = a->Hq / a->H;
    const int np = a->kv_indptr[b + 1] - a->kv_indptr[b], nf = a->ov_indptr[b + 1] - a->ov_indptr[b];
    float qh[g * D], s[g * G];
    float *acc = part, *m = part + g * D, *l = m + g;
    for (int j = 0; j < g; j++) {
        const long qi = ((long)b * a->Hq + h * g + j) * D;
        for (int d = 0; d < D; d++) qh[j * D + d] = load(a->q, qi + d, a->q_dtype) * a->sm_scale;
        m[j] = -INFINITY;
        l[j] = 0.f;
    }
    memset(acc, 0, sizeof(float) * g * D);
    for (int u = u0; u < u1; u++) {
        const int from = u == u0 ? t0 : 0;
        if (u < np) {
            const int n = u == np - 1 ? a->kv_last[b] : G;
            base_page(a, a->kv_indices[a->kv_indptr[b] + u], from, n, h, qh, m, l, acc, s, kb, vb);
        } else {
            const int f = u - np, n = f == nf - 1 ? a->ov_last[b] : G;
            overlay_frame(a, a->ov_indices[a->ov_indptr[b] + f], from, n, h, qh, m, l, acc, s);
        }
    }
}

/* Returns 0, or -1 when the task table could not be allocated. */
int kvq_cpu_decode(const void *q, void *out, const uint8_t *k_codes, const uint8_t *v_codes,
                   const uint16_t *k_scale, const uint16_t *k_zero, const uint16_t *v_scale, const uint16_t *v_zero,
                   const uint16_t *ov_k, const uint16_t *ov_v, const int32_t *kv_indptr, const int32_t *kv_indices,
                   const int32_t *kv_last, const int32_t *ov_indptr, const int32_t *ov_indices,
                   const int32_t *ov_last, int B, int H, int Hq, int D, int G, int k_bits, int v_bits, int NG,
                   int q_dtype, int ov_dtype, long ov_stride, long ov_v_stride, float sm_scale, int window, int chunk,
                   int threads, float *partial) {
    const Args a = {q, out, k_codes, v_codes, k_scale, k_zero, v_scale, v_zero, ov_k, ov_v, kv_indptr, kv_indices,
                    kv_last, ov_indptr, ov_indices, ov_last, H, Hq, D, G, NG, q_dtype, ov_dtype, ov_stride,
                    ov_v_stride, sm_scale, window};
    /* partial [tasks, g, D + 2]: per query head of a task its weighted values, then max and sum */
    const int g = Hq / H, stride = g * (D + 2);
    /* request b's tasks are first[b] .. first[b + 1] - 1, H x its chunks of the units its window sees (from unit
     * u_lo[b], token t_lo[b] in it) in (head, chunk) order; task_b[t]: the request of task t */
    int *first = malloc(sizeof(int) * (3 * B + 1)), *u_lo = first + B + 1, *t_lo = u_lo + B;
    if (!first) return -1;
    first[0] = 0;
    for (int b = 0; b < B; b++) {
        window_start(&a, b, u_lo + b, t_lo + b);
        first[b + 1] = first[b] + H * ((units_of(&a, b) - u_lo[b] + chunk - 1) / chunk);
    }
    const int tasks = first[B];
    int *task_b = malloc(sizeof(int) * (tasks > 0 ? tasks : 1));
    if (!task_b) {
        free(first);
        return -1;
    }
    for (int b = 0; b < B; b++)
        for (int t = first[b]; t < first[b + 1]; t++) task_b[t] = b;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (tasks > 1 && threads > 1)
    for (int t = 0; t < tasks; t++) {
        const int b = task_b[t], chunks = (first[b + 1] - first[b]) / H, i = t - first[b];
        const int h = i / chunks, c = i % chunks;
        const int units = units_of(&a, b), u0 = u_lo[b] + c * chunk, u1 = u0 + chunk < units ? u0 + chunk : units;
        const int t0 = c == 0 ? t_lo[b] : 0;
        float *part = partial + (long)t * stride;
        /* unpacking specialized per (key, value) width pair, a recipe's mixed layers included: on the generic
         * copy a K4V2 layer took 1.9x K3V3's time, specialized 0.8x (bench/results/decode-widths-cpu-kernel.json) */
#define PAIR(kb, vb) case (kb) * 16 + (vb): run_task(&a, b, h, u0, t0, u1, part, kb, vb); break;
#define PAIRS_K(kb) PAIR(kb, 1) PAIR(kb, 2) PAIR(kb, 3) PAIR(kb, 4)
        switch (k_bits * 16 + v_bits) {
            PAIRS_K(1) PAIRS_K(2) PAIRS_K(3) PAIRS_K(4)
            PAIR(8, 8)
            default: run_task(&a, b, h, u0, t0, u1, part, k_bits, v_bits); break;
        }
#undef PAIRS_K
#undef PAIR
    }
    /* merge each (request, KV head)'s chunks; a request without units (none in a decode batch) gets zeros */
    for (int b = 0; b < B; b++) {
        const int chunks = (first[b + 1] - first[b]) / H;
        for (int h = 0; h < H; h++) {
            for (int j = 0; j < g; j++) {
                float mx = -INFINITY, l = 0.f, o[D];
                for (int c = 0; c < chunks; c++)
                    mx = fmaxf(mx, partial[(long)(first[b] + h * chunks + c) * stride + g * D + j]);
                memset(o, 0, sizeof(float) * D);
                for (int c = 0; c < chunks; c++) {
                    const float *p = partial + (long)(first[b] + h * chunks + c) * stride;
                    const float w = p[g * D + j] == -INFINITY ? 0.f : expf(p[g * D + j] - mx);
                    l += w * p[g * D + g + j];
                    axpy(o, p + j * D, w, D);
                }
                const long oi = ((long)b * Hq + h * g + j) * D;
                for (int d = 0; d < D; d++) store(out, oi + d, l > 0.f ? o[d] / l : 0.f, q_dtype);
            }
        }
    }
    free(task_b);
    free(first);
    return 0;
}
