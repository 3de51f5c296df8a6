// Decode-step kernels for the torch backend on x86 CPUs: see cpu_kernels.py for why and how
// this file is built (once per instruction set, -DLLK_AVX512BF16, -DLLK_AVX512 or -DLLK_AVX2) and called.
//
// A decode step reads every weight once for a handful of rows, and every cached key and value
// of every row once: both are streams from memory with little arithmetic per byte, and what
// decides their speed is how close the stream gets to the memory bandwidth. The linear and
// attention kernels read the weights and the cache in their plain layouts, a sequential stream
// per chunk of work with a software prefetch ahead of it, and accumulate in float32. The rest of
// a step (norms, rotary, SiLU) is fused into three small kernels that round as torch does. The
// threads are the caller's and a pool's (Pool, below), not OpenMP's.
//
// dtype codes: 0 float32, 1 bfloat16. Pointers are to row-major data, rows `ld` elements apart
// where an ld is given and contiguous otherwise. A weight may also be int8 with a float32 scale per
// row (weight code 3, INT8_CODE): w [N, K] is its N K values, and the N scales follow them from the
// next multiple of 64 bytes (row_scales); row n of the weight is w[n] * scale[n].
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <new>
#include <thread>
#include <type_traits>
#include <vector>

#define LLK_API extern "C" __attribute__((visibility("default")))

namespace {

typedef uint16_t bf16;

inline float bf16_to_f32(bf16 h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

// Round to nearest even, as torch's float32 -> bfloat16 conversion does (NaN stays NaN).
inline bf16 f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

inline float to_f32(float x) { return x; }
inline float to_f32(bf16 x) { return bf16_to_f32(x); }
inline float to_f32(int8_t x) { return (float)x; }
inline void store_scalar(float *p, float v) { *p = v; }
inline void store_scalar(bf16 *p, float v) { *p = f32_to_bf16(v); }

#if defined(LLK_AVX512BF16) || defined(LLK_AVX512)
#define LLK_VEC512 1
#if defined(LLK_AVX512BF16)
static const char ISA[] = "avx512bf16";
#else
static const char ISA[] = "avx512";
#endif
struct Vec {
    typedef __m512 F;
    static const int N = 16;
    static F zero() { return _mm512_setzero_ps(); }
    static F set1(float x) { return _mm512_set1_ps(x); }
    static F load(const float *p) { return _mm512_loadu_ps(p); }
    static F load(const bf16 *p) {
        __m256i h = _mm256_loadu_si256((const __m256i *)p);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    static F load(const int8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))); }
    static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
    static F add(F a, F b) { return _mm512_add_ps(a, b); }
    static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
    static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
    static F div(F a, F b) { return _mm512_div_ps(a, b); }
    // 1 / d: rcp14's 14 bits, one Newton step
    static F recip(F d) {
        F r = _mm512_rcp14_ps(d);
        return _mm512_fmadd_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(1.0f)), r);
    }
    static F max(F a, F b) { return _mm512_max_ps(a, b); }
    static F min(F a, F b) { return _mm512_min_ps(a, b); }
    static float hsum(F a) { return _mm512_reduce_add_ps(a); }
    static float hmax(F a) { return _mm512_reduce_max_ps(a); }
    static void store(float *p, F v) { _mm512_storeu_ps(p, v); }
    // integral values within int8's range, as int8
    static void store(int8_t *p, F v) { _mm_storeu_si128((__m128i *)p, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v))); }
#if defined(LLK_AVX512BF16)
    static void store(bf16 *p, F v) { _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(v)); }
    // v rounded to bf16 (to nearest even), kept as float32
    static F round_bf16(F v) {
        __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
#else
    static F round_bf16(F v) {  // to nearest even; NaN is not kept NaN (no NaN reaches here)
        __m512i u = _mm512_castps_si512(v);
        __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
        return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xffff0000u)));
    }
    static void store(bf16 *p, F v) {
        _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(round_bf16(v)), 16)));
    }
#endif
    // 2^n for integer-valued n in float32's exponent range
    static F pow2(F n) {
        __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
        return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
    }
    static F round(F x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
    // 2N bf16 as float32: the even-numbered elements and the odd-numbered ones, one load
    static void load_split(const bf16 *p, F &even, F &odd) {
        __m512i raw = _mm512_loadu_si512(p);
        even = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
        odd = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32((int)0xffff0000u)));
    }
    // a[0..N) -> one vector whose lane j is the sum of a[j]'s lanes
    static F sum_lanes(const F *a) {
        F s[8], t[4];
        for (int i = 0; i < 8; i++)
            s[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
        for (int i = 0; i < 4; i++) {
            __m512d x = _mm512_castps_pd(s[2 * i]), y = _mm512_castps_pd(s[2 * i + 1]);
            t[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
        }
        F u0 = _mm512_add_ps(_mm512_shuffle_f32x4(t[0], t[1], 0x88), _mm512_shuffle_f32x4(t[0], t[1], 0xdd));
        F u1 = _mm512_add_ps(_mm512_shuffle_f32x4(t[2], t[3], 0x88), _mm512_shuffle_f32x4(t[2], t[3], 0xdd));
        return _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, 0x88), _mm512_shuffle_f32x4(u0, u1, 0xdd));
    }
};
#elif defined(LLK_AVX2)
static const char ISA[] = "avx2";
struct Vec {
    typedef __m256 F;
    static const int N = 8;
    static F zero() { return _mm256_setzero_ps(); }
    static F set1(float x) { return _mm256_set1_ps(x); }
    static F load(const float *p) { return _mm256_loadu_ps(p); }
    static F load(const bf16 *p) {
        __m128i h = _mm_loadu_si128((const __m128i *)p);
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    static F load(const int8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))); }
    static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
    static F add(F a, F b) { return _mm256_add_ps(a, b); }
    static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
    static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
    static F div(F a, F b) { return _mm256_div_ps(a, b); }
    // 1 / d: rcp's 12 bits, one Newton step
    static F recip(F d) {
        F r = _mm256_rcp_ps(d);
        return _mm256_fmadd_ps(r, _mm256_fnmadd_ps(d, r, _mm256_set1_ps(1.0f)), r);
    }
    static F max(F a, F b) { return _mm256_max_ps(a, b); }
    static F min(F a, F b) { return _mm256_min_ps(a, b); }
    static float hsum(F a) {
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_movehdup_ps(s));
        return _mm_cvtss_f32(s);
    }
    static float hmax(F a) {
        __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        s = _mm_max_ps(s, _mm_movehl_ps(s, s));
        s = _mm_max_ss(s, _mm_movehdup_ps(s));
        return _mm_cvtss_f32(s);
    }
    static void store(float *p, F v) { _mm256_storeu_ps(p, v); }
    // integral values within int8's range, as int8
    static void store(int8_t *p, F v) {
        __m256i i = _mm256_cvtps_epi32(v);
        __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
        _mm_storel_epi64((__m128i *)p, _mm_packs_epi16(words, words));
    }
    static F round_bf16(F v) {  // to nearest even; NaN is not kept NaN (no NaN reaches here)
        __m256i u = _mm256_castps_si256(v);
        __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        u = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
        return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xffff0000u)));
    }
    static void store(bf16 *p, F v) {
        __m256i u = _mm256_srli_epi32(_mm256_castps_si256(round_bf16(v)), 16);
        __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
        _mm_storeu_si128((__m128i *)p, packed);
    }
    static F pow2(F n) {
        __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
        return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
    }
    static F round(F x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
    static void load_split(const bf16 *p, F &even, F &odd) {
        __m256i raw = _mm256_loadu_si256((const __m256i *)p);
        even = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
        odd = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32((int)0xffff0000u)));
    }
    static F sum_lanes(const F *a) {
        F s[4];
        for (int i = 0; i < 4; i++) s[i] = _mm256_hadd_ps(a[2 * i], a[2 * i + 1]);
        F t0 = _mm256_hadd_ps(s[0], s[1]), t1 = _mm256_hadd_ps(s[2], s[3]);
        return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
    }
};
#else
#error "build with -DLLK_AVX512BF16, -DLLK_AVX512 or -DLLK_AVX2"
#endif

// exp(x) for x in [-87, 88] (clamped there): 2^n e^f with n the nearest integer to x log2 e and
// f = x - n ln 2 (ln 2 in two parts, so that f is exact to float32), |f| <= ln(2) / 2; e^f by its
// Taylor polynomial of degree 7. Within 2 units in the last place of float32.
inline Vec::F vexp(Vec::F x) {
    x = Vec::min(Vec::max(x, Vec::set1(-87.0f)), Vec::set1(88.0f));
    Vec::F n = Vec::round(Vec::mul(x, Vec::set1(1.44269504088896341f)));
    Vec::F f = Vec::fma(n, Vec::set1(-0.693145751953125f), x);  // ln 2's first 16 bits: n * it is exact
    f = Vec::fma(n, Vec::set1(-1.428606765330187045e-06f), f);   // the rest of ln 2
    Vec::F p = Vec::set1(1.0f / 5040);
    p = Vec::fma(p, f, Vec::set1(1.0f / 720));
    p = Vec::fma(p, f, Vec::set1(1.0f / 120));
    p = Vec::fma(p, f, Vec::set1(1.0f / 24));
    p = Vec::fma(p, f, Vec::set1(1.0f / 6));
    p = Vec::fma(p, f, Vec::set1(0.5f));
    p = Vec::fma(p, f, Vec::set1(1.0f));
    p = Vec::fma(p, f, Vec::set1(1.0f));
    return Vec::mul(p, Vec::pow2(n));
}

// v rounded to T (to nearest even), kept as float32.
template <class T>
inline Vec::F rounded(Vec::F v) {
    if constexpr (sizeof(T) == 2) return Vec::round_bf16(v);
    else return v;
}

// 2^f for |f| <= 1/2 by its Taylor polynomial of degree 5, within 3e-6 of it: enough for a result rounded to bf16
// next (4e-3), in half the instructions of vexp's degree 7.
inline Vec::F exp2_fraction(Vec::F f) {
    Vec::F e = Vec::fma(Vec::set1(1.3333558e-3f), f, Vec::set1(9.6181291e-3f));
    e = Vec::fma(e, f, Vec::set1(5.5504109e-2f));
    e = Vec::fma(e, f, Vec::set1(2.4022651e-1f));
    e = Vec::fma(e, f, Vec::set1(6.9314718e-1f));
    return Vec::fma(e, f, Vec::set1(1.0f));
}

// exp(x) for x in [-87, 88] (clamped there) as 2^y, y = x log2 e: exp2_fraction(y - round(y)) scaled by
// 2^round(y). For a result rounded to bf16 next.
inline Vec::F vexp_coarse(Vec::F x) {
    x = Vec::min(Vec::max(x, Vec::set1(-87.0f)), Vec::set1(88.0f));
    const Vec::F y = Vec::mul(x, Vec::set1(1.44269504088896341f)), n = Vec::round(y);
    return Vec::mul(exp2_fraction(Vec::sub(y, n)), Vec::pow2(n));
}

// silu(x) = x / (1 + e^-x) in float32, for a result rounded to T. For bf16, e^-x to bf16's precision and the
// division as a reciprocal: silu_mul over 768 rows of the bench model's [gate | up], 12 times, took 7.9 ms so and
// 10.6 with vexp and a division (AMX Xeon, 2 threads), and its results matched torch's silu(gate) * up on 262k
// random values of N(0, 6^2) bit for bit (the avx2 build's, to an ulp). Float32 results keep both to an ulp or two.
template <class T>
inline Vec::F silu(Vec::F x) {
    const Vec::F one = Vec::set1(1.0f), minus_x = Vec::sub(Vec::zero(), x);
    if constexpr (sizeof(T) == 2) return Vec::mul(x, Vec::recip(Vec::add(one, vexp_coarse(minus_x))));
    else return Vec::div(x, Vec::add(one, vexp(minus_x)));
}

inline void prefetch(const void *p) { _mm_prefetch((const char *)p, _MM_HINT_T0); }
// A product's weights ahead of its reads, into L2 only (see PREFETCH_ROWS_WEIGHTS). -DLLK_WEIGHT_HINT=..
// for an A/B.
#if !defined(LLK_WEIGHT_HINT)
#define LLK_WEIGHT_HINT _MM_HINT_T1
#endif
inline void prefetch_weight(const void *p) { _mm_prefetch((const char *)p, LLK_WEIGHT_HINT); }

inline long round_up(long n, long m) { return (n + m - 1) / m * m; }

static const int INT8_CODE = 3;

// The scale of each of w's N rows: none (nullptr) but for an int8 weight, whose scales follow its N K values
// from the next multiple of 64 bytes. A product over w multiplies each output's float32 sum by its row's scale.
template <class TW>
inline const float *row_scales(const TW *w, long N, long K) {
    if constexpr (std::is_same_v<TW, int8_t>) return (const float *)((const char *)w + round_up(N * K, 64));
    else return (void)w, (void)N, (void)K, nullptr;
}

inline float scaled(float sum, const float *scales, long n) { return scales ? sum * scales[n] : sum; }

// A thread's scratch buffer, at least n elements long: it only grows. resize() value-initialises the elements it
// adds, so a buffer sized per call (K alternating 768 and 3072 between a layer's products, a prompt's attention
// span growing with its rows) zero-filled its tail on most calls: 2% of a 256-token prefill's time on the AMX
// Xeon. For buffers whose every element a call reads it first writes (stale values are not zeros).
template <class V>
inline typename V::value_type *grown(V &buffer, size_t n) {
    if (buffer.size() < n) buffer.resize(n);
    return buffer.data();
}

// ---------------------------------------------------------------------------------------------
// The kernels' threads: the caller and helper threads claim chunks of a job from one counter.
//
// OpenMP's parallel regions end at a barrier that waits for every thread of the team, so when a
// server's other processes take one core for a while, the model's other thread stands idle at
// that barrier. Here a job is done when its chunks are: the caller works through them itself
// and waits only for chunks a helper has claimed and not yet finished, never for a helper that
// has not started. Helpers spin a short while for the next job (the gaps between a step's
// kernels) and then sleep (the gaps between steps, when the server needs the cores).

class Pool {
  public:
    // Run body(c) for c in [0, chunks) on up to `threads` threads (the caller one of them).
    template <class Body>
    void run(long chunks, int threads, Body &&body) {
        if (threads <= 1 || chunks <= 1 || busy_.exchange(true, std::memory_order_acquire)) {  // another
            // caller's job has the helpers: this one runs alone
            for (long c = 0; c < chunks; c++) body(c);
            return;
        }
        start_helpers(threads - 1);  // only the caller holding busy_ gets here
        Job job{chunks, [](void *ctx, long c) { (*static_cast<Body *>(ctx))(c); }, &body};
        // The ticket holds the generation in its high half and the next chunk in its low half; it is
        // open (a chunk to claim) only while its job lives. It changes generation closed before the
        // job changes: a helper still on the last generation, however late, finds no ticket of its
        // generation to claim, whichever job it reads. Then the job, and the ticket opened at chunk 0.
        const uint64_t gen = (ticket_.load(std::memory_order_relaxed) >> 32) + 1;
        ticket_.store((gen << 32) | CLOSED, std::memory_order_seq_cst);
        job_.store(&job, std::memory_order_release);
        done_.store(0, std::memory_order_relaxed);
        ticket_.store(gen << 32, std::memory_order_release);
        generation_.store((uint32_t)gen, std::memory_order_release);
        generation_.notify_all();
        work(gen, job);
        while (done_.load(std::memory_order_acquire) < chunks) _mm_pause();
        // Closed again before the job goes: a helper that read this ticket exhausted but not closed
        // may read the job's chunk count after the job is gone, and its claim must then fail.
        ticket_.store((gen << 32) | CLOSED, std::memory_order_release);
        job_.store(nullptr, std::memory_order_release);
        busy_.store(false, std::memory_order_release);
    }

  private:
    struct Job {
        long chunks;
        void (*call)(void *, long);
        void *ctx;
    };

    // Claim and run chunks of generation gen until none are left, counting each one done.
    void work(uint64_t gen, const Job &job) {
        for (;;) {
            uint64_t t = ticket_.load(std::memory_order_acquire);
            if ((t >> 32) != gen || (t & CLOSED) == CLOSED || (long)(t & CLOSED) >= job.chunks) return;
            if (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) continue;
            job.call(job.ctx, (long)(t & CLOSED));
            done_.fetch_add(1, std::memory_order_release);
        }
    }

    void helper() {
        uint32_t seen = generation_.load(std::memory_order_acquire);
        for (;;) {
            auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(SPIN_US);
            uint32_t now;
            while ((now = generation_.load(std::memory_order_acquire)) == seen) {
                if (std::chrono::steady_clock::now() > until) {
                    generation_.wait(seen, std::memory_order_acquire);
                } else {
                    for (int i = 0; i < 64; i++) _mm_pause();
                }
            }
            seen = now;
            const Job *job = job_.load(std::memory_order_acquire);
            if (job == nullptr) continue;
            // the job is valid while its generation's chunks remain: work() checks that with every claim
            work((uint64_t)now, *job);
        }
    }

    void start_helpers(int count) {
        while ((int)helpers_.size() < count) {
            helpers_.emplace_back([this] { helper(); });
            helpers_.back().detach();
        }
    }

    // A ticket's chunk field when no chunk may be claimed.
    static const uint64_t CLOSED = 0xffffffffu;
    // How long a helper waits, spinning, for the next job before it sleeps.
    static const int SPIN_US = 200;
    // Whether a caller's job has the helpers (a try-lock; an atomic rather than a std::mutex, whose
    // trylock is a glibc 2.34 symbol: the shipped library loads on older serving hosts).
    std::atomic<bool> busy_{false};
    std::atomic<uint64_t> ticket_{CLOSED};
    std::atomic<uint32_t> generation_{0};
    std::atomic<long> done_{0};
    std::atomic<const Job *> job_{nullptr};
    std::vector<std::thread> helpers_;
};

Pool &pool() {
    static Pool *instance = new Pool();  // never destroyed: its helpers outlive static destructors
    return *instance;
}


// ---------------------------------------------------------------------------------------------
// linear: y[M, N] = x[M, K] @ w[N, K]^T for the few rows of a decode step.
//
// Each thread takes a contiguous range of w's rows and walks it in blocks of R rows, each
// block against MB rows of x at a time (the block stays in L1 for the next MB rows). The
// prefetch runs ahead of the block in memory order; further ahead when more rows of x make
// each byte of w take longer.

// out[i] = the sum of acc[i]'s lanes, for the R * MB accumulators of a tile; N of them at once
// when the tile has exactly N.
template <int R, int MB>
inline void reduce_tile(const Vec::F *acc, float *out) {
    if constexpr (R * MB == Vec::N) {
        Vec::store(out, Vec::sum_lanes(acc));
    } else {
        for (int i = 0; i < R * MB; i++) out[i] = Vec::hsum(acc[i]);
    }
}

// One row of x against one row of w over four accumulators: with one, each multiply-add waits
// for the last (4 cycles on most x86 cores), which held the AVX2 class's stream of bf16 weights
// for one row to 8 weights per 4 cycles, 37 GB/s on two Zen 5 cores where x.sum() read 45. An int8
// weight is one byte: the same 8 weights per cycle and core are half the bytes, so int8 takes eight.
template <class TX, class TW>
inline float dot_unrolled(const TX *x, const TW *w, long K, long pf) {
    constexpr int ACC = sizeof(TW) == 1 ? 8 : 4;
    constexpr long STEP = ACC * Vec::N, LINE = 64 / (long)sizeof(TW);
    Vec::F a[ACC];
    for (int i = 0; i < ACC; i++) a[i] = Vec::zero();
    long k = 0;
    for (; k + STEP <= K; k += STEP) {
        for (long i = 0; i < STEP; i += LINE) prefetch_weight(w + k + i + pf);
        for (int i = 0; i < ACC; i++) a[i] = Vec::fma(Vec::load(w + k + i * Vec::N), Vec::load(x + k + i * Vec::N), a[i]);
    }
    for (; k + Vec::N <= K; k += Vec::N) {
        prefetch_weight(w + k + pf);
        a[0] = Vec::fma(Vec::load(w + k), Vec::load(x + k), a[0]);
    }
    for (int width = ACC / 2; width > 0; width /= 2)  // neighbours first: ((a0 + a1) + (a2 + a3)) ...
        for (int i = 0; i < width; i++) a[i] = Vec::add(a[2 * i], a[2 * i + 1]);
    float sum = Vec::hsum(a[0]);
    for (; k < K; k++) sum += to_f32(x[k]) * to_f32(w[k]);
    return sum;
}

// R rows of w against MB rows of x. The prefetch runs pf ahead of the block in memory order, or,
// where `ahead` is given, one line-sized step of `ahead_step` elements per k through it (see
// linear_rows).
template <class TX, class TW, int R, int MB>
inline void linear_block(const TX *x, long ldx, const TW *w, long K, long pf, float *acc_out,
                         const TW *ahead = nullptr, long ahead_step = 0) {
    if constexpr (R == 1 && MB == 1) {
        acc_out[0] = dot_unrolled(x, w, K, pf);
        return;
    }
    Vec::F acc[MB][R];
    for (int m = 0; m < MB; m++)
        for (int r = 0; r < R; r++) acc[m][r] = Vec::zero();
    const bool spread = ahead != nullptr;
    long k = 0;
    for (; k + Vec::N <= K; k += Vec::N) {
        Vec::F wv[R];
        if (spread) {
            prefetch_weight(ahead);
            ahead += ahead_step;
        }
        for (int r = 0; r < R; r++) {
            if (!spread) prefetch_weight(w + R * k + r * Vec::N + pf);
            wv[r] = Vec::load(w + r * K + k);
        }
        for (int m = 0; m < MB; m++) {
            Vec::F xv = Vec::load(x + m * ldx + k);
            for (int r = 0; r < R; r++) acc[m][r] = Vec::fma(wv[r], xv, acc[m][r]);
        }
    }
    reduce_tile<R, MB>(&acc[0][0], acc_out);
    for (long j = k; j < K; j++)
        for (int m = 0; m < MB; m++)
            for (int r = 0; r < R; r++) acc_out[m * R + r] += to_f32(x[m * ldx + j]) * to_f32(w[r * K + j]);
}

#if defined(LLK_AVX512BF16)
// bf16 x bf16 with the CPU's dot-product instruction: two products per float32 lane and step. A weight is
// bf16, or int8 widened to bf16 as it loads (exactly: every int8 is a bf16), so that int8 weights under bf16
// activations multiply at bf16's rate rather than widened to float32 with both operands.
// 32 int8 values (16 in lo, then 16 in hi) as bf16.
inline __m512bh int8_pairs(__m128i lo, __m128i hi) {
    return _mm512_cvtne2ps_pbh(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)));
}
inline __m512bh load_pairs(const bf16 *p) { return (__m512bh)_mm512_loadu_si512(p); }
inline __m512bh load_pairs(const int8_t *p) {
    return int8_pairs(_mm_loadu_si128((const __m128i *)p), _mm_loadu_si128((const __m128i *)(p + 16)));
}
// The first n < 32 elements at p, zeros after them.
inline __m512bh load_pairs(const bf16 *p, long n) {
    return (__m512bh)_mm512_maskz_loadu_epi16((__mmask32)((1ull << n) - 1), p);
}
inline __m512bh load_pairs(const int8_t *p, long n) {
    const __m256i bytes = _mm256_maskz_loadu_epi8((__mmask32)((1ull << n) - 1), p);
    return int8_pairs(_mm256_castsi256_si128(bytes), _mm256_extracti128_si256(bytes, 1));
}

// One row of w against one row of x, over four accumulators, so that the chain of dependent
// dot-product instructions (each waiting for the last one's sum) does not bound the stream on a
// CPU whose instruction is slow (on the Zen 5 EPYC one accumulator streamed as fast).
template <class TW>
inline float dot_dp(const bf16 *x, const TW *w, long K, long pf) {
    constexpr long LINE = 64 / (long)sizeof(TW);
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    long k = 0;
    for (; k + 128 <= K; k += 128) {
        for (long i = 0; i < 128; i += LINE) prefetch_weight(w + k + i + pf);
        a0 = _mm512_dpbf16_ps(a0, load_pairs(w + k), load_pairs(x + k));
        a1 = _mm512_dpbf16_ps(a1, load_pairs(w + k + 32), load_pairs(x + k + 32));
        a2 = _mm512_dpbf16_ps(a2, load_pairs(w + k + 64), load_pairs(x + k + 64));
        a3 = _mm512_dpbf16_ps(a3, load_pairs(w + k + 96), load_pairs(x + k + 96));
    }
    for (; k + 32 <= K; k += 32) {
        prefetch_weight(w + k + pf);
        a0 = _mm512_dpbf16_ps(a0, load_pairs(w + k), load_pairs(x + k));
    }
    if (k < K) a1 = _mm512_dpbf16_ps(a1, load_pairs(w + k, K - k), load_pairs(x + k, K - k));
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

template <class TW, int R, int MB>
inline void linear_block_dp(const bf16 *x, long ldx, const TW *w, long K, long pf, float *acc_out) {
    if constexpr (R == 1 && MB == 1) {
        acc_out[0] = dot_dp(x, w, K, pf);
        return;
    }
    __m512 acc[MB][R];
    for (int m = 0; m < MB; m++)
        for (int r = 0; r < R; r++) acc[m][r] = _mm512_setzero_ps();
    long k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512bh wv[R];
        for (int r = 0; r < R; r++) {
            prefetch_weight(w + R * k + r * 32 + pf);
            wv[r] = load_pairs(w + r * K + k);
        }
        for (int m = 0; m < MB; m++) {
            __m512bh xv = load_pairs(x + m * ldx + k);
            for (int r = 0; r < R; r++) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], wv[r], xv);
        }
    }
    if (k < K) {
        __m512bh wv[R];
        for (int r = 0; r < R; r++) wv[r] = load_pairs(w + r * K + k, K - k);
        for (int m = 0; m < MB; m++) {
            __m512bh xv = load_pairs(x + m * ldx + k, K - k);
            for (int r = 0; r < R; r++) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], wv[r], xv);
        }
    }
    reduce_tile<R, MB>(&acc[0][0], acc_out);
}
#endif

#if defined(LLK_AVX2)
// int8 weights under float32 activations on the AVX2 build, several rows: the rows as int16 (quantize_rows_i16),
// each 16 weights widened to int16 in one instruction and multiplied with 16 of a row's in one more (vpmaddwd:
// pairs of products summed into 8 int32 lanes), where float32 takes four to widen 8 weights for 8 multiply-adds.
// A step of several rows is bound by that arithmetic (cpu-kernels.md). The sums stay exact in int32 over
// I16_KB of K (256 vpmaddwd a lane, each at most 2 * 32767 * 127), then add up in float32.
static constexpr long I16_KB = 4096;
static constexpr float I16_MAX = 32767.0f;

inline __m256i widen_i16(const int8_t *p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)); }

// The sum of v's eight int32 lanes, in int64: exact, so a row's output is the same bits whatever tile took it.
inline int64_t sum_lanes_exactly(__m256i v) {
    const __m256i wide = _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(v)),
                                          _mm256_cvtepi32_epi64(_mm256_extracti128_si256(v, 1)));
    const __m128i half = _mm_add_epi64(_mm256_castsi256_si128(wide), _mm256_extracti128_si256(wide, 1));
    return _mm_cvtsi128_si64(half) + _mm_extract_epi64(half, 1);
}

template <int R, int MB>
inline void linear_block_i16(const int16_t *x, long ldx, const int8_t *w, long K, long pf, float *acc_out,
                             const int8_t *ahead, long ahead_step) {
    for (int i = 0; i < R * MB; i++) acc_out[i] = 0.0f;
    const bool spread = ahead != nullptr;
    const long body = K / 16 * 16;
    for (long k0 = 0; k0 < body; k0 += I16_KB) {
        const long k1 = body - k0 < I16_KB ? body : k0 + I16_KB;
        __m256i acc[MB][R];
        for (int m = 0; m < MB; m++)
            for (int r = 0; r < R; r++) acc[m][r] = _mm256_setzero_si256();
        for (long k = k0; k < k1; k += 16) {
            __m256i wv[R];
            if (spread) {
                prefetch_weight(ahead);
                ahead += ahead_step;
            }
            for (int r = 0; r < R; r++) {
                if (!spread) prefetch_weight(w + R * k + r * 16 + pf);
                wv[r] = widen_i16(w + r * K + k);
            }
            for (int m = 0; m < MB; m++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(x + m * ldx + k));
                for (int r = 0; r < R; r++) acc[m][r] = _mm256_add_epi32(acc[m][r], _mm256_madd_epi16(wv[r], xv));
            }
        }
        for (int m = 0; m < MB; m++)
            for (int r = 0; r < R; r++) acc_out[m * R + r] += (float)sum_lanes_exactly(acc[m][r]);
    }
    for (long j = body; j < K; j++)
        for (int m = 0; m < MB; m++)
            for (int r = 0; r < R; r++) acc_out[m * R + r] += (float)(x[m * ldx + j] * w[r * K + j]);
}

// x's M rows as int16, row m to its own step s[m] = max |x[m]| / 32767 (round to nearest; 0 for a row of
// zeros). An element's error is at most s / 2: no more than bf16's bound on rounding it (2^-8 of it) for any
// element over 1/256 of its row's largest.
inline void quantize_rows_i16(const float *x, long ldx, long M, long K, int16_t *q, long ldq, float *s) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (long m = 0; m < M; m++) {
        const float *row = x + m * ldx;
        int16_t *out = q + m * ldq;
        __m256 top = _mm256_setzero_ps();
        long k = 0;
        for (; k + 8 <= K; k += 8) top = _mm256_max_ps(top, _mm256_and_ps(_mm256_loadu_ps(row + k), magnitude));
        float largest = Vec::hmax(top);
        for (long j = k; j < K; j++) largest = std::max(largest, fabsf(row[j]));
        s[m] = largest / I16_MAX;
        const float inverse = largest > 0.0f ? I16_MAX / largest : 0.0f;
        const __m256 scale = _mm256_set1_ps(inverse);
        for (k = 0; k + 8 <= K; k += 8) {
            const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(row + k), scale));
            _mm_storeu_si128((__m128i *)(out + k), _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
        }
        for (; k < K; k++) out[k] = (int16_t)std::clamp(lrintf(row[k] * inverse), -32767L, 32767L);
    }
}
#endif

// TX: the activations' type (and the output's, but int16 rows, whose products are float32), TW: the weight's.
// bf16 weights against float32 activations are widened as they are loaded (a float32 model whose weights are
// kept in bf16).
template <class TX, class TW, int R, int MB>
inline void linear_tile(const TX *x, long ldx, const TW *w, long K, long pf, float *acc, const TW *ahead = nullptr,
                        long ahead_step = 0) {
#if defined(LLK_AVX2)
    if constexpr (std::is_same_v<TX, int16_t>) linear_block_i16<R, MB>(x, ldx, w, K, pf, acc, ahead, ahead_step);
    else
#elif defined(LLK_AVX512BF16)
    if constexpr (sizeof(TX) == 2 && sizeof(TW) <= 2) linear_block_dp<TW, R, MB>(x, ldx, w, K, pf, acc);
    else
#endif
        linear_block<TX, TW, R, MB>(x, ldx, w, K, pf, acc, ahead, ahead_step);
}

// A tile of the last mb < MB rows of x, in one pass over the block of w: taken one row at a time,
// they cost a pass each, which on the AVX2 class (bf16 weights widened as they load) made a step
// of 3 rows slower than one of 4, and 7 slower than 8.
template <class TX, class TW, int R, int MB>
inline void linear_tile_rows(long mb, const TX *x, long ldx, const TW *w, long K, long pf, float *acc,
                             const TW *ahead, long ahead_step) {
    if constexpr (MB == 1) {
        linear_tile<TX, TW, R, 1>(x, ldx, w, K, pf, acc, ahead, ahead_step);
    } else {
        if (mb == MB) linear_tile<TX, TW, R, MB>(x, ldx, w, K, pf, acc, ahead, ahead_step);
        else linear_tile_rows<TX, TW, R, MB - 1>(mb, x, ldx, w, K, pf, acc, ahead, ahead_step);
    }
}

// With more rows of x than one tile takes, a block of w is read from memory by the first tile
// and from cache by the others, so a prefetch pf ahead of the first ran while memory was busy
// and none ran while the others computed. On the AVX2 build each of a block's tiles prefetches
// its share of the next block instead, one step per vector of w's rows: one pass over the bench model's bf16 weights
// at 8 rows (Zen 3 EPYC, 2 threads, 4 alternated rounds of 4) 1.07-1.11x faster (17.0 -> 15.3 ms
// best), at 16 rows 1.14x; not measured on the AVX-512 builds, which keep the one prefetch.
#if defined(LLK_AVX2)
static constexpr bool SPREAD_PREFETCH = true;
#else
static constexpr bool SPREAD_PREFETCH = false;
#endif

// x_scales: each row's int16 step (int16 rows), or none.
template <class TX, class TW, int R, int MB, class TY = TX>
void linear_rows(const TX *x, long ldx, const TW *w, TY *y, long ldy, long M, long K, long n0, long n1, long pf,
                 const float *scales, const float *x_scales = nullptr) {
    float acc[MB * R];
    const long groups = (M + MB - 1) / MB;
    const bool spread = SPREAD_PREFETCH && groups > 1;
    constexpr long STEP = std::is_same_v<TX, int16_t> ? 16 : Vec::N;  // k a tile takes at a time
    const long ahead_step = spread ? (R * STEP / groups > 0 ? R * STEP / groups : 1) : 0;
    long n = n0;
    for (; n + R <= n1; n += R) {
        for (long m = 0; m < M; m += MB) {
            long mb = M - m < MB ? M - m : MB;
            const TW *ahead = spread ? w + (n + R) * K + (m / MB) * (R * K / groups) : nullptr;
            linear_tile_rows<TX, TW, R, MB>(mb, x + m * ldx, ldx, w + n * K, K, pf, acc, ahead, ahead_step);
            for (long i = 0; i < mb; i++) {
                const float row_scale = x_scales ? x_scales[m + i] : 1.0f;
                for (int r = 0; r < R; r++)
                    store_scalar(y + (m + i) * ldy + n + r, scaled(acc[i * R + r], scales, n + r) * row_scale);
            }
        }
    }
    for (; n < n1; n++)
        for (long m = 0; m < M; m++) {
            linear_tile<TX, TW, 1, 1>(x + m * ldx, ldx, w + n * K, K, pf, acc);
            store_scalar(y + m * ldy + n, scaled(acc[0], scales, n) * (x_scales ? x_scales[m] : 1.0f));
        }
}

// How far ahead of its reads (bytes) linear() prefetches w, for one row of x and for several, and
// the rows of w a thread takes at a time. One pass over the bench model's bf16 weights for one row
// (Zen 5 EPYC, 2 threads, alternated within one process, x.sum at 40-49 GB/s): 64 KB chunks and 1 KB
// ahead streamed 39-43 GB/s, 256 KB and 4 KB 41-45, 256 KB and 1 KB 36-39, 256 KB and 8 KB 42-44;
// eight rows 30.5 against 32.1 GB/s (oneDNN packed 30.5). On a Zen 3 EPYC (AVX2, x.sum at 28 GB/s)
// one row ran 1 KB ahead faster in each of 8 alternated rounds, by 15-25% (best 7.9 against 10.6
// ms, bf16 weights under float32), and several rows ran 1-2 KB ahead 5-20% slower than 4 KB. So
// the one-row distance is the caller's (the Python side measures it at load; 0: this default).
// Several rows prefetch a number of weights ahead, not of bytes (each weight costs them the same
// time whatever its type), and into L2 only (prefetch_weight): a block of w is read from memory by its
// first tile and from cache by the others. Into L1, the product cost about its streaming time plus
// its arithmetic (our reading: the lines ahead held L1's few fill buffers and crowded the tiles'
// operands); into L2 the two overlap, and the tiles' loads find the block one level down. One pass over
// the bench model's weights (Zen 4 EPYC, 2 threads, 10 alternated rounds, best), 4096 weights ahead
// into L2 against 2048 into L1: float32 on the avx512bf16 build 15.4 / 16.0 / 23.2 ms against 16.8 /
// 22.3 / 29.9 at 4 / 8 / 16 rows (oneDNN packed: 17.6 / 20.2 / 25.4); bf16 7.6 / 7.7 / 8.1 / 13.5
// against 8.8 / 9.0 / 10.1 / 15.4 at 2 / 4 / 8 / 16 (oneDNN 12.1 / 10.6 / 11.8 / 14.7); float32 on the
// avx2 build 14.6 / 15.3 / 21.9 against 16.2 / 24.1 / 25.5 at 4 / 8 / 16. Whole decode steps of the
// bench model (`python -m scripts.bench.decode_profile --batches 1,4,8,16`): bf16 1.05x / 1.15x / 1.10x
// and float32 1.05x / 1.27x / 1.18x faster at 4 / 8 / 16 rows. (Before, 4 KB into L1 against 8 KB:
// float32 8 KB ahead ran 1.07-1.2x faster at 2-16 rows, bf16 no faster.) One row, into L2 against
// L1, each build at its default distance (no load-time tuning): bf16 weights under float32 7.3 against
// 10.3 ms on the avx512 build, 6.2 against 10.7 on the avx512bf16 build, 5.8 against 6.2 on the avx2
// build; float32 8.8 against 9.7 on the avx512 build, even on avx2; whole one-row decode steps (its
// distance tuned at load): bf16 1.11x and 1.20x faster in two runs, float32 1.02-1.05x.
#if !defined(LLK_ROWS_WEIGHTS)
#define LLK_ROWS_WEIGHTS 4096
#endif
static const long PREFETCH_ONE_ROW = 4096, PREFETCH_ROWS_WEIGHTS = LLK_ROWS_WEIGHTS;
static const long CHUNK_BYTES = 256 << 10;
// A tile of a product of several rows: TILE_W rows of w against TILE_X rows of x, in TILE_W x TILE_X
// accumulators beside TILE_W vectors of w and one of x. AVX-512's 32 registers hold 4 x 4; AVX2's 16
// hold 3 x 4, each vector of w (widened once where it is bf16) feeding 4 multiply-adds. One pass over
// the bench model's linears on a Zen 3 EPYC (2 threads, best of 8 alternated), bf16 weights under
// float32: 3 x 4 against 2 x 4 18.0 against 20.3 ms at 8 rows, 26.3 / 31.2 at 12, 45.9 / 56.8 at 24,
// even at 2 and 4 rows; float32 weights even at 2 to 8 rows, 34.5 / 37.5 at 12, 56.9 / 64.8 at 24.
// 1 x 8, 2 x 6, 4 x 2, 4 x 3 and 5 x 2 were slower at 8 rows (23.1, 21.1, 25.9, 24.6, 25.6 ms).
// (Earlier, on a Zen 5 EPYC computing as an AVX2 CPU, 2 x 4 had beaten 4 x 2 by 15-20%.)
// -DLLK_TILE_W=.. -DLLK_TILE_X=.. builds another tile for such an A/B.
#if defined(LLK_TILE_W)
static constexpr int TILE_W = LLK_TILE_W, TILE_X = LLK_TILE_X;
#elif defined(LLK_VEC512)
static constexpr int TILE_W = 4, TILE_X = 4;
#else
static constexpr int TILE_W = 3, TILE_X = 4;
#endif
// The tile for TX activations against TW weights. On the avx512bf16 build bf16 activations take the dot-product
// tiles (linear_block_dp), 3 x 8: each vector of x then feeds three dot products, and each vector of an int8
// weight, widened to bf16 in five instructions, feeds eight. The bench model's linears on a Zen 4 EPYC (2 threads,
// medians of 20 alternated passes) against 4 x 4: int8 weights 1.19x faster at 8 rows (2 x 8: 1.18x; 4 x 6 ran
// 1.19x slower than 3 x 8), even at 4; bf16 weights 1.05x at 8 rows, 1.08x at 16, even at 4.
#if !defined(LLK_DP_TILE_W)
#define LLK_DP_TILE_W 3
#define LLK_DP_TILE_X 8
#endif
template <class TX, class TW>
struct Tile {
    static constexpr int W = TILE_W, X = TILE_X;
};
#if defined(LLK_AVX512BF16)
template <class TW>
struct Tile<bf16, TW> {
    static constexpr int W = LLK_DP_TILE_W, X = LLK_DP_TILE_X;
};
#endif
// int16 rows over int8 weights (the avx2 build): vpmaddwd writes a register of its own before the add, so 3 x 4
// (12 accumulators, 3 vectors of w, one of x and that one) spilled accumulators to the stack.
#if !defined(LLK_I16_TILE_W)
#define LLK_I16_TILE_W 2
#define LLK_I16_TILE_X 4
#endif
template <>
struct Tile<int16_t, int8_t> {
    static constexpr int W = LLK_I16_TILE_W, X = LLK_I16_TILE_X;
};

// ---------------------------------------------------------------------------------------------
// gemm: the same product for the many rows of a prompt, float32 arithmetic (the AVX2 build's linear;
// its tile, on 256-bit registers, is every build's prompt attention, below).
//
// The tiles above take w and x both along K (a dot product per pair of rows): each vector of x
// they load feeds TILE_W multiply-adds, so a prompt's rows stream x from L2 at about the rate
// L2 gives, and the products ran at ~100 GFLOP/s on a Zen 3 EPYC whatever the row count.
// Here, as in BLIS, w is widened and laid out K-major a panel of GEMM_NR of its rows at a time
// (GEMM_KC of K, in L1), x is laid out K-major GEMM_MR rows at a time (once per call, for every
// thread), and a tile of GEMM_MR rows multiplies the panel by broadcasting one element of each
// row per k: GEMM_MR x 2 accumulators, two loads of the panel (from L1) and GEMM_MR broadcasts of
// 4 bytes from one sequential stream (L2, x taken GEMM_MC rows at a time) per 2 GEMM_MR
// multiply-adds. Each thread takes GEMM_COLS columns of y at a time. The bench model's 48
// products on the Zen 3 (bf16 weights, 2 threads, best of 4): 404-456 ms at 256 rows against
// 543-565 with the tiles, 1254-1287 at 768 against 1564-1674. Packing x as well and unrolling
// the tile's k loop took one layer's four products 1.15x faster at 256 rows (medians of 20
// alternated passes; 31.9 against 39.1 ms best), 1.12x at 768 and 1.17x at 64, ~150-180 GFLOP/s
// where two cores' multiply-adds alone reach ~185 (1.9x a core's 98). At 48 rows that GEMM
// was 1.08-1.13x faster than the tiles, at 40 even, below slower (packing w costs the same
// whatever the rows): GEMM_MIN_ROWS.

// An allocator of 64-byte-aligned floats, for the panels the tiles load with aligned loads.
template <class T>
struct AlignedAlloc {
    using value_type = T;
    AlignedAlloc() = default;
    template <class U> AlignedAlloc(const AlignedAlloc<U> &) {}
    T *allocate(size_t n) { return static_cast<T *>(::operator new(n * sizeof(T), std::align_val_t(64))); }
    void deallocate(T *p, size_t) { ::operator delete(p, std::align_val_t(64)); }
    template <class U> bool operator==(const AlignedAlloc<U> &) const { return true; }
};

// n values of T, 64-byte aligned and not initialised, freed with the object.
template <class T>
class AlignedBuffer {
  public:
    explicit AlignedBuffer(size_t n) : data_(AlignedAlloc<T>().allocate(n)) {}
    ~AlignedBuffer() { AlignedAlloc<T>().deallocate(data_, 0); }
    AlignedBuffer(const AlignedBuffer &) = delete;
    AlignedBuffer &operator=(const AlignedBuffer &) = delete;
    T *data() const { return data_; }

  private:
    T *data_;
};

static constexpr int GEMM_MR = 6, GEMM_NR = 16;
// The vector GEMMs (gemm, gemm512) take a prompt's rows GEMM_ROWS at a time (a multiple of both builds' tile
// rows, so a row's sums do not change). A Llama-2-7B-shaped down projection (K 11008, 4096 outputs) on 768
// rows of an AMX Xeon (family 6 model 167, 2 threads, computing as each class): the avx2 build 152 GFLOP/s in
// one block, 185 / 194 / 186 in blocks of 384 / 264 / 132; the avx512 build 277, 314 / 309 / 279; at 256 rows
// both ran at their 768-in-blocks speed (our reading, not measured apart: a K block's pass over fewer rows
// touches fewer pages and lines of x and y).
static constexpr long GEMM_ROWS = 264;
static constexpr long GEMM_KC = 256, GEMM_MC = 96, GEMM_COLS = 64;
// Floats from one micro-panel of x to the next: GEMM_KC rows and room for pack_rows' spare lanes, 64-byte aligned.
static constexpr long GEMM_A_STRIDE = GEMM_KC * GEMM_MR + 16;
#if defined(LLK_GEMM_MIN_ROWS)
static constexpr long GEMM_MIN_ROWS = LLK_GEMM_MIN_ROWS;
#else
static constexpr long GEMM_MIN_ROWS = 48;
#endif

inline void transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

// Eight elements as float32 in one 256-bit register, in every build (the tile's width).
inline __m256 load8(const float *p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16 *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
inline __m256 load8(const int8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))); }

// panel[k * GEMM_NR + j] = w[j][k0 + k] for the GEMM_NR rows of w at w, k < kc, as float32.
template <class TW>
inline void pack_panel(const TW *w, long K, long k0, long kc, float *panel) {
    long k = 0;
    for (; k + 8 <= kc; k += 8)
        for (int g = 0; g < GEMM_NR; g += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; i++) r[i] = load8(w + (g + i) * K + k0 + k);
            transpose8(r);
            for (int i = 0; i < 8; i++) _mm256_storeu_ps(panel + (k + i) * GEMM_NR + g, r[i]);
        }
    for (; k < kc; k++)
        for (int j = 0; j < GEMM_NR; j++) panel[k * GEMM_NR + j] = to_f32(w[j * K + k0 + k]);
}

// y[i][0:GEMM_NR] (+)= sum over k < kc of a[k * GEMM_MR + i] * panel[k][:], i < GEMM_MR.
// The twelve accumulators are named, not an array, and the loop is unrolled by hand: with an
// array and an unroll pragma, GCC kept a copy of the accumulators on the stack, stored every step,
// and the products ran at half the speed.
inline void gemm_tile(long kc, const float *a, const float *panel, float *y, long ldy, bool first) {
    static_assert(GEMM_MR == 6 && GEMM_NR == 16, "gemm_tile is written out for 6 x 16 tiles");
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00,
           c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
#define GEMM_STEP(k)                                                                                   \
    {                                                                                                  \
        const __m256 b0 = _mm256_load_ps(panel + (k) * 16), b1 = _mm256_load_ps(panel + (k) * 16 + 8); \
        __m256 av = _mm256_broadcast_ss(a + (k) * 6);                                                  \
        c00 = _mm256_fmadd_ps(av, b0, c00), c01 = _mm256_fmadd_ps(av, b1, c01);                        \
        av = _mm256_broadcast_ss(a + (k) * 6 + 1);                                                     \
        c10 = _mm256_fmadd_ps(av, b0, c10), c11 = _mm256_fmadd_ps(av, b1, c11);                        \
        av = _mm256_broadcast_ss(a + (k) * 6 + 2);                                                     \
        c20 = _mm256_fmadd_ps(av, b0, c20), c21 = _mm256_fmadd_ps(av, b1, c21);                        \
        av = _mm256_broadcast_ss(a + (k) * 6 + 3);                                                     \
        c30 = _mm256_fmadd_ps(av, b0, c30), c31 = _mm256_fmadd_ps(av, b1, c31);                        \
        av = _mm256_broadcast_ss(a + (k) * 6 + 4);                                                     \
        c40 = _mm256_fmadd_ps(av, b0, c40), c41 = _mm256_fmadd_ps(av, b1, c41);                        \
        av = _mm256_broadcast_ss(a + (k) * 6 + 5);                                                     \
        c50 = _mm256_fmadd_ps(av, b0, c50), c51 = _mm256_fmadd_ps(av, b1, c51);                        \
    }
    long k = 0;
    for (; k + 4 <= kc; k += 4) {
        GEMM_STEP(k)
        GEMM_STEP(k + 1)
        GEMM_STEP(k + 2)
        GEMM_STEP(k + 3)
    }
    for (; k < kc; k++) GEMM_STEP(k)
#undef GEMM_STEP
    const __m256 acc[GEMM_MR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
    for (int i = 0; i < GEMM_MR; i++) {
        float *out = y + i * ldy;
        __m256 r0 = acc[i][0], r1 = acc[i][1];
        if (!first) {
            r0 = _mm256_add_ps(r0, _mm256_loadu_ps(out));
            r1 = _mm256_add_ps(r1, _mm256_loadu_ps(out + 8));
        }
        _mm256_storeu_ps(out, r0);
        _mm256_storeu_ps(out + 8, r1);
    }
}

// The same for the first mr < GEMM_MR rows (the micro-panel's others are zeros), through a tile on the stack.
inline void gemm_tile_part(long mr, long kc, const float *a, const float *panel, float *y, long ldy, bool first) {
    alignas(64) float tile[GEMM_MR * GEMM_NR];
    gemm_tile(kc, a, panel, tile, GEMM_NR, true);
    for (long i = 0; i < mr; i++)
        for (int j = 0; j < GEMM_NR; j++) y[i * ldy + j] = first ? tile[i * GEMM_NR + j] : y[i * ldy + j] + tile[i * GEMM_NR + j];
}

// Rows [g * GEMM_MR, +GEMM_MR) of x, columns [k0, k0 + kc), as a micro-panel: out[k * GEMM_MR + i] =
// x[g * GEMM_MR + i][k0 + k], zero for rows past M. Eight k at a time go through an 8x8 transpose
// whose columns (6 values and 2 zeros) are stored 6 floats apart, each store overwriting the last
// one's 2 spare lanes: out needs 2 floats of room past kc * GEMM_MR.
template <class TX>
inline void pack_rows(const TX *x, long ldx, long M, long k0, long kc, long g, float *out) {
    const long row0 = g * GEMM_MR;
    long k = 0;
    for (; k + 8 <= kc; k += 8) {
        __m256 r[8];
        for (int i = 0; i < 8; i++)
            r[i] = i < GEMM_MR && row0 + i < M ? load8(x + (row0 + i) * ldx + k0 + k) : _mm256_setzero_ps();
        transpose8(r);
        for (int j = 0; j < 8; j++) _mm256_storeu_ps(out + (k + j) * GEMM_MR, r[j]);
    }
    for (; k < kc; k++)
        for (int i = 0; i < GEMM_MR; i++) out[k * GEMM_MR + i] = row0 + i < M ? to_f32(x[(row0 + i) * ldx + k0 + k]) : 0.0f;
}

#if defined(LLK_AVX2)

// The GEMM for int16 rows over int8 weights (see quantize_rows_i16), its blocking the float GEMM's: each
// element of a micro-panel or panel is a pair of int16 along K, (k, k + 1) in one 32-bit lane, so that one
// broadcast of a row's pair and vpmaddwd against a panel's 8 outputs take 16 products. A K block's 128 pairs
// sum exactly in int32 (128 * 2 * 32767 * 127 < 2^31) before they add to y in float32. Micro-panels of GEMM_MR rows.

inline int32_t pair_i16(int16_t first, int16_t second) {
    int32_t both;
    const int16_t two[2] = {first, second};
    memcpy(&both, two, sizeof both);
    return both;
}

// Rows [g * GEMM_MR, +GEMM_MR) of q, K's [k0, k0 + kc) as out[p * GEMM_MR + i] = (q[i][k0 + 2p], q[i][k0 + 2p + 1]),
// zero past M and past kc.
inline void pack_rows_i16(const int16_t *q, long ldq, long M, long k0, long kc, long g, int32_t *out) {
    for (int i = 0; i < GEMM_MR; i++) {
        const long row = g * GEMM_MR + i;
        const int16_t *src = q + row * ldq + k0;
        for (long k = 0; k < kc; k += 2)
            out[k / 2 * GEMM_MR + i] = row < M ? pair_i16(src[k], k + 1 < kc ? src[k + 1] : 0) : 0;
    }
}

// panel[p * GEMM_NR + j] = (w[j][k0 + 2p], w[j][k0 + 2p + 1]) as int16 for the GEMM_NR rows of w at w, zero past kc:
// 16 weights of a row widened in one instruction are 8 pairs, and eight rows of them one 8 x 8 transpose.
inline void pack_panel_i16(const int8_t *w, long K, long k0, long kc, int32_t *panel) {
    long k = 0;
    for (; k + 16 <= kc; k += 16)
        for (int g = 0; g < GEMM_NR; g += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; i++) r[i] = _mm256_castsi256_ps(widen_i16(w + (g + i) * K + k0 + k));
            transpose8(r);
            for (int i = 0; i < 8; i++) _mm256_store_si256((__m256i *)(panel + (k / 2 + i) * GEMM_NR + g), _mm256_castps_si256(r[i]));
        }
    for (; k < kc; k += 2)
        for (int j = 0; j < GEMM_NR; j++) panel[k / 2 * GEMM_NR + j] = pair_i16(w[j * K + k0 + k], k + 1 < kc ? w[j * K + k0 + k + 1] : 0);
}

// y[i][0:GEMM_NR] (+)= the products over `pairs` pairs of a's micro-panel and the panel, for rows i < mr. Written
// out, as gemm_tile is: over arrays, GCC moved or spilled the accumulators every step.
inline void gemm_tile_i16(long pairs, const int32_t *a, const int32_t *panel, float *y, long ldy, bool first, long mr) {
    static_assert(GEMM_MR == 6, "gemm_tile_i16 is written out for 6 rows");
    __m256i c00 = _mm256_setzero_si256(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00,
            c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
#define I16_ROW(i, lo, hi)                                                                                 \
    {                                                                                                     \
        __m256i av, t;                                                                                    \
        __asm__("vpbroadcastd %[x], %[av]\n\tvpmaddwd %[b0], %[av], %[t]\n\tvpaddd %[t], %[c0], %[c0]\n\t" \
                "vpmaddwd %[b1], %[av], %[t]\n\tvpaddd %[t], %[c1], %[c1]"                                 \
                : [c0] "+x"(lo), [c1] "+x"(hi), [av] "=&x"(av), [t] "=&x"(t)                               \
                : [x] "m"(a[p * 6 + (i)]), [b0] "x"(b0), [b1] "x"(b1));                                   \
    }
    for (long p = 0; p < pairs; p++) {
        const __m256i b0 = _mm256_load_si256((const __m256i *)(panel + p * GEMM_NR));
        const __m256i b1 = _mm256_load_si256((const __m256i *)(panel + p * GEMM_NR + 8));
        I16_ROW(0, c00, c01)
        I16_ROW(1, c10, c11)
        I16_ROW(2, c20, c21)
        I16_ROW(3, c30, c31)
        I16_ROW(4, c40, c41)
        I16_ROW(5, c50, c51)
    }
#undef I16_ROW
    const __m256i acc[6][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
    for (long i = 0; i < mr; i++) {
        float *out = y + i * ldy;
        for (int h = 0; h < 2; h++) {
            __m256 sum = _mm256_cvtepi32_ps(acc[i][h]);
            if (!first) sum = _mm256_add_ps(sum, _mm256_loadu_ps(out + 8 * h));
            _mm256_storeu_ps(out + 8 * h, sum);
        }
    }
}


// The two element types a GEMM packs x and w into: a policy for gemm_columns and gemm_rows.
struct FloatPanels {  // float32, each weight widened as its panel is packed
    using Packed = float;
    static constexpr long PANEL = GEMM_KC * GEMM_NR, A_STRIDE = GEMM_A_STRIDE;
    template <class TX>
    static void pack_x(const TX *x, long ldx, long M, long k0, long kc, long g, float *out) {
        pack_rows(x, ldx, M, k0, kc, g, out);
    }
    template <class TW>
    static void pack_w(const TW *w, long K, long k0, long kc, float *panel) {
        pack_panel(w, K, k0, kc, panel);
    }
    static void tile(long kc, const float *a, const float *panel, float *y, long ldy, bool first, long mr) {
        if (mr == GEMM_MR) gemm_tile(kc, a, panel, y, ldy, first);
        else gemm_tile_part(mr, kc, a, panel, y, ldy, first);
    }
};
struct Int16Pairs {  // int16 rows over int8 weights, pairs along K
    using Packed = int32_t;
    static constexpr long PANEL = GEMM_KC / 2 * GEMM_NR, A_STRIDE = GEMM_KC / 2 * GEMM_MR;
    static void pack_x(const int16_t *q, long ldq, long M, long k0, long kc, long g, int32_t *out) {
        pack_rows_i16(q, ldq, M, k0, kc, g, out);
    }
    static void pack_w(const int8_t *w, long K, long k0, long kc, int32_t *panel) { pack_panel_i16(w, K, k0, kc, panel); }
    static void tile(long kc, const int32_t *a, const int32_t *panel, float *y, long ldy, bool first, long mr) {
        gemm_tile_i16((kc + 1) / 2, a, panel, y, ldy, first, mr);
    }
};

// Columns [n0, n1) of y (a multiple of GEMM_NR of them) for all M rows, from a: x packed by G::pack_x, the
// micro-panel of K's block b and rows group g at (b * groups + g) * G::A_STRIDE; then each output times its
// weight row's scale and its x row's step, where there are any.
template <class G, class TW>
void gemm_columns(const typename G::Packed *a, const TW *w, const float *scales, const float *steps, float *y,
                  long ldy, long M, long K, long n0, long n1) {
    thread_local std::vector<typename G::Packed, AlignedAlloc<typename G::Packed>> packed;
    const long panels = (n1 - n0) / GEMM_NR, groups = (M + GEMM_MR - 1) / GEMM_MR;
    packed.resize((size_t)(panels * G::PANEL));
    for (long k0 = 0, b = 0; k0 < K; k0 += GEMM_KC, b++) {
        const long kc = K - k0 < GEMM_KC ? K - k0 : GEMM_KC;
        for (long p = 0; p < panels; p++) G::pack_w(w + (n0 + p * GEMM_NR) * K, K, k0, kc, packed.data() + p * G::PANEL);
        for (long g0 = 0; g0 < groups; g0 += GEMM_MC / GEMM_MR) {
            const long g1 = groups - g0 < GEMM_MC / GEMM_MR ? groups : g0 + GEMM_MC / GEMM_MR;
            for (long p = 0; p < panels; p++)
                for (long g = g0; g < g1; g++) {
                    const long m = g * GEMM_MR;
                    G::tile(kc, a + (b * groups + g) * G::A_STRIDE, packed.data() + p * G::PANEL,
                            y + m * ldy + n0 + p * GEMM_NR, ldy, k0 == 0, M - m < GEMM_MR ? M - m : GEMM_MR);
                }
        }
    }
    if (scales || steps)
        for (long m = 0; m < M; m++) {
            const __m256 step = _mm256_set1_ps(steps ? steps[m] : 1.0f);
            for (long n = n0; n < n1; n += 8) {
                float *out = y + m * ldy + n;
                const __m256 scale = scales ? _mm256_mul_ps(_mm256_loadu_ps(scales + n), step) : step;
                _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_loadu_ps(out), scale));
            }
        }
}

// y = x @ w^T for rows [0, M) of x, whatever their number, GEMM_ROWS or fewer; steps: each row's int16 step
// (Int16Pairs), or none.
template <class G, class TX, class TW>
void gemm_rows(const TX *x, long ldx, const float *steps, const TW *w, float *y, long ldy, long M, long K, long N,
               int threads) {
    const float *scales = row_scales(w, N, K);
    const long groups = (M + GEMM_MR - 1) / GEMM_MR, blocks = (K + GEMM_KC - 1) / GEMM_KC;
    // x once as micro-panels, for every thread's columns; as big as x, so allocated per call, not
    // kept (a thread_local named inside the lambdas would be each helper's own, not this one)
    AlignedBuffer<typename G::Packed> x_panels((size_t)(blocks * groups * G::A_STRIDE));
    typename G::Packed *a = x_panels.data();
    pool().run(groups, threads, [&](long g) {
        for (long k0 = 0, b = 0; k0 < K; k0 += GEMM_KC, b++)
            G::pack_x(x, ldx, M, k0, K - k0 < GEMM_KC ? K - k0 : GEMM_KC, g, a + (b * groups + g) * G::A_STRIDE);
    });
    const long chunks = (N + GEMM_COLS - 1) / GEMM_COLS;
    pool().run(chunks, threads, [&](long c) {
        const long n0 = c * GEMM_COLS, n1 = n0 + GEMM_COLS < N ? n0 + GEMM_COLS : N;
        gemm_columns<G>(a, w, scales, steps, y, ldy, M, K, n0, n1);
    });
}

// True when it took the product: float32 activations, enough rows, whole panels of columns.
template <class TX, class TW>
bool gemm(const TX *x, long ldx, const TW *w, TX *y, long ldy, long M, long K, long N, int threads) {
    if constexpr (!std::is_same_v<TX, float>) {
        return false;
    } else {
        if (M < GEMM_MIN_ROWS || N % GEMM_NR != 0) return false;
        for (long m0 = 0; m0 < M; m0 += GEMM_ROWS)
            gemm_rows<FloatPanels>(x + m0 * ldx, ldx, nullptr, w, y + m0 * ldy, ldy, M - m0 < GEMM_ROWS ? M - m0 : GEMM_ROWS, K, N, threads);
        return true;
    }
}

#endif

#if defined(LLK_VEC512)
// gemm512: the AVX-512 builds' product of many rows, float32 arithmetic over float32 or bf16 weights (a
// bf16 weight is widened as its panel is packed, so there is one copy of it). The tiles above reduce each
// output across the lanes of its own accumulator, which suits a few rows and not many: at 32 rows over
// the bench model's bf16 weights they ran at ~110 GFLOP/s on an Emerald Rapids Xeon (2 vCPUs), and a
// prompt's rows went to oneDNN over a float32 copy of the weight made for each call. Here, as in the AVX2
// build's gemm and in BLIS, every lane of an accumulator is its own output: w is widened and laid out
// K-major G5_NR of its rows at a time (G5_KC of K), x G5_MR rows at a time, and a tile of G5_MR rows
// multiplies the panel by broadcasting one element of each row per k: G5_MR x 2 accumulators, two loads
// of the panel and G5_MR broadcasts per 2 G5_MR multiply-adds. Sums stay in float32 over the blocks of K
// and are rounded once to y's dtype.
// (AVX512_BF16's dot product in the same layout ran no faster than the tiles on that Xeon.)
static constexpr int G5_MR = 12, G5_NR = 32;
static constexpr long G5_KC = 256, G5_COLS = 64;
#if defined(LLK_G5_MIN_ROWS)
static constexpr long G5_MIN_ROWS = LLK_G5_MIN_ROWS;
#else
static constexpr long G5_MIN_ROWS = 40;
#endif

inline __m512 load16(const float *p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16 *p) { return Vec::load(p); }
inline __m512 load16(const int8_t *p) { return Vec::load(p); }

// The 16 x 16 floats at rows[r] + c (r < 16), transposed: sink(j, v) takes v = column c + j of the 16 rows.
template <class T, class Sink>
inline void transpose16(const T *const *rows, long c, Sink &&sink) {
    __m512i a[16], b[16];
    for (int r = 0; r < 16; r++) a[r] = _mm512_castps_si512(load16(rows[r] + c));
    for (int r = 0; r < 16; r += 2) {
        b[r] = _mm512_unpacklo_epi32(a[r], a[r + 1]);
        b[r + 1] = _mm512_unpackhi_epi32(a[r], a[r + 1]);
    }
    for (int r = 0; r < 16; r += 4) {  // a[r + e], 128-bit lane L: column 4L + e of rows r..r+3
        a[r] = _mm512_unpacklo_epi64(b[r], b[r + 2]);
        a[r + 1] = _mm512_unpackhi_epi64(b[r], b[r + 2]);
        a[r + 2] = _mm512_unpacklo_epi64(b[r + 1], b[r + 3]);
        a[r + 3] = _mm512_unpackhi_epi64(b[r + 1], b[r + 3]);
    }
    for (int e = 0; e < 4; e++) {
        __m512i d0 = _mm512_shuffle_i32x4(a[e], a[4 + e], 0x88), d1 = _mm512_shuffle_i32x4(a[e], a[4 + e], 0xdd);
        __m512i d2 = _mm512_shuffle_i32x4(a[8 + e], a[12 + e], 0x88), d3 = _mm512_shuffle_i32x4(a[8 + e], a[12 + e], 0xdd);
        sink(0 + e, _mm512_castsi512_ps(_mm512_shuffle_i32x4(d0, d2, 0x88)));
        sink(8 + e, _mm512_castsi512_ps(_mm512_shuffle_i32x4(d0, d2, 0xdd)));
        sink(4 + e, _mm512_castsi512_ps(_mm512_shuffle_i32x4(d1, d3, 0x88)));
        sink(12 + e, _mm512_castsi512_ps(_mm512_shuffle_i32x4(d1, d3, 0xdd)));
    }
}

// panel[k * G5_NR + j] = w[j][k0 + k] for the G5_NR rows of w at w, k < kc, as float32.
template <class TW>
inline void pack_panel512(const TW *w, long K, long k0, long kc, float *panel) {
    for (int half = 0; half < G5_NR; half += 16) {
        const TW *rows[16];
        for (int r = 0; r < 16; r++) rows[r] = w + (half + r) * K + k0;
        long k = 0;
        for (; k + 16 <= kc; k += 16)
            transpose16(rows, k, [&](int j, __m512 v) { _mm512_storeu_ps(panel + (k + j) * G5_NR + half, v); });
        for (; k < kc; k++)
            for (int r = 0; r < 16; r++) panel[k * G5_NR + half + r] = to_f32(rows[r][k]);
    }
}

// Rows [r0, r0 + G5_MR) of x (zeros past M), columns [k0, k0 + kc), as a micro-panel: out[k * G5_MR + i] =
// x[r0 + i][k0 + k]. Sixteen k at a time go through a 16 x 16 transpose of whose rows G5_MR are stored.
template <class TX>
inline void pack_rows512(const TX *x, long ldx, long M, long r0, long k0, long kc, float *out) {
    static_assert(G5_MR <= 16, "pack_rows512 transposes 16 rows at a time");
    const TX *rows[16];
    for (int r = 0; r < 16; r++) rows[r] = x + (r < G5_MR && r0 + r < M ? r0 + r : r0) * ldx + k0;
    const __mmask16 lanes = (__mmask16)((1u << G5_MR) - 1);
    long k = 0;
    if (r0 + G5_MR <= M)
        for (; k + 16 <= kc; k += 16)
            transpose16(rows, k, [&](int j, __m512 v) { _mm512_mask_storeu_ps(out + (k + j) * G5_MR, lanes, v); });
    for (; k < kc; k++)
        for (int r = 0; r < G5_MR; r++) out[k * G5_MR + r] = r0 + r < M ? to_f32(rows[r][k]) : 0.0f;
}

// acc[i][0:G5_NR] (+)= sum over k < kc of a[k * G5_MR + i] * panel[k][:], i < G5_MR (acc rows lda apart).
inline void gemm512_tile(long kc, const float *a, const float *panel, float *acc, long lda, bool first) {
    __m512 c[G5_MR][2];
    for (int i = 0; i < G5_MR; i++) c[i][0] = c[i][1] = _mm512_setzero_ps();
    for (long k = 0; k < kc; k++) {
        const __m512 w0 = _mm512_loadu_ps(panel + k * G5_NR), w1 = _mm512_loadu_ps(panel + k * G5_NR + 16);
        const float *ak = a + k * G5_MR;
#pragma GCC unroll 16
        for (int i = 0; i < G5_MR; i++) {
            const __m512 xi = _mm512_set1_ps(ak[i]);
            c[i][0] = _mm512_fmadd_ps(xi, w0, c[i][0]);
            c[i][1] = _mm512_fmadd_ps(xi, w1, c[i][1]);
        }
    }
    for (int i = 0; i < G5_MR; i++)
        for (int h = 0; h < 2; h++) {
            float *p = acc + i * lda + 16 * h;
            _mm512_storeu_ps(p, first ? c[i][h] : _mm512_add_ps(_mm512_loadu_ps(p), c[i][h]));
        }
}

// True when it took the product: enough rows and whole panels of columns. x is packed once, for every
// thread; each thread takes G5_COLS columns of y at a time, packs their panels a block of K at a time
// (pack_w(first column, k0, kc, panel)) and keeps their sums in float32 (`acc`) until the last block.
// (Blocked BLIS-like instead, G5_KC x 256 columns of panels and 192 rows of x per work item, it ran 64 MiB
// of the bench model's weights 1.12-1.18x slower at 256 to 2,048 rows on an Emerald Rapids Xeon.)
// y = x @ w^T for rows [0, M) of x, whatever their number, GEMM_ROWS or fewer.
template <class TX, class PackW>
void gemm512_rows(const TX *x, long ldx, PackW &pack_w, TX *y, long ldy, long M, long K, long N, int threads,
                  const float *scales) {
    const long groups = (M + G5_MR - 1) / G5_MR, blocks = (K + G5_KC - 1) / G5_KC;
    const long stride = G5_KC * G5_MR;  // floats of one micro-panel (rows group g, K block b: (b * groups + g))
    AlignedBuffer<float> x_panels((size_t)(blocks * groups * stride));
    float *a = x_panels.data();
    pool().run(groups, threads, [&](long g) {
        for (long k0 = 0, b = 0; k0 < K; k0 += G5_KC, b++)
            pack_rows512(x, ldx, M, g * G5_MR, k0, K - k0 < G5_KC ? K - k0 : G5_KC, a + (b * groups + g) * stride);
    });
    const long chunks = (N + G5_COLS - 1) / G5_COLS;
    pool().run(chunks, threads, [&](long c) {
        thread_local std::vector<float, AlignedAlloc<float>> panels, acc;
        const long n0 = c * G5_COLS, n1 = n0 + G5_COLS < N ? n0 + G5_COLS : N, cols = n1 - n0;
        panels.resize((size_t)(G5_KC * G5_COLS));
        acc.resize((size_t)(groups * G5_MR * G5_COLS));
        for (long k0 = 0, b = 0; k0 < K; k0 += G5_KC, b++) {
            const long kc = K - k0 < G5_KC ? K - k0 : G5_KC;
            for (long p = 0; p < cols / G5_NR; p++) {
                float *panel = panels.data() + p * G5_KC * G5_NR;
                pack_w(n0 + p * G5_NR, k0, kc, panel);
                for (long g = 0; g < groups; g++)
                    gemm512_tile(kc, a + (b * groups + g) * stride, panel, acc.data() + g * G5_MR * G5_COLS + p * G5_NR,
                                 G5_COLS, k0 == 0);
            }
        }
        for (long m = 0; m < M; m++)
            for (long j = 0; j < cols; j += 16) {
                const __m512 sums = _mm512_loadu_ps(acc.data() + m * G5_COLS + j);
                Vec::store(y + m * ldy + n0 + j, scales ? _mm512_mul_ps(sums, _mm512_loadu_ps(scales + n0 + j)) : sums);
            }
    });
}

template <class TX, class PackW>
bool gemm512_with(const TX *x, long ldx, PackW &&pack_w, TX *y, long ldy, long M, long K, long N, int threads,
                  const float *scales = nullptr) {
    if (M < G5_MIN_ROWS || N % G5_NR != 0) return false;
    static_assert(GEMM_ROWS % G5_MR == 0 && GEMM_ROWS % GEMM_MR == 0, "a block of rows is whole tiles");
    for (long m0 = 0; m0 < M; m0 += GEMM_ROWS)
        gemm512_rows(x + m0 * ldx, ldx, pack_w, y + m0 * ldy, ldy, M - m0 < GEMM_ROWS ? M - m0 : GEMM_ROWS, K, N,
                     threads, scales);
    return true;
}

template <class TX, class TW>
bool gemm512(const TX *x, long ldx, const TW *w, TX *y, long ldy, long M, long K, long N, int threads) {
    return gemm512_with(
        x, ldx, [&](long n, long k0, long kc, float *panel) { pack_panel512(w + n * K, K, k0, kc, panel); }, y, ldy,
        M, K, N, threads, row_scales(w, N, K));
}

// ---------------------------------------------------------------------------------------------
// Pair panels: a bf16 weight [N, K] laid out for products of few rows on the AVX-512 builds.
//
// The tiles above multiply along K, a dot product per pair of rows, and on an Emerald Rapids Xeon
// (2 vCPUs) they ran the bench model's bf16 products at ~140 GFLOP/s from 4 rows up, whichever of
// their two paths (AVX512_BF16's dot product, or widening and float32 multiply-adds): a decode step
// of 8 rows was bound by arithmetic there, not by memory. The dot product issued ~1.4 G/s a core
// against ~5.5 G/s for float32 multiply-adds (independent chains, in registers), and widening w and
// x as they load takes as many instructions again as the multiply-adds.
//
// Laid out in pair panels, 16 columns of w at a time, K-major, each k next to k + 1:
// P[(n / 16) * 16 K + (k / 2) * 32 + 2 j + e] = w[n / 16 * 16 + j][k + e], for K even, N a multiple of
// PANEL_COLS. One 64-byte load of a panel is two vectors of 16 columns' weights, for k (the low
// halves, shifted up) and for k + 1 (the high halves, masked): no shuffle. A tile of MR rows and 32
// columns broadcasts each row's x[k] and x[k + 1] (x widened to float32 once per call) against them,
// 4 MR multiply-adds per 2 loads and 4 integer instructions. 56 MB of the bench model's weights
// (2 threads, best of 9): 1.61x the tiles at 8 rows, 1.8x at 16, 1.7-1.8x at 24 and 32. From
// G5_MIN_ROWS rows the panels feed the GEMM instead, widened with the same two instructions.
static constexpr long PANEL_COLS = 32;

#if defined(LLK_VEC512)
// The 16 x 16 32-bit words r[0..15] (row j in r[j]) transposed in place: r[c] holds column c.
inline void transpose_words16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {  // u[i + c] lane L: rows i .. i + 3 of column 4 L + c
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        const __m512i v = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), w = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xDD);
        const __m512i x = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
        const __m512i y = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xDD);
        r[c] = _mm512_shuffle_i32x4(v, x, 0x88);
        r[4 + c] = _mm512_shuffle_i32x4(w, y, 0x88);
        r[8 + c] = _mm512_shuffle_i32x4(v, x, 0xDD);
        r[12 + c] = _mm512_shuffle_i32x4(w, y, 0xDD);
    }
}
#endif

// P for the bf16 weight w [N, K] (N % PANEL_COLS == 0, K even). A pair (k, k + 1) is one 32-bit word, so
// a panel is its 16 rows' words transposed: line k / 2 of the panel holds word k / 2 of each row. Element
// by element, row by row, a 4096 x 11008 weight took 79 ms (1.1 GB/s) on the AMX Xeon, and the layout was
// 62% of loading a Llama-2-7B-shaped checkpoint (32 s of 52); word by word, line by line, 40 ms.
// A panel fills the memory its 16 rows held, so P may be w itself: each panel's rows are then copied
// out first (16 K elements), and the weight is laid out where it was loaded, touching no new memory.
void pack_pairs(const bf16 *w, bf16 *P, long K, long N) {
    const long words = K / 2;
    std::vector<uint32_t> copy(w == P ? 16 * words : 0);
    for (long p = 0; p < N / 16; p++) {
        const uint32_t *rows = (const uint32_t *)(w + p * 16 * K);
        uint32_t *panel = (uint32_t *)(P + p * 16 * K);
        if (!copy.empty()) rows = (const uint32_t *)memcpy(copy.data(), rows, 16 * words * sizeof(uint32_t));
        long k = 0;
#if defined(LLK_VEC512)
        for (; k + 16 <= words; k += 16) {
            __m512i r[16];
            for (int j = 0; j < 16; j++) r[j] = _mm512_loadu_si512(rows + j * words + k);
            transpose_words16(r);
            for (int c = 0; c < 16; c++) _mm512_storeu_si512(panel + (k + c) * 16, r[c]);
        }
#endif
        for (; k < words; k++)
            for (long j = 0; j < 16; j++) panel[k * 16 + j] = rows[j * words + k];
    }
}

// The GEMM's panel (panel[k * G5_NR + j], k < kc, float32) of columns [n, n + G5_NR) from pair panels.
inline void pack_panel512_pairs(const bf16 *P, long K, long n, long k0, long kc, float *panel) {
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    for (int half = 0; half < G5_NR; half += 16) {
        const bf16 *src = P + (n + half) * K;
        for (long k = 0; k < kc; k += 2) {
            const __m512i raw = _mm512_loadu_si512(src + (k0 + k) * 16);
            _mm512_storeu_ps(panel + k * G5_NR + half, _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16)));
            _mm512_storeu_ps(panel + (k + 1) * G5_NR + half, _mm512_castsi512_ps(_mm512_and_si512(raw, high)));
        }
    }
}

// How far ahead (elements of one panel's stream) a tile prefetches its two panels, into L2. One row over 256
// MiB of the bench model's weights on that Xeon: 2048 as fast as 512 or 1024, 4096 3% slower.
static constexpr long PAIRS_PREFETCH = 2048;

// y rows [0, MR) x columns [0, 32) = x (float32, rows ldx apart) times the two pair panels at P (16 K
// elements apart), into acc[i * 32 + j]. Up to 6 rows keep k and k + 1 in separate sums: with one, each
// sum waits for its last multiply-add twice per step.
template <int MR>
inline void pairs_tile(const float *x, long ldx, const bf16 *P, long K, float *acc) {
    constexpr int S = MR <= 6 ? 2 : 1;
    __m512 c[MR][2][S];
    for (int i = 0; i < MR; i++)
        for (int h = 0; h < 2; h++)
            for (int s = 0; s < S; s++) c[i][h][s] = _mm512_setzero_ps();
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    const bf16 *P1 = P + 16 * K;
    for (long k = 0; k < K; k += 2) {
        prefetch_weight(P + k * 16 + PAIRS_PREFETCH);
        prefetch_weight(P1 + k * 16 + PAIRS_PREFETCH);
        const __m512i r0 = _mm512_loadu_si512(P + k * 16), r1 = _mm512_loadu_si512(P1 + k * 16);
        const __m512 w0e = _mm512_castsi512_ps(_mm512_slli_epi32(r0, 16));
        const __m512 w0o = _mm512_castsi512_ps(_mm512_and_si512(r0, high));
        const __m512 w1e = _mm512_castsi512_ps(_mm512_slli_epi32(r1, 16));
        const __m512 w1o = _mm512_castsi512_ps(_mm512_and_si512(r1, high));
#pragma GCC unroll 16
        for (int i = 0; i < MR; i++) {
            const __m512 xe = _mm512_set1_ps(x[i * ldx + k]), xo = _mm512_set1_ps(x[i * ldx + k + 1]);
            c[i][0][0] = _mm512_fmadd_ps(w0e, xe, c[i][0][0]);
            c[i][1][0] = _mm512_fmadd_ps(w1e, xe, c[i][1][0]);
            c[i][0][S - 1] = _mm512_fmadd_ps(w0o, xo, c[i][0][S - 1]);
            c[i][1][S - 1] = _mm512_fmadd_ps(w1o, xo, c[i][1][S - 1]);
        }
    }
    for (int i = 0; i < MR; i++)
        for (int h = 0; h < 2; h++)
            _mm512_storeu_ps(acc + i * 32 + 16 * h, S == 2 ? _mm512_add_ps(c[i][h][0], c[i][h][S - 1]) : c[i][h][0]);
}

template <int MR = 12>
inline void pairs_tile_rows(int mr, const float *x, long ldx, const bf16 *P, long K, float *acc) {
    if constexpr (MR == 1) {
        pairs_tile<1>(x, ldx, P, K, acc);
    } else {
        if (mr == MR) pairs_tile<MR>(x, ldx, P, K, acc);
        else pairs_tile_rows<MR - 1>(mr, x, ldx, P, K, acc);
    }
}


#if defined(LLK_AVX512BF16) && (defined(__clang__) ? __clang_major__ >= 12 : __GNUC__ >= 11)
#define LLK_AMX 1
// ---------------------------------------------------------------------------------------------
// AMX: bf16 products over the same pair panels on the tile unit.
//
// The pair panels are AMX's own layout for a tile product's second operand: a B tile is 16 rows of
// k-pairs by 16 columns, each row the 16 columns' (k, k + 1), 64 bytes, and a 16-column panel holds
// those rows K-major, so a B tile is 1 KB read in one piece (P + n K + 16 k). So a CPU with AMX keeps
// one copy of a bf16 weight, in pair panels, for every row count, where oneDNN's tiles need its own
// packed copy. Each work item takes two panels (32 columns) and runs every R rows of x (16 up to 16
// rows, else 32) against them: R / 16 x 2 C tiles of sums, R / 16 A tiles and two B tiles a step of 32 k.
//
// The bench model's 85 bf16 weights (230 MB), one pass, 2 threads of an AMX Xeon (family 6 model 167,
// medians of 9 alternated rounds): 9.3 / 9.7 / 9.8 ms at 1 / 8 / 16 rows on the tiles, 10.3 / 12.9 / 17.8
// on the vector tiles, 12.3 / 12.5 / 12.8 on oneDNN's packed products; a prompt's rows 1.22x oneDNN's time
// at 256 rows, 1.03x at 768, with their copy into A tiles on one thread (on every thread: amx_linear_pairs).
//
// The tiles' state is off until the process asks Linux for it (ARCH_REQ_XCOMP_PERM, XTILEDATA; oneDNN asks
// too). Each work item loads the tile configuration and releases the tiles when done.
static constexpr long AMX_K = 32;
// K in blocks of AMX_KB: a block's two panels (16 KB) stay in L1 across the row blocks, the sums in acc
// between blocks (the whole K at once: 1.16-1.34x slower at 256 rows).
static constexpr long AMX_KB = 256;
// At least this many work items a thread: the panels of a 768-output weight came in 5 items for 2 threads.
static constexpr long AMX_SPLIT = 4;
// A prompt of at least AMX_HALVED_ROWS rows whose items would take fewer than AMX_FEW_PAIRS column pairs each goes
// in two halves of rows (amx_pairs). On an AMX Xeon (family 6 model 167, 2 threads), 768 rows of the bench model's
// 768-output products, 21 alternated rounds: down (K 3072) 1.10-1.13x, o_proj 1.04-1.07x; its wider products,
// halved too, 0.98-1.04x, and the 7B-shaped ones (4096 outputs and more) 0.95-1.07x, so those stay whole.
static constexpr long AMX_HALVED_ROWS = 512, AMX_FEW_PAIRS = 8;
// A prompt's rows of x in blocks of AMX_MC rows by AMX_KC of K (768 KB): each block is read from L3 or memory
// once per work item and from L2 by each of its columns. Each 32 columns read the whole of x before, so a
// Llama-2-7B-shaped layer's four products on 768 rows of an AMX Xeon (family 6 model 167, 2 threads) ran at
// 1293-1345 GFLOP/s, 1521-1585 on 256 rows; blocked, 2033-2056 and 1881-1936. Blocks of 128 to 1024 rows by
// 256 to 1024 of K read within ~10% of each other at 256, 768 and 2048 rows.
static constexpr long AMX_MC = 768, AMX_KC = 512;
// The fewest rows the tiles take by default. From one row, each row's sums add in one order whatever rows
// come with it: a prompt decodes the same greedy tokens alone and in a batch (with one row on the vector
// tiles, a tiny model's did not). It costs little: one row's pass over the bench model's weights took 0.90x
// the vector tiles' time, a whole one-row decode step 1.04x (8.31 against 7.97 ms, 12 alternated rounds).
static std::atomic<long> amx_min_rows{1};

bool amx_usable() {
    static const bool usable = [] {
        unsigned a, b, c, d;
        __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
        if (!(d & (1u << 22)) || !(d & (1u << 24))) return false;  // AMX-BF16, AMX-TILE
        return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
    }();
    return usable;
}

struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// Tiles 0-3 hold sums (C), 4-5 x (A), 6-7 the panels (B), each 64 bytes a row; C and A tiles `rows` rows.
__attribute__((target("amx-tile"))) void amx_configure(int rows) {
    TileConfig cfg;
    for (int t = 0; t < 8; t++) cfg.rows[t] = t < 6 ? rows : 16, cfg.colsb[t] = 64;
    // GCC does not see ldtilecfg read cfg, and drops the stores above without this
    __asm__ volatile("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
}

__attribute__((target("amx-tile"))) void amx_release() { _tile_release(); }

// Where x's A tiles (16 rows by 32 k, or fewer rows) start: row m, column k at x + m ld + k kstep; a tile's
// rows are stride bytes apart.
struct ATiles {
    const bf16 *x;
    long ld, kstep, stride;
    const bf16 *at(long m, long k) const { return x + m * ld + k * kstep; }
};

// The two 16-column panels of pair panels P (K rows) that a work item's column pair b reads: columns
// [32 b, 32 b + 32) of one weight; or, for a gate/up weight [gate (up_cols) | up (up_cols)] whose silu(gate) * up
// is wanted (up_cols > 0), gate columns [16 b, 16 b + 16) and the up columns up_cols further.
struct PanelPairs {
    const bf16 *P;
    long K, up_cols;
    const bf16 *first(long b) const { return P + (up_cols ? 16 : 32) * b * K; }
    const bf16 *second(long b) const { return first(b) + (up_cols ? up_cols : 16) * K; }
};

// acc[(m - m0) * 32 + j] (m in [m0, m1), a multiple of R apart, j < 32) = the sums over k in [kc, ke) of x's A
// tiles (zeros past M) times the 16-column panels P0 (j < 16) and P1, added to acc where kc > 0.
template <int R>
__attribute__((target("amx-tile,amx-bf16"))) void amx_tiles(const ATiles &xa, long m0, long m1, const bf16 *P0,
                                                             const bf16 *P1, long kc, long ke, float *acc) {
    for (long kb = kc; kb < ke; kb += AMX_KB) {
        const long kbe = kb + AMX_KB < ke ? kb + AMX_KB : ke;
        for (long m = m0; m < m1; m += R) {
            float *c = acc + (m - m0) * 32;
            if (kb == 0) {
                _tile_zero(0);
                _tile_zero(1);
                if constexpr (R == 32) {
                    _tile_zero(2);
                    _tile_zero(3);
                }
            } else {
                _tile_loadd(0, c, 128);
                _tile_loadd(1, c + 16, 128);
                if constexpr (R == 32) {
                    _tile_loadd(2, c + 16 * 32, 128);
                    _tile_loadd(3, c + 16 * 32 + 16, 128);
                }
            }
            for (long k = kb; k < kbe; k += AMX_K) {
                _tile_loadd(4, xa.at(m, k), xa.stride);
                _tile_loadd(6, P0 + 16 * k, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_loadd(7, P1 + 16 * k, 64);
                _tile_dpbf16ps(1, 4, 7);
                if constexpr (R == 32) {
                    _tile_loadd(5, xa.at(m + 16, k), xa.stride);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, c, 128);
            _tile_stored(1, c + 16, 128);
            if constexpr (R == 32) {
                _tile_stored(2, c + 16 * 32, 128);
                _tile_stored(3, c + 16 * 32 + 16, 128);
            }
        }
    }
}

// y[m, b * 32 + j] (m < M, b in [b0, b1), j < 32) = x's A tiles (rows [0, Mp), Mp a multiple of R, zeros past M;
// or M rows, at most 16, for tiles configured that high) times the pair panels; for a gate/up weight, y[m, b * 16
// + j] (j < 16) = silu(gate) * up of those sums, each rounded to bf16 first, as silu_mul takes them from y. Rows
// go mc at a time and K kc at a time (AMX_KB-aligned): each block of x (mc x kc) is read from memory once for
// all the item's columns and stays in L2 while they run; acc holds mc x 32 float32 sums of each of the b1 - b0
// column pairs between blocks of K. Every sum adds its k in order, whatever mc and kc: the same bits as one block.
template <int R>
__attribute__((target("amx-tile,amx-bf16"))) void amx_columns(const ATiles &xa, long M, long Mp,
                                                               const PanelPairs &pairs, long K, long b0, long b1,
                                                               long mc, long kc, bf16 *y, long ldy, float *acc) {
    const bool silu_up = pairs.up_cols > 0;
    for (long m0 = 0; m0 < Mp; m0 += mc) {
        const long m1 = m0 + mc < Mp ? m0 + mc : Mp;
        for (long k0 = 0; k0 < K; k0 += kc)
            for (long b = b0; b < b1; b++)
                amx_tiles<R>(xa, m0, m1, pairs.first(b), pairs.second(b), k0, k0 + kc < K ? k0 + kc : K,
                             acc + (b - b0) * mc * 32);
        for (long b = b0; b < b1; b++) {
            const float *sums = acc + (b - b0) * mc * 32;
            bf16 *const yb = y + b * (silu_up ? 16 : PANEL_COLS);
            for (long m = m0; m < m1 && m < M; m++) {
                const float *row = sums + (m - m0) * 32;
                if (silu_up) {
                    const Vec::F gate = Vec::round_bf16(Vec::load(row)), up = Vec::round_bf16(Vec::load(row + 16));
                    Vec::store(yb + m * ldy, Vec::mul(rounded<bf16>(silu<bf16>(gate)), up));
                } else {
                    for (int j = 0; j < 32; j += 16) Vec::store(yb + m * ldy + j, Vec::load(row + j));
                }
            }
        }
    }
}

// The column pairs [0, blocks) of `pairs` over x[M, K] on the tiles into y (amx_columns); false (nothing done)
// where they do not take it: no AMX, fewer rows than amx_min_rows, or K not a multiple of AMX_K.
bool amx_pairs(const bf16 *x, long ldx, const PanelPairs &pairs, long blocks, bf16 *y, long ldy, long M, long K,
               int threads) {
    const long min_rows = amx_min_rows.load(std::memory_order_relaxed);
    if (min_rows <= 0 || M < min_rows || K % AMX_K != 0 || !amx_usable()) return false;
    // Up to 16 rows (a decode step's) the tiles are configured that high and read x in place; more are
    // copied as A tiles, 1 KB each in one piece, zeros past M up to a multiple of 32.
    const bool few = M <= 16;
    const long Mp = few ? M : (M + 31) / 32 * 32;
    ATiles xa{x, ldx, 1, ldx * (long)sizeof(bf16)};
    if (!few) {
        thread_local std::vector<bf16, AlignedAlloc<bf16>> tiles;
        bf16 *const copied = grown(tiles, (size_t)(Mp * K));
        // Copied by every thread, 16 rows a work item. Copied by the calling thread alone, the bench model's 85
        // bf16 products took 1.08x oneDNN's time at 256 rows and 0.99x at 768; so, 1.04x and 0.92x (15
        // alternated rounds). Whole prefills moved less than the host's noise (0.99x / 1.01x, 13 rounds).
        pool().run(Mp / 16, threads, [&](long block) {
            for (long m = block * 16; m < block * 16 + 16; m++)
                for (long k = 0; k < K; k += AMX_K) {
                    bf16 *to = copied + block * 16 * K + 16 * k + (m % 16) * AMX_K;
                    if (m < M) memcpy(to, x + m * ldx + k, AMX_K * sizeof(bf16));
                    else memset(to, 0, AMX_K * sizeof(bf16));
                }
        });
        xa = ATiles{copied, K, 16, 64};
    }
    // A decode step's few rows stream the weight, CHUNK_BYTES of it a work item; a prompt's rows take AMX_SPLIT
    // items a thread, as wide as that leaves them, so that each block of x serves as many columns as it can.
    // Where that leaves an item fewer than AMX_FEW_PAIRS pairs (a narrow product), the rows go in two halves and
    // each item takes one half for twice the pairs: x is read from memory half as often.
    const long items = AMX_SPLIT * (threads > 0 ? threads : 1);
    const long halves = !few && Mp >= AMX_HALVED_ROWS && blocks / items < AMX_FEW_PAIRS ? 2 : 1;
    const long rows_per = round_up(Mp / halves, 32);
    const long most = few ? CHUNK_BYTES / (K * (long)sizeof(bf16) * PANEL_COLS) : blocks;
    const long per_chunk = std::max(1L, std::min(most, blocks * halves / items));
    const long mc = few ? Mp : std::min(rows_per, AMX_MC), kc = few ? K : AMX_KC;
    const long chunks = (blocks + per_chunk - 1) / per_chunk;
    pool().run(chunks * halves, threads, [&](long item) {
        thread_local std::vector<float, AlignedAlloc<float>> sums;
        float *const acc = grown(sums, (size_t)(per_chunk * mc * 32));  // each K block's sums stored before read
        const long c = item % chunks, r0 = item / chunks * rows_per, rows = std::min(rows_per, Mp - r0);
        const long b0 = c * per_chunk, b1 = b0 + per_chunk < blocks ? b0 + per_chunk : blocks;
        const ATiles xr{xa.at(r0, 0), xa.ld, xa.kstep, xa.stride};  // the item's rows (all of them in one half)
        amx_configure(few ? (int)M : 16);
        if (few) amx_columns<16>(xr, std::min(rows, M - r0), rows, pairs, K, b0, b1, mc, kc, y + r0 * ldy, ldy, acc);
        else amx_columns<32>(xr, std::min(rows, M - r0), rows, pairs, K, b0, b1, mc, kc, y + r0 * ldy, ldy, acc);
        amx_release();
    });
    return true;
}

// y[M, N] = x[M, K] @ w^T on the tiles, for w in pair panels; false (nothing done) where they do not take it.
bool amx_linear_pairs(const bf16 *x, long ldx, const bf16 *P, bf16 *y, long ldy, long M, long K, long N,
                      int threads) {
    return N % PANEL_COLS == 0 && amx_pairs(x, ldx, PanelPairs{P, K, 0}, N / PANEL_COLS, y, ldy, M, K, threads);
}

// act[M, I] = silu(gate) * up for the gate/up weight [gate (I) | up (I), K] in pair panels, in one pass on the
// tiles: each item's gate and up columns side by side, their sums made silu(gate) * up while still in the core
// that made them. linear_pairs then silu_mul wrote [gate | up] out and read it back on other cores, split by rows:
// 5.5% of the bench model's 768-token prompt (perf), most of it waiting on those reads. In one pass the bench
// model's prompts took 0.91 / 0.89 of the time at 256 / 768 tokens (AMX Xeon, 2 threads, 8 processes a side).
// The same numbers. A prompt's rows only (more than 16): a decode step's weight streams stay in order. False
// (nothing done) where the tiles do not take it.
bool amx_gate_up_silu(const bf16 *x, long ldx, const bf16 *P, bf16 *act, long ldact, long M, long K, long I,
                      int threads) {
    return M > 16 && I % 16 == 0 && amx_pairs(x, ldx, PanelPairs{P, K, I}, I / 16, act, ldact, M, K, threads);
}
#endif

// y[M, N] = x[M, K] @ w^T for w in pair panels P (bf16).
template <class TX>
void linear_pairs(const TX *x, long ldx, const bf16 *P, TX *y, long ldy, long M, long K, long N, int threads) {
    if (M <= 0) return;
#if defined(LLK_AMX)
    if constexpr (std::is_same_v<TX, bf16>)
        if (amx_linear_pairs(x, ldx, P, y, ldy, M, K, N, threads)) return;
#endif
    if (gemm512_with(
            x, ldx, [&](long n, long k0, long kc, float *panel) { pack_panel512_pairs(P, K, n, k0, kc, panel); }, y,
            ldy, M, K, N, threads))
        return;
    const float *xf = (const float *)x;
    long ldxf = ldx;
    if constexpr (!std::is_same_v<TX, float>) {  // widened once, into the caller's buffer kept between calls
        thread_local std::vector<float, AlignedAlloc<float>> widened;
        float *const to = grown(widened, (size_t)(M * K));
        for (long m = 0; m < M; m++)
            for (long k = 0; k < K; k++) to[m * K + k] = to_f32(x[m * ldx + k]);
        xf = to;
        ldxf = K;
    }
    const long groups = (M + 11) / 12, rows = (M + groups - 1) / groups;  // rows per tile, at most 12
    long per_chunk = CHUNK_BYTES / (K * (long)sizeof(bf16) * PANEL_COLS);
    if (per_chunk < 1) per_chunk = 1;
    const long blocks = N / PANEL_COLS, chunks = (blocks + per_chunk - 1) / per_chunk;
    pool().run(chunks, threads, [&](long c) {
        alignas(64) float acc[12 * PANEL_COLS];
        const long b1 = (c + 1) * per_chunk < blocks ? (c + 1) * per_chunk : blocks;
        for (long b = c * per_chunk; b < b1; b++) {
            const long n = b * PANEL_COLS;
            for (long m = 0; m < M; m += rows) {
                const int mr = (int)(M - m < rows ? M - m : rows);
                pairs_tile_rows(mr, xf + m * ldxf, ldxf, P + n * K, K, acc);
                for (int i = 0; i < mr; i++)
                    for (int j = 0; j < PANEL_COLS; j += 16) Vec::store(y + (m + i) * ldy + n + j, _mm512_loadu_ps(acc + i * 32 + j));
            }
        }
    });
}
#endif

// Whether the product of TX rows over TW weights stays on the tiles whatever its rows, the GEMM never taking it:
// int8 weights under bf16 on the avx512bf16 build, whose dot-product tiles ran the bench model's products faster
// than the float32 GEMM at every row count measured (Zen 4 EPYC, 2 threads, medians of 8 alternated passes: 27.9
// against 31.8 ms at 32 rows, 39.4 / 71.8 at 48, 103.7 / 164.6 at 128, 202.6 / 302.6 at 256, 661 / 936 at 768).
// fast_linear gives a prompt's rows past INT8_TILES_MAX_ROWS to oneDNN instead, where that times faster.
template <class TX, class TW>
constexpr bool tiles_only() {
#if defined(LLK_AVX512BF16)
    if constexpr (std::is_same_v<TX, bf16> && std::is_same_v<TW, int8_t>) return true;
#endif
    return false;
}

// run(n0, n1) over w's N rows of K elements, in chunks of ~CHUNK_BYTES (a multiple of R rows), each to whichever
// thread is free (see Pool). The chunks are as many as a multiple of the threads and of one size: a product of
// several rows is bound by arithmetic, so 3 chunks on 2 threads (an int8 768 x 768 weight, 256 KB a chunk) took
// twice one chunk's time where 4 smaller ones take 1.5. Whole decode steps of the bench model with int8 weights
// (Zen 3 EPYC, 2 threads, the old and new libraries alternated in one process, 30 rounds): 1.16x faster at 8 rows
// (medians 16.3 against 18.9 ms), 1.06x at 4; bf16 weights at 8 rows and one row of either within the noise.
template <class Run>
void for_row_chunks(long N, long K, long element_bytes, int R, int threads, Run &&run) {
    long chunk = std::max((CHUNK_BYTES / (K * element_bytes)) / R * R, (long)R);
    long chunks = (N + chunk - 1) / chunk;
    if (threads > 1 && chunks > 1) {
        const long even = (chunks + threads - 1) / threads * threads;
        chunk = round_up((N + even - 1) / even, R);
        chunks = (N + chunk - 1) / chunk;
    }
    pool().run(chunks, threads, [&](long c) { run(c * chunk, std::min(N, (c + 1) * chunk)); });
}

#if defined(LLK_AVX2)
#if !defined(LLK_I16_MIN_ROWS)
#define LLK_I16_MIN_ROWS 2
#endif
static constexpr long I16_MIN_ROWS = LLK_I16_MIN_ROWS;

// linear() for float32 rows over int8 weights, I16_MIN_ROWS of them or more: the rows rounded to int16 once (a
// scratch buffer of the calling thread's), then the int16 GEMM over whole panels from GEMM_MIN_ROWS rows, else
// the int16 tiles.
void linear_int16_rows(const float *x, long ldx, const int8_t *w, float *y, long ldy, long M, long K, long N,
                       int threads) {
    thread_local std::vector<int16_t> rows;
    thread_local std::vector<float> steps;
    int16_t *q = grown(rows, (size_t)(M * K));
    float *s = grown(steps, (size_t)M);
    quantize_rows_i16(x, ldx, M, K, q, K, s);
    if (M >= GEMM_MIN_ROWS && N % GEMM_NR == 0) {
        for (long m0 = 0; m0 < M; m0 += GEMM_ROWS)
            gemm_rows<Int16Pairs>(q + m0 * K, K, s + m0, w, y + m0 * ldy, ldy, std::min(M - m0, GEMM_ROWS), K, N, threads);
        return;
    }
    const float *scales = row_scales(w, N, K);
    constexpr int W = Tile<int16_t, int8_t>::W, X = Tile<int16_t, int8_t>::X;
    for_row_chunks(N, K, 1, W, threads, [&](long n0, long n1) {
        linear_rows<int16_t, int8_t, W, X, float>(q, K, w, y, ldy, M, K, n0, n1, PREFETCH_ROWS_WEIGHTS, scales, s);
    });
}
#endif

template <class TX, class TW>
void linear(const TX *x, long ldx, const TW *w, TX *y, long ldy, long M, long K, long N, int threads,
            long one_row_prefetch) {
#if defined(LLK_AVX2)
    if constexpr (std::is_same_v<TX, float> && std::is_same_v<TW, int8_t>) {
        if (M >= I16_MIN_ROWS) return linear_int16_rows(x, ldx, w, y, ldy, M, K, N, threads);
    }
    if (gemm(x, ldx, w, y, ldy, M, K, N, threads)) return;
#elif defined(LLK_VEC512)
    if (!tiles_only<TX, TW>() && gemm512(x, ldx, w, y, ldy, M, K, N, threads)) return;
#endif
    const float *scales = row_scales(w, N, K);
    const long one_row = one_row_prefetch > 0 ? one_row_prefetch : PREFETCH_ONE_ROW;
    const long pf = M == 1 ? one_row / (long)sizeof(TW) : PREFETCH_ROWS_WEIGHTS;
    constexpr int W = Tile<TX, TW>::W, X = Tile<TX, TW>::X;
    for_row_chunks(N, K, sizeof(TW), M == 1 ? 1 : W, threads, [&](long n0, long n1) {
        if (M == 1) linear_rows<TX, TW, 1, 1>(x, ldx, w, y, ldy, M, K, n0, n1, pf, scales);
        else linear_rows<TX, TW, W, X>(x, ldx, w, y, ldy, M, K, n0, n1, pf, scales);
    });
}

// ---------------------------------------------------------------------------------------------
// decode attention: one query per row and head over the row's cached keys and values.
//
// q, out: [rows, H, D]; k, v: one layer's cache [slots, Hkv, Lmax, D]; row b attends to
// positions [0, lens[b]) of slot slots[b]. A work item is (row, kv head): the G = H / Hkv query
// heads that share those keys read each of them once from memory. Scores go to a per-thread
// buffer, N positions at a time (one vector of N scores from N dot products), then a softmax,
// then the weighted sum of the values in blocks of positions, each block read from memory
// once for all G heads. bf16 keys and values are split into their even- and odd-numbered
// elements as they are loaded (one load and one instruction each for 2N of them); bf16
// queries against bf16 keys use AVX512_BF16's dot product where the CPU has it.

// A query head ready for dot products with keys of type TC: partial(k) is a vector whose lanes
// sum to q . k, finish() turns N such sums into scaled scores.
template <class TQ, class TC, int D>
struct QueryDot {  // float keys
    float q[D];
    void prepare(const TQ *src, float scale) {
        for (int d = 0; d < D; d++) q[d] = to_f32(src[d]) * scale;
    }
    Vec::F partial(const float *k) const {
        Vec::F acc = Vec::mul(Vec::load(k), Vec::load(q));
        for (int i = Vec::N; i < D; i += Vec::N) acc = Vec::fma(Vec::load(k + i), Vec::load(q + i), acc);
        return acc;
    }
    Vec::F finish(Vec::F s) const { return s; }
};

template <class TQ, int D>
struct QueryDot<TQ, bf16, D> {  // bf16 keys, float arithmetic: the query split as the keys are
    float even[D / 2], odd[D / 2];
    void prepare(const TQ *src, float scale) {
        for (int m = 0; m < D / 2; m++) {
            even[m] = to_f32(src[2 * m]) * scale;
            odd[m] = to_f32(src[2 * m + 1]) * scale;
        }
    }
    Vec::F partial(const bf16 *k) const {
        Vec::F acc = Vec::zero(), e, o;
        for (int c = 0; c < D / (2 * Vec::N); c++) {
            Vec::load_split(k + 2 * Vec::N * c, e, o);
            acc = Vec::fma(e, Vec::load(even + Vec::N * c), Vec::fma(o, Vec::load(odd + Vec::N * c), acc));
        }
        return acc;
    }
    Vec::F finish(Vec::F s) const { return s; }
};

#if defined(LLK_AVX512BF16)
template <int D>
struct QueryDot<bf16, bf16, D> {  // two bf16 products a lane per instruction, scaled after
    __m512i q[D / 32];
    float scale;
    void prepare(const bf16 *src, float s) {
        for (int c = 0; c < D / 32; c++) q[c] = _mm512_loadu_si512(src + 32 * c);
        scale = s;
    }
    Vec::F partial(const bf16 *k) const {
        __m512 acc = _mm512_setzero_ps();
        for (int c = 0; c < D / 32; c++)
            acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(k + 32 * c), (__m512bh)q[c]);
        return acc;
    }
    Vec::F finish(Vec::F s) const { return Vec::mul(s, Vec::set1(scale)); }
};
#endif

// scores[g][t] = scale * q_g . k_t for the G heads and L positions, N positions at a time.
// The values' block at the same positions goes to L2 meanwhile: the weighted sum then reads it from there,
// and the memory sees two streams instead of one after the other. 8 rows of the bench model's bf16 cache
// over 160-320 positions, cold (12 layers, 2 threads, an Emerald Rapids Xeon): 1.085-1.09x (30 alternated
// rounds); the same block into L1, or 4 blocks ahead, 1.00-1.06x.
template <class TQ, class TC, int D>
void attention_scores(const TQ *q, const TC *k, const TC *v, long L, int G, float scale, float *scores) {
    const int N = Vec::N;
    const long block_bytes = (long)N * D * sizeof(TC);
    QueryDot<TQ, TC, D> heads[8];
    for (int g0 = 0; g0 < G; g0 += 8) {
        int gn = G - g0 < 8 ? G - g0 : 8;
        for (int g = 0; g < gn; g++) heads[g].prepare(q + (long)(g0 + g) * D, scale);
        for (long t0 = 0; t0 < L; t0 += N) {
            long n = L - t0 < N ? L - t0 : N;
            const TC *kb = k + t0 * D;
            for (long b = 0; b < block_bytes; b += 64) prefetch((const char *)kb + 4 * block_bytes + b);
            if (g0 == 0)
                for (long b = 0; b < block_bytes; b += 64) _mm_prefetch((const char *)(v + t0 * D) + b, _MM_HINT_T1);
            for (int g = 0; g < gn; g++) {
                Vec::F acc[N];
                for (int j = 0; j < N; j++) acc[j] = j < n ? heads[g].partial(kb + j * D) : Vec::zero();
                Vec::F s = heads[g].finish(Vec::sum_lanes(acc));
                float *dst = scores + (long)(g0 + g) * L + t0;
                if (n == N) {
                    Vec::store(dst, s);
                } else {
                    float tmp[N];
                    Vec::store(tmp, s);
                    for (long j = 0; j < n; j++) dst[j] = tmp[j];
                }
            }
        }
    }
}

// In place: each of the G rows of L scores becomes exp(score - max); returns 1 / sum per row.
inline void softmax_rows(float *scores, long L, int G, float *inv_sum) {
    for (int g = 0; g < G; g++) {
        float *s = scores + (long)g * L;
        long t = 0;
        Vec::F mv = Vec::set1(-INFINITY);
        for (; t + Vec::N <= L; t += Vec::N) mv = Vec::max(mv, Vec::load(s + t));
        float mx = Vec::hmax(mv);
        for (; t < L; t++) mx = s[t] > mx ? s[t] : mx;
        Vec::F m = Vec::set1(mx), sv = Vec::zero();
        for (t = 0; t + Vec::N <= L; t += Vec::N) {
            Vec::F e = vexp(Vec::sub(Vec::load(s + t), m));
            Vec::store(s + t, e);
            sv = Vec::add(sv, e);
        }
        if (t < L) {  // the last positions, padded with -inf (exp gives 0)
            float tail[Vec::N];
            for (long i = 0; i < Vec::N; i++) tail[i] = t + i < L ? s[t + i] : -INFINITY;
            Vec::F e = vexp(Vec::sub(Vec::load(tail), m));
            Vec::store(tail, e);
            for (long i = 0; t + i < L; i++) s[t + i] = tail[i];
            sv = Vec::add(sv, e);
        }
        inv_sum[g] = 1.0f / Vec::hsum(sv);
    }
}

// acc[i] += p * v[i] over one value row; bf16 rows accumulate in the split order (each 2N
// elements: N even-numbered, then N odd-numbered), put back in order by unsplit().
template <int D>
inline void add_value(const float *v, Vec::F p, Vec::F *acc) {
    for (int i = 0; i < D / Vec::N; i++) acc[i] = Vec::fma(p, Vec::load(v + i * Vec::N), acc[i]);
}
template <int D>
inline void add_value(const bf16 *v, Vec::F p, Vec::F *acc) {
    Vec::F e, o;
    for (int c = 0; c < D / (2 * Vec::N); c++) {
        Vec::load_split(v + 2 * Vec::N * c, e, o);
        acc[2 * c] = Vec::fma(p, e, acc[2 * c]);
        acc[2 * c + 1] = Vec::fma(p, o, acc[2 * c + 1]);
    }
}
template <int D, class TC>
inline void unsplit_values(float *acc) {
    if constexpr (sizeof(TC) == 2) {
        float tmp[D];
        for (int c = 0; c < D / (2 * Vec::N); c++)
            for (int l = 0; l < Vec::N; l++) {
                tmp[2 * Vec::N * c + 2 * l] = acc[2 * Vec::N * c + l];
                tmp[2 * Vec::N * c + 2 * l + 1] = acc[2 * Vec::N * c + Vec::N + l];
            }
        memcpy(acc, tmp, sizeof(tmp));
    }
}

template <class TQ, class TC, int D>
void attend_item(const TQ *q, const TC *k, const TC *v, long L, int G, float scale, TQ *out,
                 std::vector<float> &scores) {
    const int NV = D / Vec::N;
    if (L <= 0) {  // nothing to attend to: zeros rather than 0/0
        for (long i = 0; i < (long)G * D; i++) store_scalar(out + i, 0.0f);
        return;
    }
    scores.resize((size_t)G * L);
    attention_scores<TQ, TC, D>(q, k, v, L, G, scale, scores.data());
    float inv_sum[64];
    softmax_rows(scores.data(), L, G, inv_sum);
    const long TB = 32;  // positions per block of values (D=128 bf16: 8 KB, stays in L1)
    float acc_out[64][D];
    for (int g = 0; g < G; g++)
        for (int d = 0; d < D; d++) acc_out[g][d] = 0.0f;
    for (long t0 = 0; t0 < L; t0 += TB) {
        long t1 = t0 + TB < L ? t0 + TB : L;
        for (int g = 0; g < G; g++) {
            const float *p = &scores[(size_t)g * L];
            Vec::F acc[NV];
            for (int i = 0; i < NV; i++) acc[i] = Vec::load(acc_out[g] + i * Vec::N);
            for (long t = t0; t < t1; t++) {
                const TC *vt = v + t * D;
                if (g == 0)
                    for (long b = 0; b < (long)(D * sizeof(TC)); b += 64) prefetch((const char *)(vt + TB * D) + b);
                add_value<D>(vt, Vec::set1(p[t]), acc);
            }
            for (int i = 0; i < NV; i++) Vec::store(acc_out[g] + i * Vec::N, acc[i]);
        }
    }
    for (int g = 0; g < G; g++) {
        unsplit_values<D, TC>(acc_out[g]);
        Vec::F inv = Vec::set1(inv_sum[g]);
        for (int i = 0; i < NV; i++)
            Vec::store(out + (long)g * D + i * Vec::N, Vec::mul(Vec::load(acc_out[g] + i * Vec::N), inv));
    }
}

template <class TQ, class TC, int D>
void decode_attention(const TQ *q, long ldq, const TC *k, const TC *v, const int64_t *slots, const int64_t *lens,
                      long rows, long H, long Hkv, long Lmax, float scale, TQ *out, int threads) {
    const long G = H / Hkv, items = rows * Hkv;
    pool().run(items, threads, [&](long item) {
        thread_local std::vector<float> scores;
        long b = item / Hkv, h = item % Hkv;
        long base = (slots[b] * Hkv + h) * Lmax * D;
        attend_item<TQ, TC, D>(q + b * ldq + h * G * D, k + base, v + base, lens[b], (int)G, scale,
                               out + (b * H + h * G) * D, scores);
    });
}

template <class TQ, class TC>
int decode_attention_d(const void *q, long ldq, const void *k, const void *v, const int64_t *slots,
                       const int64_t *lens, long rows, long H, long Hkv, long Lmax, long D, float scale, void *out,
                       int threads) {
    const TQ *qq = (const TQ *)q;
    const TC *kk = (const TC *)k, *vv = (const TC *)v;
    TQ *oo = (TQ *)out;
#define LLK_ATTEND(DIM) \
    case DIM: decode_attention<TQ, TC, DIM>(qq, ldq, kk, vv, slots, lens, rows, H, Hkv, Lmax, scale, oo, threads); return 0;
    switch (D) {
        LLK_ATTEND(32)
        LLK_ATTEND(64)
        LLK_ATTEND(128)
        LLK_ATTEND(256)
    }
#undef LLK_ATTEND
    return -1;
}

// ---------------------------------------------------------------------------------------------
// prompt attention: a prompt chunk's queries, float32 or bf16, each over the keys at or before its position,
// in float32 arithmetic.
//
// q [T, H, D] (rows ldq elements apart, heads D apart), the chunk's tokens at positions [start,
// start + T); k and v hold the keys and values of positions [0, start + T), float32 or bf16,
// position j of kv head h at j * ld[0] + h * ld[1] in k, j * ld[2] + h * ld[3] in v (a first
// chunk's own rows of the fused q/k/v product, or a slot of the cache). out [T, H, D] contiguous.
// SDPA's causal flash kernel ran the bench model's 768-token prompt at 40-76 GFLOP/s a layer
// (2-vCPU AVX2 EPYC), the linear layers beside it at ~170, and a later chunk by blocks of torch
// products over the cache at 43-54: a prompt's attention then grows with the square of its length
// at under half the speed of the rest.
// Here the two products go through the GEMMs' tiles: each kv head's keys packed once as panels of NR
// positions and its values as panels of NR columns (float32), then a work item is PA_ROWS queries of one
// head: their scores against every key up to the last of them (tiles wholly above the diagonal skipped),
// an exact softmax per row over the positions it sees (decode's), and the weighted sum of the values,
// each micro-panel of queries only over the keys its rows see. Items go out longest first.
// The AVX-512 builds take gemm512's 12 x 32 tile where the head size is a multiple of 32, the others
// AVX2's 6 x 16. On an Emerald Rapids Xeon (2 vCPUs), the bench model's 768-token prompt's attention
// (88 ms of a 690 ms prefill on the 6 x 16 tile) ran at 115-124 GFLOP/s a layer on the 6 x 16 tile and
// at 160-171 on the 12 x 32 (1.39-1.44x; 1.3-2.2x at 256 tokens). Blocks of 128 positions, or items
// of 96 queries, ran within 4% of these.
#if defined(LLK_PA_ROWS)
static constexpr long PA_ROWS = LLK_PA_ROWS;
#else
static constexpr long PA_ROWS = 48;
#endif

// A tile of MR rows by NR columns, its operands packed as the GEMMs pack them, and KC: the positions of
// one block of a value panel, kept in L1 (16 kB of a 16-column panel, 32 kB of a 32-column one).
struct Tiles256 {
    static constexpr long MR = GEMM_MR, NR = GEMM_NR, KC = GEMM_KC;
    static void tile(long kc, const float *a, const float *panel, float *y, long ldy, bool first) {
        gemm_tile(kc, a, panel, y, ldy, first);
    }
    template <class T>  // out[k * MR + i] = x[r0 + i][k], k < kc, zero for rows past M (2 floats of room past)
    static void pack_x(const T *x, long ldx, long M, long r0, long kc, float *out) {
        pack_rows(x, ldx, M, 0, kc, r0 / MR, out);
    }
    template <class T>  // panel[k * NR + j] = w[j][k], k < kc, the NR rows of w ldw apart
    static void pack_w(const T *w, long ldw, long kc, float *panel) { pack_panel(w, ldw, 0, kc, panel); }
};
#if defined(LLK_VEC512)
struct Tiles512 {
    static constexpr long MR = G5_MR, NR = G5_NR, KC = G5_KC;
    static void tile(long kc, const float *a, const float *panel, float *y, long ldy, bool first) {
        gemm512_tile(kc, a, panel, y, ldy, first);
    }
    template <class T>
    static void pack_x(const T *x, long ldx, long M, long r0, long kc, float *out) {
        pack_rows512(x, ldx, M, r0, 0, kc, out);
    }
    template <class T>
    static void pack_w(const T *w, long ldw, long kc, float *panel) { pack_panel512(w, ldw, 0, kc, panel); }
};
#endif

// kt[(p * D + d) * NR + j] = k[p * NR + j][d] and vt[(c * Lp + j) * NR + e] = v[j][c * NR + e] for L
// positions ldk and ldv apart, as float32, zero for positions j >= L (zero, not whatever memory holds: a
// zero weight times a NaN is NaN).
template <class Tiles, class TC>
void pack_kv_head(const TC *k, long ldk, const TC *v, long ldv, long L, long Lp, long D, float *kt, float *vt) {
    constexpr long NR = Tiles::NR;
    for (long p = 0; p < Lp / NR; p++) {
        const long j0 = p * NR;
        float *panel = kt + p * D * NR;
        if (j0 + NR <= L) {
            Tiles::pack_w(k + j0 * ldk, ldk, D, panel);
        } else {
            for (long d = 0; d < D; d++)
                for (long j = 0; j < NR; j++) panel[d * NR + j] = j0 + j < L ? to_f32(k[(j0 + j) * ldk + d]) : 0.0f;
        }
    }
    for (long c = 0; c < D / NR; c++)
        for (long j = 0; j < Lp; j++) {
            float *row = vt + (c * Lp + j) * NR;
            for (long e = 0; e < NR; e += Vec::N)
                Vec::store(row + e, j < L ? Vec::load(v + j * ldv + c * NR + e) : Vec::zero());
        }
}

// Queries [i0, i0 + rows) of the chunk at positions from first = start + i0, one head (q at the head's
// first row), from the packed keys and values of its kv head (Lp positions).
template <class Tiles, class TQ>
void prompt_attention_rows(const TQ *q, long ldq, const float *kt, const float *vt, long Lp, long D, long i0,
                           long first, long rows, float scale, TQ *out, long ldo) {
    constexpr long MR = Tiles::MR, NR = Tiles::NR, KC = Tiles::KC;
    thread_local std::vector<float, AlignedAlloc<float>> buffers;
    const long groups = (rows + MR - 1) / MR, span = round_up(first + rows, NR);
    const long q_stride = round_up(D * MR + 16, 16), p_stride = round_up(span * MR + 16, 16);
    buffers.resize((size_t)(groups * (q_stride + p_stride + MR * span + MR * D)));
    float *qp = buffers.data(), *pp = qp + groups * q_stride, *s = pp + groups * p_stride, *o = s + groups * MR * span;
    float inv[PA_ROWS];
    const Vec::F scaled = Vec::set1(scale);  // scores come out scaled, as softmax_rows takes them
    for (long g = 0; g < groups; g++) {
        float *panel = qp + g * q_stride;
        Tiles::pack_x(q + i0 * ldq, ldq, rows, g * MR, D, panel);
        for (long e = 0; e < D * MR; e += Vec::N) Vec::store(panel + e, Vec::mul(Vec::load(panel + e), scaled));
    }
    // a panel of keys (in L1) against every group of queries that sees any of its positions
    for (long p = 0; p < span / NR; p++)
        for (long g = std::max(0L, (p * NR - first) / MR); g < groups; g++)
            Tiles::tile(D, qp + g * q_stride, kt + p * D * NR, s + g * MR * span + p * NR, span, true);
    for (long r = 0; r < groups * MR; r++) {  // weights past a row's own position: zero, as are spare rows
        float *row = s + r * span;
        const long valid = r < rows ? first + r + 1 : 0;
        if (valid) softmax_rows(row, valid, 1, inv + r);
        memset(row + valid, 0, (span - valid) * sizeof(float));
    }
    for (long g = 0; g < groups; g++) Tiles::pack_x(s, span, groups * MR, g * MR, span, pp + g * p_stride);
    // the values KC positions at a time (a column panel's block in L1), each group to the positions it sees
    for (long c = 0; c < D / NR; c++)
        for (long k0 = 0; k0 < span; k0 += KC)
            for (long g = 0; g < groups; g++) {
                const long depth = std::min({span, first + g * MR + MR, k0 + KC}) - k0;
                if (depth > 0)
                    Tiles::tile(depth, pp + g * p_stride + k0 * MR, vt + (c * Lp + k0) * NR, o + g * MR * D + c * NR,
                                D, k0 == 0);
            }
    for (long r = 0; r < rows; r++) {
        const Vec::F f = Vec::set1(inv[r]);
        for (long e = 0; e < D; e += Vec::N) Vec::store(out + (i0 + r) * ldo + e, Vec::mul(Vec::load(o + r * D + e), f));
    }
}

template <class Tiles, class TQ, class TC>
void prompt_attention_on(const TQ *q, long ldq, const TC *k, const TC *v, const long *ld, long T, long start, long H,
                         long Hkv, long D, float scale, TQ *out, int threads) {
    const long L = start + T, Lp = round_up(L, Tiles::NR), head_floats = Lp * D, G = H / Hkv;
    AlignedBuffer<float> packed((size_t)(2 * Hkv * head_floats));
    float *kt = packed.data(), *vt = kt + Hkv * head_floats;
    pool().run(Hkv, threads, [&](long h) {
        pack_kv_head<Tiles>(k + h * ld[1], ld[0], v + h * ld[3], ld[2], L, Lp, D, kt + h * head_floats,
                            vt + h * head_floats);
    });
    const long blocks = (T + PA_ROWS - 1) / PA_ROWS;
    pool().run(blocks * H, threads, [&](long c) {
        const long b = blocks - 1 - c / H, h = c % H, i0 = b * PA_ROWS;
        prompt_attention_rows<Tiles>(q + h * D, ldq, kt + (h / G) * head_floats, vt + (h / G) * head_floats, Lp, D,
                                     i0, start + i0, std::min(PA_ROWS, T - i0), scale, out + h * D, H * D);
    });
}

#if defined(LLK_AMX)
// The same attention with both products on AMX's tiles, for bf16 queries, keys and values: the scores in
// float32 (16 x 16 C tiles), the softmax in float32, its weights rounded to bf16 for the second product (as
// SDPA's bf16 flash kernel rounds them). Each kv head's keys are packed once as B tiles of 16 positions (the
// head's dimensions in pairs: 64 bytes a pair, 1 KB a tile of 32 dimensions) and its values as B tiles of 16
// dimensions (positions in pairs), zeros past the last position; a work item is AMX_PA_ROWS queries of one head.
// The bench model's layer (12 heads of 64) on an AMX Xeon (family 6 model 167, 2 vCPUs), medians of 15 alternated:
// 0.37 against SDPA's 0.47-0.58 ms at 256 tokens, 1.8 against 2.7-2.9 at 768 (the float32 kernel: 0.75-0.83, 4.6-5.1).
static constexpr long AMX_PA_ROWS = 48;

// kt: panel p (positions 16p..16p+15), dimension pair r: kt[((p * D / 2 + r) * 16 + j) * 2 + t] = k[16p + j][2r + t];
// vt: dimension block c (16 dimensions), position pair r: vt[((c * Lp / 2 + r) * 16 + e) * 2 + t] = v[2r + t][16c + e];
// zeros for positions from L (zero, not whatever memory holds: a zero weight times a NaN is NaN).
// Both move pairs of bf16 as one 32-bit word: a key's pair of dimensions, a dimension's pair of positions.
void amx_pack_kv_head(const bf16 *k, long ldk, const bf16 *v, long ldv, long L, long Lp, long D, bf16 *kt,
                      bf16 *vt) {
    // 16 keys by 16 dimension pairs at a time, transposed in registers (one pair at a time took 11% of a
    // 768-token prompt's attention)
    uint32_t *kw = (uint32_t *)kt;
    for (long j0 = 0; j0 < Lp; j0 += 16)
        for (long c = 0; c < D / 2; c += 16) {
            __m512i r[16];
            for (long j = 0; j < 16; j++)
                r[j] = j0 + j < L ? _mm512_loadu_si512(k + (j0 + j) * ldk + 2 * c) : _mm512_setzero_si512();
            transpose_words16(r);
            uint32_t *to = kw + j0 / 16 * 8 * D + c * 16;
            for (long i = 0; i < 16; i++) _mm512_storeu_si512(to + i * 16, r[i]);
        }
    const __m512i zero = _mm512_setzero_si512();
    for (long j = 0; j < Lp; j += 2) {
        const bf16 *even = v + j * ldv, *odd = even + ldv;
        for (long c = 0; c < D / 16; c++) {
            const __m512i lo = j < L ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(even + 16 * c))) : zero;
            const __m512i hi = j + 1 < L ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(odd + 16 * c))) : zero;
            _mm512_storeu_si512(vt + (c * Lp / 2 + j / 2) * 32, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
    }
}

// p[0, span) = bf16(exp(scale (s[t] - max))) for t < valid, zero after; returns 1 / their float32 sum. exp as
// 2^y (y = (s[t] - max) scale log2 e <= 0): exp2_fraction(y - round(y)) (the weights are rounded to bf16)
// scaled by 2^round(y) (scalef: 0 far below, no clamping). Half the instructions of vexp's, whose softmax took
// about a third of a 768-token prompt's attention here.
inline float amx_softmax_row(const float *s, long valid, long span, float scale, bf16 *p) {
    // four maxima, not one: one waited out vmaxps's latency for every 16 scores (a third of this function's time)
    __m512 m0 = _mm512_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
    long t = 0;
    for (; t + 64 <= valid; t += 64) {
        m0 = _mm512_max_ps(m0, _mm512_loadu_ps(s + t));
        m1 = _mm512_max_ps(m1, _mm512_loadu_ps(s + t + 16));
        m2 = _mm512_max_ps(m2, _mm512_loadu_ps(s + t + 32));
        m3 = _mm512_max_ps(m3, _mm512_loadu_ps(s + t + 48));
    }
    for (; t + 16 <= valid; t += 16) m0 = _mm512_max_ps(m0, _mm512_loadu_ps(s + t));
    float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3)));
    for (; t < valid; t++) mx = s[t] > mx ? s[t] : mx;
    const float a = scale * 1.44269504088896341f;
    const __m512 va = _mm512_set1_ps(a), vb = _mm512_set1_ps(-a * mx);
    __m512 sum = _mm512_setzero_ps();
    for (t = 0; t < valid; t += 16) {
        const __m512 y = _mm512_fmadd_ps(_mm512_loadu_ps(s + t), va, vb);
        const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m512 e = _mm512_scalef_ps(exp2_fraction(_mm512_sub_ps(y, n)), n);
        if (t + 16 > valid) e = _mm512_maskz_mov_ps((__mmask16)((1u << (valid - t)) - 1), e);  // past its position
        sum = _mm512_add_ps(sum, e);
        Vec::store(p + t, e);
    }
    memset(p + t, 0, (span - t) * sizeof(bf16));
    return 1.0f / _mm512_reduce_add_ps(sum);
}

// C tiles 0..n-1 (n <= 4) += A tile 4 times B tiles at b + i * b_step (1 KB each, rows 64 bytes apart).
template <int n>
__attribute__((target("amx-tile,amx-bf16"))) inline void amx_row_of_tiles(const bf16 *b, long b_step) {
    _tile_loadd(6, b, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (n > 1) {
        _tile_loadd(7, b + b_step, 64);
        _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (n > 2) {
        _tile_loadd(6, b + 2 * b_step, 64);
        _tile_dpbf16ps(2, 4, 6);
    }
    if constexpr (n > 3) {
        _tile_loadd(7, b + 3 * b_step, 64);
        _tile_dpbf16ps(3, 4, 7);
    }
}

// y (16 rows, ldy floats apart) columns [0, 16 n) = A (16 rows of K bf16, lda elements apart) times the B
// tiles b + s * s_step + i * b_step for column block i < n, k-step s < K / 32.
template <int n>
__attribute__((target("amx-tile,amx-bf16"))) void amx_block(const bf16 *a, long lda, long K, const bf16 *b,
                                                             long s_step, long b_step, float *y, long ldy) {
    _tile_zero(0);
    if constexpr (n > 1) _tile_zero(1);
    if constexpr (n > 2) _tile_zero(2);
    if constexpr (n > 3) _tile_zero(3);
    for (long s = 0; s < K / 32; s++) {
        _tile_loadd(4, a + 32 * s, lda * (long)sizeof(bf16));
        amx_row_of_tiles<n>(b + s * s_step, b_step);
    }
    _tile_stored(0, y, ldy * (long)sizeof(float));
    if constexpr (n > 1) _tile_stored(1, y + 16, ldy * (long)sizeof(float));
    if constexpr (n > 2) _tile_stored(2, y + 32, ldy * (long)sizeof(float));
    if constexpr (n > 3) _tile_stored(3, y + 48, ldy * (long)sizeof(float));
}

// amx_block over `blocks` column blocks, four at a time.
inline void amx_blocks(const bf16 *a, long lda, long K, const bf16 *b, long s_step, long b_step, long blocks,
                       float *y, long ldy) {
    for (long i = 0; i < blocks; i += 4) {
        const bf16 *bi = b + i * b_step;
        switch (std::min(4L, blocks - i)) {
            case 4: amx_block<4>(a, lda, K, bi, s_step, b_step, y + 16 * i, ldy); break;
            case 3: amx_block<3>(a, lda, K, bi, s_step, b_step, y + 16 * i, ldy); break;
            case 2: amx_block<2>(a, lda, K, bi, s_step, b_step, y + 16 * i, ldy); break;
            default: amx_block<1>(a, lda, K, bi, s_step, b_step, y + 16 * i, ldy);
        }
    }
}

// The products of amx_blocks (16 rows of y, columns [0, 16 blocks)) with AVX512_BF16's dot products, on a CPU
// without AMX: each 32-bit word of a B tile row (a pair of k for one column) against the same pair of an A row,
// broadcast; float32 sums, as the tiles keep them. 8 rows by 2 column blocks at a time: 16 accumulators.
// The bench model's layer (12 heads of 64) on a Zen 5 EPYC (2 vCPUs), best of 15 alternated: 0.21 against the
// float32 kernel's 0.39 ms at 256 tokens, 0.64 against 1.14 at 512, 1.37 against 2.41 at 768, the largest
// difference from float64 the same for both (7.5e-3, the output's rounding to bf16).
template <int n>
inline void dp_rows(const bf16 *a, long lda, long K, const bf16 *b, long s_step, long b_step, float *y, long ldy) {
    __m512 acc[8][n];
    for (int i = 0; i < 8; i++)
        for (int c = 0; c < n; c++) acc[i][c] = _mm512_setzero_ps();
    for (long s = 0; s < K / 32; s++) {
        const bf16 *bs = b + s * s_step, *as = a + 32 * s;
        for (long r = 0; r < 16; r++) {
            __m512bh bv[n];
            for (int c = 0; c < n; c++) bv[c] = (__m512bh)_mm512_loadu_si512(bs + c * b_step + r * 32);
            for (int i = 0; i < 8; i++) {
                uint32_t word;
                memcpy(&word, as + i * lda + 2 * r, sizeof word);
                const __m512bh av = (__m512bh)_mm512_set1_epi32((int)word);
                for (int c = 0; c < n; c++) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], av, bv[c]);
            }
        }
    }
    for (int i = 0; i < 8; i++)
        for (int c = 0; c < n; c++) _mm512_storeu_ps(y + i * ldy + 16 * c, acc[i][c]);
}

inline void dp_blocks(const bf16 *a, long lda, long K, const bf16 *b, long s_step, long b_step, long blocks,
                      float *y, long ldy) {
    for (long c = 0; c < blocks; c += 2)
        for (long half = 0; half < 16; half += 8) {
            const bf16 *ah = a + half * lda, *bc = b + c * b_step;
            float *yc = y + half * ldy + 16 * c;
            if (blocks - c >= 2) dp_rows<2>(ah, lda, K, bc, s_step, b_step, yc, ldy);
            else dp_rows<1>(ah, lda, K, bc, s_step, b_step, yc, ldy);
        }
}

// Queries [i0, i0 + rows) of the chunk (rows <= AMX_PA_ROWS), at positions from first = start + i0, one head,
// over its kv head's packed keys and values (Lp positions); the products on AMX's tiles (amx) or, with the same
// operands, AVX512_BF16's dot products (dp_blocks).
template <bool amx>
void bf16_prompt_attention_rows(const bf16 *q, long ldq, const bf16 *kt, const bf16 *vt, long Lp, long D, long i0,
                                long first, long rows, float scale, bf16 *out, long ldo) {
    thread_local std::vector<float, AlignedAlloc<float>> floats;
    thread_local std::vector<bf16, AlignedAlloc<bf16>> halves;
    const long groups = (rows + 15) / 16, span = round_up(first + rows, 32);
    float *s = grown(floats, (size_t)(16 * span + 16 * D)), *o = s + 16 * span;
    bf16 *qg = grown(halves, (size_t)(16 * D + 16 * span)), *p = qg + 16 * D;
    float inv[16];
    const auto blocks = amx ? amx_blocks : dp_blocks;
    if constexpr (amx) amx_configure(16);
    for (long g = 0; g < groups; g++) {
        const long r0 = g * 16, n = std::min(16L, rows - r0), seen = first + r0 + n, depth = round_up(seen, 32);
        for (long r = 0; r < 16; r++) {  // the group's queries, zeros past the last (a tile reads 16 rows)
            if (r < n) memcpy(qg + r * D, q + (i0 + r0 + r) * ldq, D * sizeof(bf16));
            else memset(qg + r * D, 0, D * sizeof(bf16));
        }
        blocks(qg, D, D, kt, 16 * 32, 16 * D, round_up(seen, 16) / 16, s, span);
        for (long r = 0; r < 16; r++) {
            if (r < n) inv[r] = amx_softmax_row(s + r * span, first + r0 + r + 1, depth, scale, p + r * span);
            else memset(p + r * span, 0, depth * sizeof(bf16));
        }
        blocks(p, span, depth, vt, 16 * 32, Lp / 2 * 32, D / 16, o, D);
        for (long r = 0; r < n; r++) {
            const Vec::F f = Vec::set1(inv[r]);
            bf16 *to = out + (i0 + r0 + r) * ldo;
            for (long e = 0; e < D; e += Vec::N) Vec::store(to + e, Vec::mul(Vec::load(o + r * D + e), f));
        }
    }
    if constexpr (amx) amx_release();
}

// bf16 queries over bf16 keys and values on AMX's tiles where the CPU has them (and not `dot_only`), else with
// AVX512_BF16's dot products.
bool bf16_prompt_attention_on(const bf16 *q, long ldq, const bf16 *k, const bf16 *v, const long *ld, long T,
                              long start, long H, long Hkv, long D, float scale, bf16 *out, int threads,
                              bool dot_only) {
    if (D % 32 != 0) return false;
    const bool amx = !dot_only && amx_usable();
    const long L = start + T, Lp = round_up(L, 32), head = Lp * D, G = H / Hkv;
    thread_local std::vector<bf16, AlignedAlloc<bf16>> packed;  // every element written by amx_pack_kv_head
    bf16 *kt = grown(packed, (size_t)(2 * Hkv * head)), *vt = kt + Hkv * head;
    pool().run(Hkv, threads, [&](long h) {
        amx_pack_kv_head(k + h * ld[1], ld[0], v + h * ld[3], ld[2], L, Lp, D, kt + h * head, vt + h * head);
    });
    const long blocks = (T + AMX_PA_ROWS - 1) / AMX_PA_ROWS;
    pool().run(blocks * H, threads, [&](long c) {
        const long b = blocks - 1 - c / H, h = c % H, i0 = b * AMX_PA_ROWS;
        const auto rows = amx ? bf16_prompt_attention_rows<true> : bf16_prompt_attention_rows<false>;
        rows(q + h * D, ldq, kt + (h / G) * head, vt + (h / G) * head, Lp, D, i0, start + i0,
             std::min(AMX_PA_ROWS, T - i0), scale, out + h * D, H * D);
    });
    return true;
}
#endif

// `tiles`: 0, the float32 products; 1, bf16 queries, keys and values in bf16 products (AMX's tiles where the CPU
// has them, else AVX512_BF16's dot products); 2, those on the dot products even on an AMX CPU. False where the
// bf16 products do not run (nothing done).
template <class TQ, class TC>
bool prompt_attention(const TQ *q, long ldq, const TC *k, const TC *v, const long *ld, long T, long start, long H,
                      long Hkv, long D, float scale, TQ *out, int threads, int tiles) {
    if (tiles) {
#if defined(LLK_AMX)
        if constexpr (std::is_same_v<TQ, bf16> && std::is_same_v<TC, bf16>)
            return bf16_prompt_attention_on(q, ldq, k, v, ld, T, start, H, Hkv, D, scale, out, threads, tiles == 2);
#endif
        return false;
    }
#if defined(LLK_VEC512)
    if (D % Tiles512::NR == 0) {
        prompt_attention_on<Tiles512>(q, ldq, k, v, ld, T, start, H, Hkv, D, scale, out, threads);
        return true;
    }
#endif
    prompt_attention_on<Tiles256>(q, ldq, k, v, ld, T, start, H, Hkv, D, scale, out, threads);
    return true;
}

// ---------------------------------------------------------------------------------------------
// The small operations of a step, fused: one call each instead of 3-8 torch ops, rounding to the
// model's dtype T after each op they replace, as torch does, so that they compute what those
// ops compute (bit for bit but for exp, and for the order of a norm's float32 sum).

template <class T>
inline float rounded_scalar(float v) {
    if constexpr (sizeof(T) == 2) return bf16_to_f32(f32_to_bf16(v));
    else return v;
}

// Run body(first, last) over [0, count) split across threads when the work is worth a fork.
template <class Body>
inline void split_rows(long count, long work, int threads, Body body) {
    if (threads <= 1 || count < 2 || work < (1 << 15)) {
        body(0, count);
        return;
    }
    const long chunks = count < 4L * threads ? count : 4L * threads;
    pool().run(chunks, threads, [&](long c) { body(count * c / chunks, count * (c + 1) / chunks); });
}

// hidden += delta (when given), then out = weight * rms_norm(hidden) as HF's LlamaRMSNorm computes
// it: x * rsqrt(mean(x^2) + eps) in float32, rounded to T, times the weight, rounded to T.
template <class T>
void add_rmsnorm(T *hidden, const T *delta, const T *weight, T *out, long rows, long D, float eps, int threads) {
    split_rows(rows, rows * D, threads, [&](long r0, long r1) {
        for (long r = r0; r < r1; r++) {
            T *h = hidden + r * D;
            const T *dl = delta ? delta + r * D : nullptr;
            Vec::F sq = Vec::zero();
            long d = 0;
            for (; d + Vec::N <= D; d += Vec::N) {
                Vec::F x = Vec::load(h + d);
                if (dl) {
                    x = rounded<T>(Vec::add(x, Vec::load(dl + d)));
                    Vec::store(h + d, x);
                }
                sq = Vec::fma(x, x, sq);
            }
            float sum = Vec::hsum(sq);
            for (; d < D; d++) {
                float x = to_f32(h[d]);
                if (dl) {
                    x = rounded_scalar<T>(x + to_f32(dl[d]));
                    store_scalar(h + d, x);
                }
                sum += x * x;
            }
            const float inv_rms = 1.0f / sqrtf(sum / (float)D + eps);
            const Vec::F scale = Vec::set1(inv_rms);
            for (d = 0; d + Vec::N <= D; d += Vec::N) {
                Vec::F x = rounded<T>(Vec::mul(Vec::load(h + d), scale));
                Vec::store(out + r * D + d, Vec::mul(Vec::load(weight + d), x));
            }
            for (; d < D; d++)
                store_scalar(out + r * D + d, to_f32(weight[d]) * rounded_scalar<T>(to_f32(h[d]) * inv_rms));
        }
    });
}

// out[r, i] = silu(gate) * up for gate_up's row r = [gate (I) | up (I)]: silu(gate) rounded to T, times up,
// rounded to T.
template <class T>
void silu_mul(const T *gate_up, T *out, long rows, long I, int threads) {
    split_rows(rows, rows * I, threads, [&](long r0, long r1) {
        for (long r = r0; r < r1; r++) {
            const T *g = gate_up + r * 2 * I, *u = g + I;
            T *o = out + r * I;
            long i = 0;
            for (; i + Vec::N <= I; i += Vec::N)
                Vec::store(o + i, Vec::mul(rounded<T>(silu<T>(Vec::load(g + i))), Vec::load(u + i)));
            if (i < I) {  // the last elements, through the same silu (no libm: see busy_)
                float gate[Vec::N] = {0}, act[Vec::N];
                for (long j = 0; i + j < I; j++) gate[j] = to_f32(g[i + j]);
                Vec::store(act, silu<T>(Vec::load(gate)));
                for (long j = 0; i + j < I; j++) store_scalar(o + i + j, rounded_scalar<T>(act[j]) * to_f32(u[i + j]));
            }
        }
    });
}

// Each row of w [N, K] (float32 or bf16) as int8 values q with a float32 scale, as int8_rows.quantize computes
// them in torch, bit for bit: scale = the row's largest magnitude / 127, q = w / scale (or w / 1 for a row of
// zeros) rounded to nearest even and clamped to +-127. One read of the weight, where torch's ops take six passes
// over a float32 copy (3.8 ns a value on a Zen 3: 25 s of a 7B model's load). false where a row holds an inf or
// a NaN (w * 0 is NaN only for them; the rows' values are then not all written).
template <class T>
bool quantize_rows(const T *w, int8_t *q, float *scales, long N, long K, int threads) {
    std::atomic<bool> finite{true};
    split_rows(N, N * K, threads, [&](long r0, long r1) {
        float tail[Vec::N];
        for (long n = r0; n < r1; n++) {
            const T *row = w + n * K;
            Vec::F low = Vec::zero(), high = Vec::zero(), poison = Vec::zero();
            long k = 0;
            for (; k + Vec::N <= K; k += Vec::N) {
                Vec::F v = Vec::load(row + k);
                low = Vec::min(low, v), high = Vec::max(high, v), poison = Vec::fma(v, Vec::zero(), poison);
            }
            float largest = std::max(Vec::hmax(high), Vec::hmax(Vec::sub(Vec::zero(), low))), bad = Vec::hsum(poison);
            for (long j = k; j < K; j++) {
                float v = to_f32(row[j]);
                largest = std::max(largest, fabsf(v)), bad += v * 0.0f;
            }
            if (bad != 0.0f) {  // NaN
                finite = false;
                return;
            }
            const float scale = largest / 127.0f;
            const Vec::F divisor = Vec::set1(scale > 0.0f ? scale : 1.0f), top = Vec::set1(127.0f);
            const Vec::F bottom = Vec::set1(-127.0f);
            int8_t *out = q + n * K;
            for (k = 0; k + Vec::N <= K; k += Vec::N)
                Vec::store(out + k, Vec::min(Vec::max(Vec::round(Vec::div(Vec::load(row + k), divisor)), bottom), top));
            if (k < K) {
                for (long j = 0; j < Vec::N; j++) tail[j] = k + j < K ? to_f32(row[k + j]) : 0.0f;
                Vec::store(tail, Vec::min(Vec::max(Vec::round(Vec::div(Vec::load(tail), divisor)), bottom), top));
                for (long j = 0; k + j < K; j++) out[k + j] = (int8_t)tail[j];
            }
            scales[n] = scale;
        }
    });
    return finite;
}

// out [N, K] (float32 or bf16) = each row of the int8 weight q times its scale, rounded once to T: the weight a
// product of many rows multiplies on oneDNN (a bf16 copy under AMX or AVX512_BF16's dot product).
template <class T>
void dequantize_rows(const int8_t *q, const float *scales, T *out, long N, long K, int threads) {
    split_rows(N, N * K, threads, [&](long r0, long r1) {
        for (long n = r0; n < r1; n++) {
            const int8_t *row = q + n * K;
            T *to = out + n * K;
            const Vec::F scale = Vec::set1(scales[n]);
            long k = 0;
            for (; k + Vec::N <= K; k += Vec::N) Vec::store(to + k, Vec::mul(Vec::load(row + k), scale));
            for (; k < K; k++) store_scalar(to + k, (float)row[k] * scales[n]);
        }
    });
}

// Llama's rotary embedding of the q and k heads of each token's fused q/k/v row, in place, then its
// k and v written to the cache. Row t of qkv ([tokens, (H + 2 Hkv) D], rows ldq apart) sits at
// position positions[t] of slot slots[t]; cos and ssin are [positions, D] tables in T, ssin's
// first half negated, so that the rotation is x * cos + roll(x, D / 2) * ssin, each product
// rounded to T and their sum rounded to T (torch's _rotate).
template <class T, class TC>
void rope_store(T *qkv, long ldq, long tokens, long H, long Hkv, long D, const T *cos, const T *ssin,
                const int64_t *positions, const int64_t *slots, TC *k_cache, TC *v_cache, long Lmax, int threads) {
    const long half = D / 2;
    split_rows(tokens, tokens * (H + 2 * Hkv) * D, threads, [&](long t0, long t1) {
        for (long t = t0; t < t1; t++) {
            T *row = qkv + t * ldq;
            const T *c = cos + positions[t] * D, *sn = ssin + positions[t] * D;
            for (long h = 0; h < H + Hkv; h++) {
                T *x = row + h * D;
                float rotated[512];
                for (long d = 0; d < D; d += Vec::N) {
                    // roll(x, D / 2)[d], without a division by the runtime D in the loop (11% of this op's time)
                    Vec::F partner = Vec::load(x + (d < half ? d + half : d - half));
                    Vec::F a = rounded<T>(Vec::mul(Vec::load(x + d), Vec::load(c + d)));
                    Vec::F b = rounded<T>(Vec::mul(partner, Vec::load(sn + d)));
                    Vec::store(rotated + d, Vec::add(a, b));
                }
                for (long d = 0; d < D; d += Vec::N) Vec::store(x + d, Vec::load(rotated + d));
            }
            const long cache_row = ((slots[t] * Hkv) * Lmax + positions[t]) * D;
            for (long h = 0; h < Hkv; h++) {
                const T *k = row + (H + h) * D, *v = row + (H + Hkv + h) * D;
                TC *kd = k_cache + cache_row + h * Lmax * D, *vd = v_cache + cache_row + h * Lmax * D;
                for (long d = 0; d < D; d += Vec::N) {
                    Vec::store(kd + d, Vec::load(k + d));
                    Vec::store(vd + d, Vec::load(v + d));
                }
            }
        }
    });
}

// ---------------------------------------------------------------------------------------------
// A decode step's decoder layers in one call: each of `M` rows is one token of its own slot, and
// every layer runs the ops the torch backend's fused forward calls one by one from Python
// (add_rmsnorm, the q/k/v product, rope_store, decode_attention, o_proj, add_rmsnorm, the
// gate/up product, silu_mul, down_proj), in that order, with the same kernels: the same numbers.
// Python's layer loop, its ~110 calls through ctypes and their tensors, cost a one-row step of the
// bench model ~4 ms (14.8 against 10.7 ms median in one call; Zen 3 EPYC, 2 threads).
//
// `weights` holds 6 pointers per layer: input norm, q/k/v [(H + 2 Hkv) Dh, D], o [D, H Dh], post-
// attention norm, gate/up [2 I, D], down [D, I]; `caches` 2 per layer: k, v [slots, Hkv, Lmax, Dh].
// `hidden` [M, D] gets every layer's residual but the last's, which is left in `delta` [M, D] (the
// final norm adds it; with a Head, the call adds it, and its logits follow). `scratch` holds
// M (D + (H + 2 Hkv) Dh + H Dh + 3 I) elements of T.
struct StepShape {
    long M, D, H, Hkv, Dh, I, Lmax, layers;
};

// One product of a decode step: w in its plain layout, or (PAIRS, the AVX-512 builds) in pair panels.
template <class T, class TW, bool PAIRS>
inline void step_linear(const T *x, long ldx, const void *w, T *y, long ldy, long M, long K, long N, int threads,
                        long one_row_prefetch) {
#if defined(LLK_VEC512)
    if constexpr (PAIRS) {
        linear_pairs<T>(x, ldx, (const bf16 *)w, y, ldy, M, K, N, threads);
        return;
    }
#endif
    linear<T, TW>(x, ldx, (const TW *)w, y, ldy, M, K, N, threads, one_row_prefetch);
}

// act[M, I] = silu(gate) * up of x's gate/up product (w [2 I, K]): in one pass on the tiles where they take it
// (amx_gate_up_silu), else the product into gate_up [M, 2 I], then silu_mul. The same numbers either way; true
// for the one pass.
template <class T, class TW, bool PAIRS>
inline bool gate_up_act(const T *x, long ldx, const void *w, T *gate_up, T *act, long M, long K, long I, int threads,
                        long one_row_prefetch) {
#if defined(LLK_AMX)
    if constexpr (PAIRS && std::is_same_v<T, bf16>)
        if (amx_gate_up_silu(x, ldx, (const bf16 *)w, act, I, M, K, I, threads)) return true;
#endif
    step_linear<T, TW, PAIRS>(x, ldx, w, gate_up, 2 * I, M, K, 2 * I, threads, one_row_prefetch);
    silu_mul<T>(gate_up, act, M, I, threads);
    return false;
}

// Prompt chunks run by decode_layers after its decode rows: chunk c is rows [row0, row0 + rows) of the pass, at
// positions [start, start + rows) of one slot, and attends as the torch backend's native prompt part does
// (prompt_attention over its own keys and values for a first chunk, else over the slot's cache; in bf16 products
// with `tiles`). In the last layer only the rows with logits run on, each as a decode row (the fused forward's
// way): the decode rows, then each chunk's last row, moved up to rows [0, decode rows + chunks).
struct PromptChunk {
    long row0, rows, slot, start;
};
struct PromptChunks {
    long count;
    const PromptChunk *chunk;
    int tiles;  // prompt_attention's
};

// The model's head after the last layer, where the call runs it: the final norm's weight (T), the LM head's
// weight [vocab, D] in the layers' layout, where the rows with logits' logits go ([rows, vocab] of T), and
// where they go widened to float32 (`logits32`, the same memory when T is float) with each row's greedy
// choice (greedy_picks). Null `w`: the call stops at the last layer's residual.
struct Head {
    const void *norm;
    const void *w;
    long vocab;
    void *logits;
    float *logits32;
    int64_t *best;
    float *logprob;
};

// Each row of `logits` widened to float32 into `out` (which may be `logits` itself), the index of its first
// largest value (of its first NaN, if it has one), as torch.argmax picks, and that value's log-probability,
// -log(sum(exp(x - max))), log_softmax's at that index. Here the row is still in the caches: from Python, the
// same four calls after a step of the bench model took ~0.3 ms on an AMX Xeon, each refilling the caches the
// step had flushed.
template <class T>
void greedy_picks(const T *logits, float *out, int64_t *best, float *logprob, long rows, long vocab, int threads) {
    pool().run(rows, threads, [&](long r) {
        const T *x = logits + r * vocab;
        float *y = out + r * vocab;
        long j = 0;
        if ((const void *)x != (const void *)y) {
            for (; j + Vec::N <= vocab; j += Vec::N) Vec::store(y + j, Vec::load(x + j));
            for (; j < vocab; j++) y[j] = to_f32(x[j]);
        }
        long arg = 0;
        float top = y[0];
        for (j = 1; j < vocab && top == top; j++)
            if (y[j] > top || y[j] != y[j]) top = y[arg = j];
        const Vec::F shift = Vec::set1(top);
        Vec::F sum = Vec::zero();
        for (j = 0; j + Vec::N <= vocab; j += Vec::N) sum = Vec::add(sum, vexp(Vec::sub(Vec::load(y + j), shift)));
        float total = Vec::hsum(sum);
        for (; j < vocab; j++) total += expf(y[j] - top);
        best[r] = arg;
        logprob[r] = -logf(total);
    });
}

template <class T, class TC>
int chunk_attention(const PromptChunk &c, int tiles, const T *qkv, long QKV, const TC *k, const TC *v,
                    const StepShape &s, float scale, T *attn, int threads) {
    const long H = s.H, Hkv = s.Hkv, Dh = s.Dh, HD = H * Dh;
    const T *q = qkv + c.row0 * QKV;
    T *out = attn + c.row0 * HD;
    bool done;
    if (c.start == 0) {
        const long ld[4] = {QKV, Dh, QKV, Dh};
        done = prompt_attention<T, T>(q, QKV, q + H * Dh, q + (H + Hkv) * Dh, ld, c.rows, 0, H, Hkv, Dh, scale, out,
                                      threads, tiles);
    } else {
        const long ld[4] = {Dh, s.Lmax * Dh, Dh, s.Lmax * Dh}, base = c.slot * Hkv * s.Lmax * Dh;
        done = prompt_attention<T, TC>(q, QKV, k + base, v + base, ld, c.rows, c.start, H, Hkv, Dh, scale, out,
                                       threads, tiles);
    }
    return done ? 0 : -3;
}

template <class T, class TW, class TC, bool PAIRS = false>
int decode_layers(T *hidden, T *delta, T *scratch, const StepShape &s, const void *const *weights,
                  void *const *caches, const T *cos, const T *ssin, const int64_t *positions, const int64_t *slots,
                  const int64_t *lens, float eps, float scale, int threads, long one_row_prefetch,
                  const PromptChunks &chunks, const Head &head) {
    long M = s.M;
    const long D = s.D, QKV = (s.H + 2 * s.Hkv) * s.Dh, HD = s.H * s.Dh, I = s.I;
    T *normed = scratch, *qkv = normed + M * D, *attn = qkv + M * QKV, *gate_up = attn + M * HD,
      *act = gate_up + M * 2 * I;
    const long R = chunks.count ? chunks.chunk[0].row0 : M;  // the decode rows
    std::vector<int64_t> last_slots, last_lens;  // the rows with logits' in the last layer
    for (long l = 0; l < s.layers; l++) {
        const void *const *w = weights + 6 * l;
        TC *k = (TC *)caches[2 * l], *v = (TC *)caches[2 * l + 1];
        add_rmsnorm<T>(hidden, l ? delta : nullptr, (const T *)w[0], normed, M, D, eps, threads);
        step_linear<T, TW, PAIRS>(normed, D, w[1], qkv, QKV, M, D, QKV, threads, one_row_prefetch);
        rope_store<T, TC>(qkv, QKV, M, s.H, s.Hkv, s.Dh, cos, ssin, positions, slots, k, v, s.Lmax, threads);
        int code = 0;
        if (chunks.count && l + 1 == s.layers) {  // the decode rows and each chunk's last row, as decode rows
            last_slots.assign(slots, slots + R);
            last_lens.assign(lens, lens + R);
            for (long c = 0; c < chunks.count; c++) {
                const long from = chunks.chunk[c].row0 + chunks.chunk[c].rows - 1, to = R + c;
                memmove(hidden + to * D, hidden + from * D, D * sizeof(T));
                memmove(qkv + to * QKV, qkv + from * QKV, QKV * sizeof(T));
                last_slots.push_back(slots[from]);
                last_lens.push_back(lens[from]);
            }
            M = R + chunks.count;
            code = decode_attention_d<T, TC>(qkv, QKV, k, v, last_slots.data(), last_lens.data(), M, s.H, s.Hkv,
                                             s.Lmax, s.Dh, scale, attn, threads);
        } else {
            if (R > 0)
                code = decode_attention_d<T, TC>(qkv, QKV, k, v, slots, lens, R, s.H, s.Hkv, s.Lmax, s.Dh, scale,
                                                 attn, threads);
            for (long c = 0; c < chunks.count && !code; c++)
                code = chunk_attention<T, TC>(chunks.chunk[c], chunks.tiles, qkv, QKV, k, v, s, scale, attn, threads);
        }
        if (code) return code;
        step_linear<T, TW, PAIRS>(attn, HD, w[2], delta, D, M, HD, D, threads, one_row_prefetch);
        add_rmsnorm<T>(hidden, delta, (const T *)w[3], normed, M, D, eps, threads);
        gate_up_act<T, TW, PAIRS>(normed, D, w[4], gate_up, act, M, D, I, threads, one_row_prefetch);
        step_linear<T, TW, PAIRS>(act, I, w[5], delta, D, M, I, D, threads, one_row_prefetch);
    }
    if (head.w) {  // what the backend called next from Python, with the same kernels
        add_rmsnorm<T>(hidden, delta, (const T *)head.norm, normed, M, D, eps, threads);
        step_linear<T, TW, PAIRS>(normed, D, head.w, (T *)head.logits, head.vocab, M, D, head.vocab, threads,
                                  one_row_prefetch);
        greedy_picks<T>((const T *)head.logits, head.logits32, head.best, head.logprob, M, head.vocab, threads);
    }
    return 0;
}

// The weight dtype code of bf16 weights in pair panels (0 float32, 1 bfloat16).
static constexpr int PAIRS_CODE = 2;

}  // namespace

LLK_API const char *llk_isa(void) { return ISA; }

// 0 on success, -1 for an unsupported pair of dtypes. y is in x's dtype.
// one_row_prefetch: how far ahead (bytes) a product of one row of x prefetches w; 0 for the default.
LLK_API int llk_linear(const void *x, long ldx, int x_dtype, const void *w, int w_dtype, void *y, long ldy, long M,
                       long K, long N, int threads, long one_row_prefetch) {
    if (x_dtype == 0 && w_dtype == 0) {
        linear<float, float>((const float *)x, ldx, (const float *)w, (float *)y, ldy, M, K, N, threads, one_row_prefetch);
        return 0;
    }
    if (x_dtype == 0 && w_dtype == 1) {
        linear<float, bf16>((const float *)x, ldx, (const bf16 *)w, (float *)y, ldy, M, K, N, threads, one_row_prefetch);
        return 0;
    }
    if (x_dtype == 1 && w_dtype == 1) {
        linear<bf16, bf16>((const bf16 *)x, ldx, (const bf16 *)w, (bf16 *)y, ldy, M, K, N, threads, one_row_prefetch);
        return 0;
    }
    if (w_dtype == INT8_CODE && (x_dtype == 0 || x_dtype == 1)) {
        if (x_dtype == 0)
            linear<float, int8_t>((const float *)x, ldx, (const int8_t *)w, (float *)y, ldy, M, K, N, threads,
                                  one_row_prefetch);
        else
            linear<bf16, int8_t>((const bf16 *)x, ldx, (const int8_t *)w, (bf16 *)y, ldy, M, K, N, threads,
                                 one_row_prefetch);
        return 0;
    }
#if defined(LLK_VEC512)
    if (w_dtype == PAIRS_CODE && K % 2 == 0 && N % PANEL_COLS == 0) {
        if (x_dtype == 0) linear_pairs<float>((const float *)x, ldx, (const bf16 *)w, (float *)y, ldy, M, K, N, threads);
        else if (x_dtype == 1) linear_pairs<bf16>((const bf16 *)x, ldx, (const bf16 *)w, (bf16 *)y, ldy, M, K, N, threads);
        else return -1;
        return 0;
    }
#endif
    return -1;
}

// tiles_only for x_dtype activations over w_dtype weights (codes as llk_linear's): 1 or 0; -1 for a pair it does
// not multiply.
LLK_API int llk_tiles_only(int x_dtype, int w_dtype) {
    if (x_dtype == 1 && w_dtype == INT8_CODE) return tiles_only<bf16, int8_t>();
    if (x_dtype == 0 && w_dtype == INT8_CODE) return tiles_only<float, int8_t>();
    if (x_dtype == 0 && (w_dtype == 0 || w_dtype == 1)) return tiles_only<float, float>();
    if (x_dtype == 1 && w_dtype == 1) return tiles_only<bf16, bf16>();
    return -1;
}

// The fewest rows of x_dtype activations over w_dtype weights that this build multiplies as int16 rows
// (quantize_rows_i16): 0 where it never does.
LLK_API long llk_int16_min_rows(int x_dtype, int w_dtype) {
#if defined(LLK_AVX2)
    if (x_dtype == 0 && w_dtype == INT8_CODE) return I16_MIN_ROWS;
#endif
    (void)x_dtype, (void)w_dtype;
    return 0;
}

// The fewest rows of a bf16 product over pair panels that run on AMX's tiles: 0 where this build or CPU has
// none. set > 0 sets it first (tests and A/B probes), set 0 turns the tiles off.
LLK_API long llk_amx_min_rows(long set) {
#if defined(LLK_AMX)
    if (!amx_usable()) return 0;
    if (set >= 0) amx_min_rows.store(set, std::memory_order_relaxed);
    return amx_min_rows.load(std::memory_order_relaxed);
#else
    (void)set;
    return 0;
#endif
}

// 1 where this build runs bf16 prompt attention in bf16 products (prompt_attention's `tiles`), else 0: the
// avx512bf16 build from a compiler that has AMX's intrinsics (the dot products share that code).
LLK_API int llk_bf16_prompt_products(void) {
#if defined(LLK_AMX)
    return 1;
#else
    return 0;
#endif
}

// 1 where this build and CPU run AMX's tiles, else 0.
LLK_API int llk_amx_usable(void) {
#if defined(LLK_AMX)
    return amx_usable() ? 1 : 0;
#else
    return 0;
#endif
}

// The pair panels (see pack_pairs) of the bf16 weight w [N, K] into P (N K elements: w itself, or apart from
// it), where this build has them: 0, or -1 (another build, K odd, or N not a multiple of the panels' columns).
LLK_API int llk_pack_pairs(const void *w, void *P, long K, long N) {
#if defined(LLK_VEC512)
    if (K % 2 == 0 && N % PANEL_COLS == 0 && K > 0 && N > 0) {
        pack_pairs((const bf16 *)w, (bf16 *)P, K, N);
        return 0;
    }
#endif
    (void)w, (void)P, (void)K, (void)N;
    return -1;
}

// A prompt chunk's causal attention (prompt_attention): q and out float32 or bf16 (q_dtype), keys
// and values float32 or bf16 (kv_dtype), arithmetic in float32; with `tiles` (prompt_attention's), all bf16 in
// bf16 products, the softmax's weights rounded to bf16. 0 on success, -1 for a dtype neither of those or a head
// size not a multiple of 16, -2 for a head count that is not a multiple of the kv heads', -3 for bf16 products
// where they do not run (not the avx512bf16 build, a dtype not bf16, a head size not a multiple of 32). ld: k's position and head strides,
// then v's.
LLK_API int llk_prompt_attention(const void *q, long ldq, int q_dtype, const void *k, const void *v, int kv_dtype,
                                 const long *ld, long T, long start, long H, long Hkv, long D, float scale, void *out,
                                 int threads, int tiles) {
    if ((q_dtype != 0 && q_dtype != 1) || (kv_dtype != 0 && kv_dtype != 1) || D % GEMM_NR != 0 || D <= 0) return -1;
    if (Hkv < 1 || H % Hkv != 0) return -2;
    if (T <= 0) return 0;
    bool done = false;
    auto run = [&](auto *q_typed, auto *kv_typed) {
        using TQ = std::remove_const_t<std::remove_pointer_t<decltype(q_typed)>>;
        using TC = std::remove_const_t<std::remove_pointer_t<decltype(kv_typed)>>;
        done = prompt_attention((const TQ *)q, ldq, (const TC *)k, (const TC *)v, ld, T, start, H, Hkv, D, scale,
                                (TQ *)out, threads, tiles);
    };
    const float *f32 = nullptr;
    const bf16 *b16 = nullptr;
    if (q_dtype == 0) {
        if (kv_dtype == 0) run(f32, f32);
        else run(f32, b16);
    } else {
        if (kv_dtype == 0) run(b16, f32);
        else run(b16, b16);
    }
    return done ? 0 : -3;
}

// 0 on success, -1 for an unsupported dtype or head size, -2 for a head count that is not a
// multiple of the kv heads' or a group of more than 64 query heads per kv head. q's rows are
// ldq elements apart; out is contiguous.
LLK_API int llk_decode_attention(const void *q, long ldq, int q_dtype, const void *k, const void *v, int kv_dtype,
                                 const int64_t *slots, const int64_t *lens, long rows, long H, long Hkv, long Lmax,
                                 long D, float scale, void *out, int threads) {
    if (Hkv < 1 || H % Hkv != 0 || H / Hkv > 64) return -2;
#define LLK_TYPES(TQ, TC) \
    return decode_attention_d<TQ, TC>(q, ldq, k, v, slots, lens, rows, H, Hkv, Lmax, D, scale, out, threads)
    if (q_dtype == 1 && kv_dtype == 1) LLK_TYPES(bf16, bf16);
    if (q_dtype == 1 && kv_dtype == 0) LLK_TYPES(bf16, float);
    if (q_dtype == 0 && kv_dtype == 0) LLK_TYPES(float, float);
    if (q_dtype == 0 && kv_dtype == 1) LLK_TYPES(float, bf16);
#undef LLK_TYPES
    return -1;
}

// 0 on success, -1 for an unsupported dtype. delta may be null.
LLK_API int llk_add_rmsnorm(void *hidden, const void *delta, const void *weight, void *out, long rows, long D,
                            float eps, int dtype, int threads) {
    if (dtype == 0) add_rmsnorm<float>((float *)hidden, (const float *)delta, (const float *)weight, (float *)out,
                                       rows, D, eps, threads);
    else if (dtype == 1) add_rmsnorm<bf16>((bf16 *)hidden, (const bf16 *)delta, (const bf16 *)weight, (bf16 *)out,
                                           rows, D, eps, threads);
    else return -1;
    return 0;
}

// w [N, K] (dtype 0 float32, 1 bfloat16) quantized into q: int8 [N, K] with its N scales from the next multiple
// of 64 bytes (quantize_rows, row_scales). 0 on success, -1 for another dtype, -2 where w holds an inf or a NaN.
LLK_API int llk_quantize_rows(const void *w, int dtype, void *q, long N, long K, int threads) {
    float *scales = (float *)row_scales((const int8_t *)q, N, K);
    bool finite;
    if (dtype == 0) finite = quantize_rows((const float *)w, (int8_t *)q, scales, N, K, threads);
    else if (dtype == 1) finite = quantize_rows((const bf16 *)w, (int8_t *)q, scales, N, K, threads);
    else return -1;
    return finite ? 0 : -2;
}

// out [N, K] (dtype 0 float32, 1 bfloat16) = the int8 weight q [N, K] with its scales (dequantize_rows).
// 0 on success, -1 for another dtype.
LLK_API int llk_dequantize_rows(const void *q, void *out, int dtype, long N, long K, int threads) {
    const float *scales = row_scales((const int8_t *)q, N, K);
    if (dtype == 0) dequantize_rows((const int8_t *)q, scales, (float *)out, N, K, threads);
    else if (dtype == 1) dequantize_rows((const int8_t *)q, scales, (bf16 *)out, N, K, threads);
    else return -1;
    return 0;
}

// 0 on success, -1 for an unsupported dtype.
LLK_API int llk_silu_mul(const void *gate_up, void *out, long rows, long I, int dtype, int threads) {
    if (dtype == 0) silu_mul<float>((const float *)gate_up, (float *)out, rows, I, threads);
    else if (dtype == 1) silu_mul<bf16>((const bf16 *)gate_up, (bf16 *)out, rows, I, threads);
    else return -1;
    return 0;
}

// act[M, I] = silu(gate) * up of bf16 x's product with a gate/up weight [gate (I) | up (I), K] in pair panels, as
// decode_layers computes it: 1 where the tiles ran it in one pass, 0 where the product then silu_mul did (the same
// numbers), -1 where this build has no pair panels or they do not fit the shapes.
LLK_API int llk_gate_up_silu(const void *x, long ldx, const void *w, void *act, long M, long K, long I, int threads) {
#if defined(LLK_VEC512)
    if (M <= 0 || K <= 0 || I <= 0 || K % 2 != 0 || (2 * I) % PANEL_COLS != 0) return -1;
    std::vector<bf16> gate_up((size_t)(M * 2 * I));
    return gate_up_act<bf16, bf16, true>((const bf16 *)x, ldx, w, gate_up.data(), (bf16 *)act, M, K, I, threads, 0);
#else
    (void)x, (void)ldx, (void)w, (void)act, (void)M, (void)K, (void)I, (void)threads;
    return -1;
#endif
}

// 0 on success, -1 for an unsupported dtype pair or a head size that is not a multiple of the
// vector width (or over 512).
LLK_API int llk_rope_store(void *qkv, long ldq, long tokens, long H, long Hkv, long D, const void *cos,
                           const void *ssin, const int64_t *positions, const int64_t *slots, void *k_cache,
                           void *v_cache, long Lmax, int dtype, int kv_dtype, int threads) {
    if (D % (2 * Vec::N) != 0 || D > 512) return -1;
#define LLK_ROPE(T, TC)                                                                                       \
    rope_store<T, TC>((T *)qkv, ldq, tokens, H, Hkv, D, (const T *)cos, (const T *)ssin, positions, slots, \
                      (TC *)k_cache, (TC *)v_cache, Lmax, threads);                                          \
    return 0
    if (dtype == 1 && kv_dtype == 1) { LLK_ROPE(bf16, bf16); }
    if (dtype == 1 && kv_dtype == 0) { LLK_ROPE(bf16, float); }
    if (dtype == 0 && kv_dtype == 0) { LLK_ROPE(float, float); }
    if (dtype == 0 && kv_dtype == 1) { LLK_ROPE(float, bf16); }
#undef LLK_ROPE
    return -1;
}

// 0 on success, -1 for an unsupported combination of dtypes (activations, weights, cache) or head
// size: see decode_layers above. dims: M, D, H, Hkv, Dh, I, Lmax, layers.
// `chunks` prompt chunks follow the decode rows, 4 numbers each in `chunk_info`: first row, rows, slot, first
// position (PromptChunk; `tiles`: their attention on AMX's tiles, -3 where they do not run); 0: decode rows only.
// `head_w` non-null: the final norm (`head_norm`) and the LM head (`head_w` [vocab, D], the layers' layout) run
// too, over the rows with logits, into `logits`, then widened into `logits32` with each row's greedy pick in
// `best` and `logprob` (Head).
LLK_API int llk_decode_layers(void *hidden, void *delta, void *scratch, const long *dims, const void *const *weights,
                              void *const *caches, const void *cos, const void *ssin, const int64_t *positions,
                              const int64_t *slots, const int64_t *lens, float eps, float scale, int dtype,
                              int w_dtype, int kv_dtype, int threads, long one_row_prefetch, long chunks,
                              const long *chunk_info, int tiles, const void *head_norm, const void *head_w,
                              long vocab, void *logits, float *logits32, int64_t *best, float *logprob) {
    const StepShape s{dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], dims[6], dims[7]};
    if (s.Hkv < 1 || s.H % s.Hkv != 0 || s.H / s.Hkv > 64 || s.Dh % (2 * Vec::N) != 0 || s.Dh > 512) return -1;
    static_assert(sizeof(PromptChunk) == 4 * sizeof(long), "chunk_info's layout");
    const PromptChunks prompt{chunks, (const PromptChunk *)chunk_info, tiles};
    const Head head{head_norm, head_w, vocab, logits, logits32, best, logprob};
#define LLK_LAYERS(T, TW, TC, ...)                                                                   \
    return decode_layers<T, TW, TC, ##__VA_ARGS__>((T *)hidden, (T *)delta, (T *)scratch, s, weights, caches, \
                                                   (const T *)cos, (const T *)ssin, positions, slots, lens, eps,  \
                                                   scale, threads, one_row_prefetch, prompt, head)
#if defined(LLK_VEC512)
    const long qkv = (s.H + 2 * s.Hkv) * s.Dh;
    if (w_dtype == PAIRS_CODE && (s.D % PANEL_COLS || qkv % PANEL_COLS || (2 * s.I) % PANEL_COLS || s.I % 2 ||
                                  (head_w && vocab % PANEL_COLS)))
        return -1;
    if (w_dtype == PAIRS_CODE && dtype == 0 && kv_dtype == 0) LLK_LAYERS(float, bf16, float, true);
    if (w_dtype == PAIRS_CODE && dtype == 0 && kv_dtype == 1) LLK_LAYERS(float, bf16, bf16, true);
    if (w_dtype == PAIRS_CODE && dtype == 1 && kv_dtype == 1) LLK_LAYERS(bf16, bf16, bf16, true);
    if (w_dtype == PAIRS_CODE && dtype == 1 && kv_dtype == 0) LLK_LAYERS(bf16, bf16, float, true);
#endif
    if (dtype == 0 && w_dtype == 0 && kv_dtype == 0) LLK_LAYERS(float, float, float);
    if (dtype == 0 && w_dtype == 1 && kv_dtype == 0) LLK_LAYERS(float, bf16, float);
    if (dtype == 0 && w_dtype == 1 && kv_dtype == 1) LLK_LAYERS(float, bf16, bf16);
    if (dtype == 0 && w_dtype == 0 && kv_dtype == 1) LLK_LAYERS(float, float, bf16);
    if (dtype == 1 && w_dtype == 1 && kv_dtype == 1) LLK_LAYERS(bf16, bf16, bf16);
    if (dtype == 1 && w_dtype == 1 && kv_dtype == 0) LLK_LAYERS(bf16, bf16, float);
    if (dtype == 0 && w_dtype == INT8_CODE && kv_dtype == 0) LLK_LAYERS(float, int8_t, float);
    if (dtype == 0 && w_dtype == INT8_CODE && kv_dtype == 1) LLK_LAYERS(float, int8_t, bf16);
    if (dtype == 1 && w_dtype == INT8_CODE && kv_dtype == 1) LLK_LAYERS(bf16, int8_t, bf16);
    if (dtype == 1 && w_dtype == INT8_CODE && kv_dtype == 0) LLK_LAYERS(bf16, int8_t, float);
#undef LLK_LAYERS
    return -1;
}

// Overwrite the stack below the caller with bytes that, read as a dead job, claim every chunk and
// call nowhere: what the model's Python frames do to a finished job's memory in a served worker.
__attribute__((noinline)) static void scribble_stack() {
    volatile unsigned char junk[8192];
    for (size_t i = 0; i < sizeof(junk); i++) junk[i] = 0x7f;
}

// One job of llk_pool_check, in a frame of its own that the next scribble_stack() overwrites.
__attribute__((noinline)) static void counted_job(std::atomic<int> *runs, long n, long j, int threads) {
    pool().run(n, threads, [&](long c) {
        for (long i = 0; i < (c * 31 + j) % 97; i++) _mm_pause();
        runs[c].fetch_add(1, std::memory_order_relaxed);
    });
}

// The pool's own check: `jobs` jobs back to back of 1 to max_chunks chunks each (of uneven length)
// on `threads` threads, the stack scribbled between them, now and then after a pause long enough
// for the helpers to fall asleep (so that they wake late, after their job); returns how many jobs
// saw a chunk run other than exactly once by the time the job returned (0 when the pool is right;
// a pool that let a helper claim from a dead job crashes here instead).
LLK_API long llk_pool_check(long jobs, long max_chunks, int threads) {
    const long SLEEP_US = 250;  // past a helper's spin (Pool::SPIN_US)
    long wrong = 0;
    std::vector<std::atomic<int>> runs(max_chunks);
    for (long j = 0; j < jobs; j++) {
        const long n = 1 + (j * 7919) % max_chunks;
        scribble_stack();
        if (j % 64 == 63) std::this_thread::sleep_for(std::chrono::microseconds(SLEEP_US + j % 300));
        for (long c = 0; c < n; c++) runs[c].store(0, std::memory_order_relaxed);
        counted_job(runs.data(), n, j, threads);
        for (long c = 0; c < n; c++)
            if (runs[c].load(std::memory_order_relaxed) != 1) {
                wrong++;
                break;
            }
    }
    return wrong;
}
