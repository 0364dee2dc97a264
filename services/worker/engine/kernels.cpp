// Fused CPU kernels of the built-in engine (bfloat16 and float32).
//
// Each kernel does in one pass over memory what the torch path does in several ops, and
// rounds where transformers rounds: a bfloat16 product or sum is rounded to bfloat16 before
// the next op uses it, so results stay those of transformers' modules. Built on first use
// by kernels.py (torch.utils.cpp_extension, -O3 -march=native -ffp-contract=off: no fused
// multiply-adds the torch ops would not do; -fopenmp, without which at::parallel_for runs
// serially); work is split over torch's own thread pool (at::parallel_for, torch's libgomp),
// never a second OpenMP pool.
//
//   rms_norm(x, w, eps, out)              out = w * norm(x)
//   add_rms_norm(h, d, w, eps, out)       h = h + d (in place); out = w * norm(h)
//   rotary_(x, cos, sin)                  rotate-half rotary in place on [T, heads, D]
//   silu_mul(gu, out)                     out = silu(gu[:, :I]) * gu[:, I:]
//   write_kv(k, v, slots, k_cache, v_cache)   rows of k/v into the paged pool
//   decode_attention(q, rows, k_cache, v_cache, tables, lens, scale, out)
//       one query row per request against its paged keys, read in place from the pool
//   small_linear(x, w, b) -> out          x @ w.T + b for a few bfloat16 rows (a GEMV)
//   prefill_attention(q, k, v, L, scale, out)   causal attention of fresh prompts (bf16)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

using bf16 = uint16_t;  // bfloat16 as its bits

// The bits of ``x`` as a ``To`` of the same size (std::bit_cast before C++20).
template <typename To, typename From>
inline To bits(const From& x) {
  static_assert(sizeof(To) == sizeof(From), "bits: sizes differ");
  To t;
  std::memcpy(&t, &x, sizeof(To));
  return t;
}

// float bits -> bfloat16 bits (in the high half): rounding to nearest even, NaN -> 0x7FC0
// (as c10::BFloat16 does). U is uint32_t for one value, v16u for 16.
template <typename U>
inline U bf_round(U u) {
  const U r = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  return (u & 0x7fffffffu) > 0x7f800000u ? U{} + 0x7fc00000u : r;
}

inline float to_f(float x) { return x; }
inline float to_f(bf16 h) { return bits<float>(uint32_t(h) << 16); }

inline bf16 to_bf(float f) { return bf16(bf_round(bits<uint32_t>(f)) >> 16); }

template <typename T>
inline void store(T* p, float v);
template <>
inline void store<float>(float* p, float v) { *p = v; }
template <>
inline void store<bf16>(bf16* p, float v) { *p = to_bf(v); }

// The value a result of type T holds: rounded to bfloat16 for bfloat16, as is for float.
template <typename T>
inline float rnd(float v);
template <>
inline float rnd<float>(float v) { return v; }
template <>
inline float rnd<bf16>(float v) { return to_f(to_bf(v)); }

inline v16 load16(const float* p) {
  v16 f;
  std::memcpy(&f, p, 64);
  return f;
}
inline v16 load16(const bf16* p) {
  v16h h;
  std::memcpy(&h, p, 32);
  return bits<v16>(__builtin_convertvector(h, v16u) << 16);
}
// bfloat16 rounding of 16 floats, as their float bits.
inline v16u round_bits(v16 x) { return bf_round(bits<v16u>(x)); }

inline void store16(float* p, v16 v) { std::memcpy(p, &v, 64); }
inline void store16(bf16* p, v16 v) {
  v16h h = __builtin_convertvector(round_bits(v) >> 16, v16h);
  std::memcpy(p, &h, 32);
}

// 16 values as a result of type T holds them (rounded to bfloat16 for bfloat16).
inline v16 vrnd(v16 v, float*) { return v; }
inline v16 vrnd(v16 v, bf16*) { return bits<v16>(round_bits(v)); }
template <typename T>
inline v16 vround(v16 v) {
  return vrnd(v, static_cast<T*>(nullptr));
}

inline float hsum(v16 v) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

// exp(x), Cephes' single-precision polynomial (about 1 ulp), 16 lanes at a time; +inf
// above float's range, 0 below it (no denormals).
inline v16 vexp(v16 in) {
  const v16 hi = v16{} + 88.3762626647949f, lo = v16{} - 87.3365447505531f;
  v16 x = in > hi ? hi : in;
  x = x < lo ? lo : x;
  v16 t = x * 1.44269504088896341f;
  v16 half = t >= 0.f ? v16{} + 0.5f : v16{} - 0.5f;
  v16i k = __builtin_convertvector(t + half, v16i);
  v16 kf = __builtin_convertvector(k, v16);
  v16 r = x - kf * 0.693359375f;
  r = r - kf * -2.12194440e-4f;
  v16 p = v16{} + 1.9875691500E-4f;
  p = p * r + 1.3981999507E-3f;
  p = p * r + 8.3334519073E-3f;
  p = p * r + 4.1665795894E-2f;
  p = p * r + 1.6666665459E-1f;
  p = p * r + 5.0000001201E-1f;
  p = p * (r * r) + r + 1.0f;
  v16 r2 = p * bits<v16>((k + 127) << 23);
  r2 = in > hi ? v16{} + INFINITY : r2;
  return in < lo ? v16{} : r2;
}

float exp1(float x) {
  v16 v = v16{} + x;
  return vexp(v)[0];
}

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
}

template <typename T>
const T* cptr(const at::Tensor& t) {
  return reinterpret_cast<const T*>(t.const_data_ptr());
}
template <typename T>
T* mptr(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.mutable_data_ptr());
}

#define OF_DISPATCH(dtype, ...)                                            \
  do {                                                                     \
    if ((dtype) == at::kBFloat16) {                                        \
      using scalar = bf16;                                                 \
      __VA_ARGS__();                                                       \
    } else if ((dtype) == at::kFloat) {                                    \
      using scalar = float;                                                \
      __VA_ARGS__();                                                       \
    } else {                                                               \
      TORCH_CHECK(false, "omniflow kernels take bfloat16 or float32, got ", (dtype)); \
    }                                                                      \
  } while (0)

// ---------------------------------------------------------------- RMSNorm

// One row: (optionally h = h + d) then out = w * T(h * rsqrt(mean(h^2) + eps)), the
// normalisation in float32 as transformers' LlamaRMSNorm computes it.
template <typename T>
void norm_row(T* h, const T* d, const T* w, T* out, int64_t n, float eps, float* tmp) {
  for (int64_t i = 0; i < n; ++i) {
    float v = to_f(h[i]);
    if (d) {
      v = rnd<T>(v + to_f(d[i]));
      store(h + i, v);
    }
    tmp[i] = v;
  }
  v16 acc = v16{};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    v16 v = load16(tmp + i);
    acc += v * v;
  }
  float ss = hsum(acc);
  for (; i < n; ++i) ss += tmp[i] * tmp[i];
  const float r = 1.0f / std::sqrt(ss / float(n) + eps);
  for (int64_t j = 0; j < n; ++j) store(out + j, to_f(w[j]) * rnd<T>(tmp[j] * r));
}

void norm_impl(const at::Tensor& h, const c10::optional<at::Tensor>& d, const at::Tensor& w,
               double eps, const at::Tensor& out) {
  check_cpu(h, "x");
  TORCH_CHECK(h.dim() == 2 && h.stride(1) == 1 && out.is_contiguous() && w.is_contiguous(),
              "rms_norm takes a [rows, n] tensor with contiguous rows");
  TORCH_CHECK(out.sizes() == h.sizes() && w.size(0) == h.size(1), "rms_norm: shapes differ");
  TORCH_CHECK(w.scalar_type() == h.scalar_type() && out.scalar_type() == h.scalar_type(),
              "rms_norm: dtypes differ");
  if (d) TORCH_CHECK(d->sizes() == h.sizes() && d->stride(1) == 1, "add_rms_norm: shapes differ");
  const int64_t rows = h.size(0), n = h.size(1);
  OF_DISPATCH(h.scalar_type(), [&] {
    scalar* hp = mptr<scalar>(h);
    const scalar* dp = d ? cptr<scalar>(*d) : nullptr;
    const int64_t hs = h.stride(0), ds = d ? d->stride(0) : 0;
    const scalar* wp = cptr<scalar>(w);
    scalar* op = mptr<scalar>(out);
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
      std::vector<float> tmp(n);
      for (int64_t r = b; r < e; ++r)
        norm_row<scalar>(hp + r * hs, dp ? dp + r * ds : nullptr, wp, op + r * n,
                         n, float(eps), tmp.data());
    });
  });
}

void rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, const at::Tensor& out) {
  norm_impl(x, c10::nullopt, w, eps, out);
}

void add_rms_norm(const at::Tensor& h, const at::Tensor& d, const at::Tensor& w, double eps,
                  const at::Tensor& out) {
  norm_impl(h, d, w, eps, out);
}

// ---------------------------------------------------------------- rotary

// x [T, H, D] (rows strided, heads D apart), cos/sin [T, D] whose halves are equal:
// x1' = x1*c - x2*s, x2' = x2*c + x1*s, each product and sum rounded as T.
void rotary_(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "rotary_ takes [T, heads, D] with contiguous heads");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == x.size(0) &&
                  cos.size(1) == x.size(2) && sin.sizes() == cos.sizes(),
              "rotary_: cos/sin must be contiguous [T, D]");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rotary_: dtypes differ");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  const int64_t xs = x.stride(0);
  OF_DISPATCH(x.scalar_type(), [&] {
    scalar* xp = mptr<scalar>(x);
    const scalar* cp = cptr<scalar>(cos);
    const scalar* sp = cptr<scalar>(sin);
    at::parallel_for(0, T, 64, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const scalar* c = cp + t * D;
        const scalar* s = sp + t * D;
        for (int64_t h = 0; h < H; ++h) {
          scalar* row = xp + t * xs + h * D;
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = to_f(row[i]), x2 = to_f(row[i + half]);
            const float ci = to_f(c[i]), si = to_f(s[i]);
            const float a = rnd<scalar>(x1 * ci), bb = rnd<scalar>(x2 * si);
            const float cc = rnd<scalar>(x2 * ci), dd = rnd<scalar>(x1 * si);
            store(row + i, a - bb);
            store(row + i + half, cc + dd);
          }
        }
      }
    });
  });
}

// ---------------------------------------------------------------- SiLU and multiply

// exp for 16 lanes, and silu(g) = g / (1 + exp(-g)). With AVX-512: exp by the same reduction and
// degree-6 polynomial as vexp (Cephes' coefficients, ~1 ulp) in fused multiply-adds, 2^n
// applied by vscalefps (overflow to inf, underflow to 0: no integer bit tricks, no
// selects), one clamp that keeps NaN; about a third of vexp's instructions.
#ifdef __AVX512F__
inline __m512 exp_fma(__m512 in) {
  // below -150 the result is 0 (past float's denormals), above 100 +inf: no clamp of r needed
  const __m512 x = _mm512_min_ps(_mm512_set1_ps(100.f), _mm512_max_ps(_mm512_set1_ps(-150.f), in));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
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
#endif

inline v16 silu16(v16 g) {
#ifdef __AVX512F__
  const __m512 e = exp_fma(-(__m512)g);
  return (v16)_mm512_div_ps((__m512)g, _mm512_add_ps(e, _mm512_set1_ps(1.0f)));
#else
  return g / (1.0f + vexp(-g));
#endif
}

// out [T, I] = T(silu(g)) * u for gu [T, 2I] = [g | u] (silu(g) = g / (1 + exp(-g))).
void silu_mul(const at::Tensor& gu, const at::Tensor& out) {
  check_cpu(gu, "gu");
  TORCH_CHECK(gu.dim() == 2 && gu.stride(1) == 1 && out.is_contiguous() &&
                  out.size(0) == gu.size(0) && 2 * out.size(1) == gu.size(1),
              "silu_mul takes gu [T, 2I] and out [T, I]");
  TORCH_CHECK(out.scalar_type() == gu.scalar_type(), "silu_mul: dtypes differ");
  const int64_t T = gu.size(0), I = out.size(1), gs = gu.stride(0);
  OF_DISPATCH(gu.scalar_type(), [&] {
    const scalar* gp = cptr<scalar>(gu);
    scalar* op = mptr<scalar>(out);
    at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const scalar* g = gp + t * gs;
        const scalar* u = g + I;
        scalar* o = op + t * I;
        int64_t i = 0;
        for (; i + 16 <= I; i += 16) {
          const v16 gv = load16(g + i);
          store16(o + i, vround<scalar>(silu16(gv)) * load16(u + i));
        }
        for (; i < I; ++i) {
          const float gv = to_f(g[i]);
          store(o + i, rnd<scalar>(gv / (1.0f + exp1(-gv))) * to_f(u[i]));
        }
      }
    });
  });
}

// ---------------------------------------------------------------- paged KV

// k, v [T, H, D] (rows strided, heads contiguous) into caches [H, pages, P, D] at
// flat slots (page * P + offset) [T].
void write_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
              const at::Tensor& k_cache, const at::Tensor& v_cache) {
  check_cpu(k, "k");
  TORCH_CHECK(k.dim() == 3 && k.stride(2) == 1 && k.stride(1) == k.size(2) &&
                  v.sizes() == k.sizes() && v.stride(2) == 1 && v.stride(1) == v.size(2),
              "write_kv takes k, v [T, heads, D] with contiguous heads");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
                  k_cache.size(0) == k.size(1) && k_cache.size(3) == k.size(2) &&
                  v_cache.sizes() == k_cache.sizes(),
              "write_kv: caches must be contiguous [heads, pages, P, D]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                  slots.size(0) == k.size(0),
              "write_kv: slots must be int64 [T]");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k.scalar_type() &&
                  v_cache.scalar_type() == k.scalar_type(),
              "write_kv: dtypes differ");
  const int64_t T = k.size(0), H = k.size(1), D = k.size(2);
  const int64_t cap = k_cache.size(1) * k_cache.size(2);
  const int64_t* sl = slots.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sl[t] >= 0 && sl[t] < cap, "write_kv: slot ", sl[t], " outside the pool");
  const int64_t es = k.element_size();
  const char* kp = static_cast<const char*>(k.const_data_ptr());
  const char* vp = static_cast<const char*>(v.const_data_ptr());
  char* kc = static_cast<char*>(k_cache.mutable_data_ptr());
  char* vc = static_cast<char*>(v_cache.mutable_data_ptr());
  const int64_t ks = k.stride(0) * es, vs = v.stride(0) * es, row = D * es;
  at::parallel_for(0, T, 256, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t dst = (h * cap + sl[t]) * row;
        std::memcpy(kc + dst, kp + t * ks + h * row, row);
        std::memcpy(vc + dst, vp + t * vs + h * row, row);
      }
  });
}

// Decode attention: request b's query q[rows[b]] [heads, D] against the first lens[b]
// keys of its pages tables[b] in the pool, all in float32; out[rows[b]] [heads, D].
// Grouped query heads share their KV head: each key and value is read once per KV head.
// The 16 sums of a[0..15] (one vector each) as the lanes of one vector: a transpose-and-add
// tree (30 shuffles, 15 adds) instead of 16 horizontal sums.
inline v16 sum16(v16* a) {
  const v16i l1a = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const v16i l1b = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  const v16i l2a = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const v16i l2b = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
  const v16i l3a = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const v16i l3b = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
  const v16i l4a = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  const v16i l4b = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
  v16 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)
    b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], l1a) +
           __builtin_shuffle(a[2 * i], a[2 * i + 1], l1b);
  for (int i = 0; i < 4; ++i)
    c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1], l2a) +
           __builtin_shuffle(b[2 * i], b[2 * i + 1], l2b);
  for (int i = 0; i < 2; ++i)
    d[i] = __builtin_shuffle(c[2 * i], c[2 * i + 1], l3a) +
           __builtin_shuffle(c[2 * i], c[2 * i + 1], l3b);
  return __builtin_shuffle(d[0], d[1], l4a) + __builtin_shuffle(d[0], d[1], l4b);
}

// exp(s - max(s)) in place over one row of scores (padded to 16; lanes past the row's
// length hold -inf, whose exp is 0); returns their sum.
inline float softmax_row(float* s, int64_t padded) {
  v16 mv = v16{} - INFINITY;
  for (int64_t t = 0; t < padded; t += 16) {
    const v16 x = load16(s + t);
    mv = x > mv ? x : mv;
  }
  float m = -INFINITY;
  for (int i = 0; i < 16; ++i) m = mv[i] > m ? mv[i] : m;
  v16 sum = v16{};
  for (int64_t t = 0; t < padded; t += 16) {
    const v16 e = vexp(load16(s + t) - m);
    store16(s + t, e);
    sum += e;
  }
  return hsum(sum);
}

// Ask for ``bytes`` at ``p`` (a page about to be read) a cache line at a time.
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(c + b);
}

// Page pi of a request's table in a pool of pages of ``page`` values; the next page is asked
// for while this one is computed.
template <typename T>
inline const T* page_rows(const T* cache, const int64_t* table, int64_t pi, int64_t pages,
                          int64_t page) {
  if (pi + 1 < pages) prefetch(cache + table[pi + 1] * page, page * int64_t(sizeof(T)));
  return cache + table[pi] * page;
}

// Decode attention of one request and one KV head: its G query heads q [G, D] against the
// first len keys of its pages (table), scores and softmax in float32; out [G, D].
template <typename T>
void decode_head(const T* q, int64_t G, int64_t D, const T* kc, const T* vc,
                 const int64_t* table, int64_t len, int64_t P, float scale, T* out) {
  const int64_t C = D / 16;
  std::vector<v16> qv(G * C), acc(G * C, v16{});
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < C; ++c) qv[g * C + c] = load16(q + g * D + c * 16) * scale;
  const int64_t padded = (len + 15) / 16 * 16;
  std::vector<float> s(G * padded, -INFINITY);
  const int64_t pages = (len + P - 1) / P;
  std::vector<v16> part(G * 16), kv(C);
  float qscale = 1.0f;  // applied to the scores where q is used unscaled
#ifdef __AVX512BF16__
  // bfloat16 keys: dot products by vdpbf16ps (pairs of bfloat16 products summed in float32,
  // exact products), no conversion of the keys to float32.
  constexpr bool dp = std::is_same<T, bf16>::value;
  __m512bh qb[64];
  const bool use_dp = dp && D % 32 == 0 && G * (D / 32) <= 64;
  if (use_dp) {
    qscale = scale;
    for (int64_t g = 0; g < G; ++g)
      for (int64_t c = 0; c < D / 32; ++c)
        qb[g * (D / 32) + c] = (__m512bh)_mm512_loadu_si512(q + g * D + c * 32);
  }
#else
  constexpr bool use_dp = false;
#endif
  for (int64_t pi = 0; pi < pages; ++pi) {
    const T* kp = page_rows(kc, table, pi, pages, P * D);
    const int64_t n = std::min(P, len - pi * P);
    int64_t j = 0;
    for (; j + 16 <= n && (pi * P + j) % 16 == 0; j += 16) {
      for (int64_t jj = 0; jj < 16; ++jj) {  // each key loaded once for the G heads
        const T* kr = kp + (j + jj) * D;
#ifdef __AVX512BF16__
        if (use_dp) {
          const int64_t C2 = D / 32;
          __m512bh kb[8];
          for (int64_t c = 0; c < C2 && c < 8; ++c)
            kb[c] = (__m512bh)_mm512_loadu_si512(kr + c * 32);
          for (int64_t g = 0; g < G; ++g) {
            __m512 a = _mm512_setzero_ps();
            for (int64_t c = 0; c < C2; ++c)
              a = _mm512_dpbf16_ps(a, qb[g * C2 + c],
                                   c < 8 ? kb[c] : (__m512bh)_mm512_loadu_si512(kr + c * 32));
            part[g * 16 + jj] = (v16)a;
          }
          continue;
        }
#endif
        for (int64_t c = 0; c < C; ++c) kv[c] = load16(kr + c * 16);
        for (int64_t g = 0; g < G; ++g) {
          v16 a = qv[g * C] * kv[0];
          for (int64_t c = 1; c < C; ++c) a += qv[g * C + c] * kv[c];
          part[g * 16 + jj] = a;
        }
      }
      for (int64_t g = 0; g < G; ++g)
        store16(s.data() + g * padded + pi * P + j, sum16(part.data() + g * 16) * qscale);
    }
    for (; j < n; ++j) {
      const T* kr = kp + j * D;
      for (int64_t g = 0; g < G; ++g) {
        v16 a = qv[g * C] * load16(kr);
        for (int64_t c = 1; c < C; ++c) a += qv[g * C + c] * load16(kr + c * 16);
        s[g * padded + pi * P + j] = hsum(a);
      }
    }
  }
  std::vector<float> total(G);
  for (int64_t g = 0; g < G; ++g) total[g] = softmax_row(s.data() + g * padded, padded);
  for (int64_t pi = 0; pi < pages; ++pi) {
    const T* vp = vc + table[pi] * P * D;
    const int64_t n = std::min(P, len - pi * P);
    for (int64_t j = 0; j < n; ++j) {
      const T* vr = vp + j * D;
      const int64_t t = pi * P + j;
      for (int64_t c = 0; c < C; ++c) {
        const v16 vv = load16(vr + c * 16);
        for (int64_t g = 0; g < G; ++g) acc[g * C + c] += s[g * padded + t] * vv;
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const float inv = 1.0f / total[g];
    for (int64_t c = 0; c < C; ++c) store16(out + g * D + c * 16, acc[g * C + c] * inv);
  }
}

// decode_head with the group size G and head_dim / 16 = C known at compile time: every loop
// over heads and chunks unrolls, so the G x C accumulators and query chunks stay in registers
// (the runtime-sized version keeps them in memory). Same algorithm, same results.
template <typename T, int G, int C>
void decode_head_fixed(const T* q, const T* kc, const T* vc, const int64_t* table, int64_t len,
                       int64_t P, float scale, T* out) {
  constexpr int D = C * 16;
  const int64_t padded = (len + 15) / 16 * 16;
  std::vector<float> s(G * padded, -INFINITY);
  v16 qv[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) qv[g][c] = load16(q + g * D + c * 16) * scale;
#ifdef __AVX512BF16__
  constexpr bool dp = std::is_same<T, bf16>::value && C % 2 == 0;
  constexpr int C2 = C / 2 > 0 ? C / 2 : 1;
  __m512bh qb[G][C2];
  if constexpr (dp)
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C2; ++c) qb[g][c] = (__m512bh)_mm512_loadu_si512(q + g * D + c * 32);
#else
  constexpr bool dp = false;
#endif
  const float qscale = dp ? scale : 1.0f;
  const int64_t pages = (len + P - 1) / P;
  for (int64_t pi = 0; pi < pages; ++pi) {
    const T* kp = page_rows(kc, table, pi, pages, P * D);
    const int64_t n = std::min(P, len - pi * P);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
      v16 part[G][16];
      for (int jj = 0; jj < 16; ++jj) {
        const T* kr = kp + (j + jj) * D;
#ifdef __AVX512BF16__
        if constexpr (dp) {
          __m512bh kb[C2];
          for (int c = 0; c < C2; ++c) kb[c] = (__m512bh)_mm512_loadu_si512(kr + c * 32);
          for (int g = 0; g < G; ++g) {
            __m512 a = _mm512_setzero_ps();
            for (int c = 0; c < C2; ++c) a = _mm512_dpbf16_ps(a, qb[g][c], kb[c]);
            part[g][jj] = (v16)a;
          }
          continue;
        }
#endif
        v16 kv[C];
        for (int c = 0; c < C; ++c) kv[c] = load16(kr + c * 16);
        for (int g = 0; g < G; ++g) {
          v16 a = qv[g][0] * kv[0];
          for (int c = 1; c < C; ++c) a += qv[g][c] * kv[c];
          part[g][jj] = a;
        }
      }
      for (int g = 0; g < G; ++g)
        store16(s.data() + g * padded + pi * P + j, sum16(part[g]) * qscale);
    }
    for (; j < n; ++j) {
      const T* kr = kp + j * D;
      for (int g = 0; g < G; ++g) {
        v16 a = qv[g][0] * load16(kr);
        for (int c = 1; c < C; ++c) a += qv[g][c] * load16(kr + c * 16);
        s[g * padded + pi * P + j] = hsum(a);
      }
    }
  }
  float total[G];
  for (int g = 0; g < G; ++g) total[g] = softmax_row(s.data() + g * padded, padded);
  v16 acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = v16{};
  for (int64_t pi = 0; pi < pages; ++pi) {
    const T* vp = page_rows(vc, table, pi, pages, P * D);
    const int64_t n = std::min(P, len - pi * P);
    for (int64_t j = 0; j < n; ++j) {
      const T* vr = vp + j * D;
      const int64_t t = pi * P + j;
      v16 vv[C];
      for (int c = 0; c < C; ++c) vv[c] = load16(vr + c * 16);
      for (int g = 0; g < G; ++g) {
        const float p = s[g * padded + t];
        for (int c = 0; c < C; ++c) acc[g][c] += p * vv[c];
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    const float inv = 1.0f / total[g];
    for (int c = 0; c < C; ++c) store16(out + g * D + c * 16, acc[g][c] * inv);
  }
}

template <typename T>
using HeadFn = void (*)(const T*, const T*, const T*, const int64_t*, int64_t, int64_t, float, T*);

template <typename T, int C>
HeadFn<T> fixed_for_group(int64_t G) {
  switch (G) {
    case 1: return &decode_head_fixed<T, 1, C>;
    case 2: return &decode_head_fixed<T, 2, C>;
    case 3: return &decode_head_fixed<T, 3, C>;
    case 4: return &decode_head_fixed<T, 4, C>;
    case 5: return &decode_head_fixed<T, 5, C>;
    case 6: return &decode_head_fixed<T, 6, C>;
    case 7: return &decode_head_fixed<T, 7, C>;
    case 8: return &decode_head_fixed<T, 8, C>;
    default: return nullptr;
  }
}

// The compile-time variant for (group, head_dim) where one exists (head_dim 64 or 128,
// groups of 1 to 8 query heads: the common models), else nullptr (the runtime-sized one).
template <typename T>
HeadFn<T> fixed_head(int64_t G, int64_t D) {
  if (D == 64) return fixed_for_group<T, 4>(G);
  if (D == 128) return fixed_for_group<T, 8>(G);
  return nullptr;
}

void decode_attention(const at::Tensor& q, const at::Tensor& rows, const at::Tensor& k_cache,
                      const at::Tensor& v_cache, const at::Tensor& tables,
                      const at::Tensor& lens, double scale, const at::Tensor& out) {
  check_cpu(q, "q");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "decode_attention: q must be [T, heads, D] with contiguous heads");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes(),
              "decode_attention: out must be contiguous like q");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
                  v_cache.sizes() == k_cache.sizes() && k_cache.size(3) == q.size(2),
              "decode_attention: caches must be contiguous [kv_heads, pages, P, D]");
  const int64_t H = q.size(1), D = q.size(2), KVH = k_cache.size(0);
  TORCH_CHECK(H % KVH == 0 && D % 16 == 0, "decode_attention: heads ", H, " over ", KVH,
              " kv heads, head_dim ", D, " (a multiple of 16)");
  TORCH_CHECK(rows.scalar_type() == at::kLong && tables.scalar_type() == at::kLong &&
                  lens.scalar_type() == at::kLong && rows.is_contiguous() &&
                  tables.is_contiguous() && lens.is_contiguous() && tables.dim() == 2,
              "decode_attention: rows, tables, lens must be contiguous int64");
  const int64_t B = rows.size(0), W = tables.size(1), P = k_cache.size(2);
  const int64_t NP = k_cache.size(1);
  TORCH_CHECK(tables.size(0) == B && lens.size(0) == B, "decode_attention: batch sizes differ");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && out.scalar_type() == q.scalar_type() &&
                  v_cache.scalar_type() == q.scalar_type(),
              "decode_attention: dtypes differ");
  const int64_t* rp = rows.const_data_ptr<int64_t>();
  const int64_t* tp = tables.const_data_ptr<int64_t>();
  const int64_t* lp = lens.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(rp[b] >= 0 && rp[b] < q.size(0), "decode_attention: row out of range");
    TORCH_CHECK(lp[b] > 0 && lp[b] <= W * P, "decode_attention: length ", lp[b],
                " outside 1..", W * P);
    for (int64_t i = 0; i < (lp[b] + P - 1) / P; ++i)
      TORCH_CHECK(tp[b * W + i] >= 0 && tp[b * W + i] < NP, "decode_attention: page out of range");
  }
  const int64_t G = H / KVH;
  OF_DISPATCH(q.scalar_type(), [&] {
    const scalar* qp = cptr<scalar>(q);
    const scalar* kc = cptr<scalar>(k_cache);
    const scalar* vc = cptr<scalar>(v_cache);
    scalar* op = mptr<scalar>(out);
    const int64_t qs = q.stride(0);
    const HeadFn<scalar> fixed = fixed_head<scalar>(G, D);
    at::parallel_for(0, B * KVH, 1, [&](int64_t b0, int64_t e0) {
      for (int64_t task = b0; task < e0; ++task) {
        const int64_t b = task / KVH, kh = task % KVH;
        if (fixed) {
          fixed(qp + rp[b] * qs + kh * G * D, kc + kh * NP * P * D, vc + kh * NP * P * D,
                tp + b * W, lp[b], P, float(scale), op + rp[b] * H * D + kh * G * D);
          continue;
        }
        decode_head<scalar>(qp + rp[b] * qs + kh * G * D, G, D, kc + kh * NP * P * D,
                            vc + kh * NP * P * D, tp + b * W, lp[b], P, float(scale),
                            op + rp[b] * H * D + kh * G * D);
      }
    });
  });
}

// ---------------------------------------------------------------- small-batch linear

#ifdef __AVX512BF16__
// A bandwidth-bound GEMV for a few rows: out[m, n] = sum_k x[m, k] * w[n, k] (+ b[n]) over
// bfloat16 weight rows read once, straight from their [N, K] layout (no blocked reorder, no
// AMX tiles mostly idle for one row). R weight rows at a time, each 32-value chunk of a row
// loaded once for all M input rows (vdpbf16ps: pairs of exact products summed in float32);
// the per-output partial vectors are reduced 16 outputs at a time by sum16. Accumulates in
// float32, rounds once to bfloat16 (as oneDNN does, in another summation order).
// How far ahead the weight stream is prefetched (into L2: prefetcht1 leaves the core's few
// L1 fill buffers to the loads, so more lines are in flight than the loads alone keep).
// Measured on one core (bench/kernels.py): 4,096 values ahead streamed ~2x faster than none.
constexpr int64_t kGemvAhead = 4096;

template <int M, int R>
void gemv_rows(const bf16* x, int64_t xs, const bf16* w, int64_t K, const bf16* bias,
               bf16* out, int64_t N, int64_t b0, int64_t b1) {
  const int64_t tail = K % 32, kmain = K - tail;
  const __mmask32 tmask = tail ? __mmask32((1u << tail) - 1u) : 0;
  for (int64_t nb = b0 * 16; nb < std::min(N, b1 * 16); nb += 16) {
    const int64_t cnt = std::min<int64_t>(16, N - nb);
    v16 part[M][16];
    for (int j = 0; j < 16; j += R) {
      const bf16* wr[R];
      for (int r = 0; r < R; ++r) wr[r] = w + std::min<int64_t>(nb + j + r, N - 1) * K;
      const bf16* ahead = w + (nb + j) * K + kGemvAhead;
      const bf16* end = w + N * K;
      __m512 acc[M][R];
      for (int m = 0; m < M; ++m)
        for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
      for (int64_t k = 0; k < kmain; k += 32) {
        __m512bh wv[R];
        for (int r = 0; r < R; ++r) wv[r] = (__m512bh)_mm512_loadu_si512(wr[r] + k);
        for (int r = 0; r < R; ++r) {
          const bf16* a = ahead + r * K + k;
          if (a < end) _mm_prefetch(reinterpret_cast<const char*>(a), _MM_HINT_T1);
        }
        for (int m = 0; m < M; ++m) {
          const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * xs + k);
          for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
        }
      }
      if (tail) {  // masked lanes load as zero and add nothing
        __m512bh wv[R];
        for (int r = 0; r < R; ++r)
          wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(tmask, wr[r] + kmain);
        for (int m = 0; m < M; ++m) {
          const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(tmask, x + m * xs + kmain);
          for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
        }
      }
      for (int m = 0; m < M; ++m)
        for (int r = 0; r < R; ++r) part[m][j + r] = (v16)acc[m][r];
    }
    v16 bv = v16{};
    if (bias) {
      for (int64_t i = 0; i < cnt; ++i) bv[i] = to_f(bias[nb + i]);
    }
    for (int m = 0; m < M; ++m) {
      const v16 s = sum16(part[m]) + bv;
      if (cnt == 16) {
        store16(out + m * N + nb, s);
      } else {
        for (int64_t i = 0; i < cnt; ++i) out[m * N + nb + i] = to_bf(s[i]);
      }
    }
  }
}

template <int M>
void gemv_m(const bf16* x, int64_t xs, const bf16* w, int64_t K, const bf16* bias, bf16* out,
            int64_t N) {
  constexpr int R = M <= 2 ? 8 : (M <= 4 ? 4 : 2);  // M x R accumulators: at most 16 registers
  // Split over output blocks of 16 rows; a task streams at least ~64 KB of weights.
  const int64_t blocks = (N + 15) / 16;
  const int64_t grain = std::max<int64_t>(1, 2048 / std::max<int64_t>(K, 1));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    gemv_rows<M, R>(x, xs, w, K, bias, out, N, b0, b1);
  });
}
#endif

// ---------------------------------------------------------------- prefill attention

#ifdef __AVX512BF16__
// Causal attention of one prompt's block of 16 query positions (q0..) for one KV head and its
// G query heads, in the flash form: key blocks of 16 up to the diagonal, each block's keys
// packed once as bfloat16 pairs (key dot products by vdpbf16ps with the query's pairs
// broadcast) and its values widened once to float32; an online softmax in float32 per row.
template <int C>
void prefill_block(const bf16* q, int64_t qs, const bf16* k, int64_t ks, const bf16* v,
                   int64_t vs, int64_t G, int64_t L, int64_t q0, float scale, bf16* out, int64_t os) {
  constexpr int D = C * 16, D2 = D / 2;
  const int64_t nq = std::min<int64_t>(16, L - q0), rows = G * nq;
  std::vector<float> m(rows, -INFINITY), l(rows, 0.f);
  std::vector<__m512> acc(rows * C, _mm512_setzero_ps());
  alignas(64) uint32_t kp[D2][16];
  alignas(64) float vf[16][D];
  alignas(64) float pa[16];
  for (int64_t j0 = 0; j0 <= q0; j0 += 16) {
    const int64_t nk = std::min<int64_t>(16, L - j0);
    for (int64_t j = 0; j < 16; ++j) {  // keys as pairs [d2][key], values as float32 [key][d]
      const uint32_t* kr = reinterpret_cast<const uint32_t*>(k + (j0 + j) * ks);
      const bf16* vr = v + (j0 + j) * vs;
      for (int d2 = 0; d2 < D2; ++d2) kp[d2][j] = j < nk ? kr[d2] : 0u;
      for (int d = 0; d < D; ++d) vf[j][d] = j < nk ? to_f(vr[d]) : 0.f;
    }
    const bool diag = j0 == q0;
    for (int64_t g = 0; g < G; ++g) {
      __m512 s4[4];
      for (int64_t i = 0; i < nq; ++i) {
        if (i % 4 == 0) {  // four rows' scores at once: four independent vdpbf16ps chains
          const uint32_t* qr[4];
          for (int u = 0; u < 4; ++u) {
            const int64_t row = q0 + std::min<int64_t>(i + u, nq - 1);
            qr[u] = reinterpret_cast<const uint32_t*>(q + row * qs + g * D);
            s4[u] = _mm512_setzero_ps();
          }
          for (int d2 = 0; d2 < D2; ++d2) {
            const __m512bh kv = (__m512bh)_mm512_load_si512(kp[d2]);
            for (int u = 0; u < 4; ++u)
              s4[u] = _mm512_dpbf16_ps(s4[u], (__m512bh)_mm512_set1_epi32(int(qr[u][d2])), kv);
          }
        }
        __m512 sc = _mm512_mul_ps(s4[i % 4], _mm512_set1_ps(scale));
        // keys past the query (the diagonal block) or past the prompt weigh nothing
        const int64_t last = diag ? i : nk - 1;
        const __mmask16 keep = __mmask16((2u << last) - 1u);
        sc = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), keep, sc);
        const int64_t r = g * nq + i;
        const float mn = std::max(m[r], _mm512_reduce_max_ps(sc));
        const float alpha = m[r] == -INFINITY ? 0.f : std::exp(m[r] - mn);
        const __m512 pv = exp_fma(_mm512_sub_ps(sc, _mm512_set1_ps(mn)));
        m[r] = mn;
        l[r] = l[r] * alpha + _mm512_reduce_add_ps(pv);
        _mm512_store_ps(pa, pv);
        __m512 a[C];
        for (int c = 0; c < C; ++c) a[c] = _mm512_mul_ps(acc[r * C + c], _mm512_set1_ps(alpha));
        for (int64_t j = 0; j <= last; ++j) {
          const __m512 pj = _mm512_set1_ps(pa[j]);
          for (int c = 0; c < C; ++c) a[c] = _mm512_fmadd_ps(pj, _mm512_load_ps(vf[j] + c * 16), a[c]);
        }
        for (int c = 0; c < C; ++c) acc[r * C + c] = a[c];
      }
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t r = g * nq + i;
      const float inv = 1.0f / l[r];
      for (int c = 0; c < C; ++c)
        store16(out + (q0 + i) * os + g * D + c * 16,
                (v16)_mm512_mul_ps(acc[r * C + c], _mm512_set1_ps(inv)));
    }
}
#endif

// out [count * L, H, D] = causal attention of `count` prompts of L tokens each, all from
// position 0: q [count * L, H, D], k and v [count * L, KVH, D] (rows strided, heads
// contiguous), bfloat16, head_dim 64 or 128. The fresh-prompt path of the model.
void prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       int64_t L, double scale, const at::Tensor& out) {
  check_cpu(q, "q");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
              "prefill_attention takes bfloat16");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && q.stride(2) == 1 &&
                  q.stride(1) == q.size(2) && k.stride(2) == 1 && k.stride(1) == k.size(2) &&
                  v.stride(2) == 1 && v.stride(1) == v.size(2),
              "prefill_attention: q, k, v must be [T, heads, D] with contiguous heads");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes() && k.size(0) == q.size(0) &&
                  k.size(2) == q.size(2),
              "prefill_attention: shapes differ");
  const int64_t T = q.size(0), H = q.size(1), KVH = k.size(1), D = q.size(2);
  TORCH_CHECK(L > 0 && T % L == 0, "prefill_attention: ", T, " rows are no whole prompts of ", L);
  TORCH_CHECK(H % KVH == 0 && (D == 64 || D == 128), "prefill_attention: heads ", H, " over ",
              KVH, ", head_dim ", D, " (64 or 128)");
#ifndef __AVX512BF16__
  TORCH_CHECK(false, "prefill_attention needs a CPU with AVX512-BF16");
#else
  const int64_t G = H / KVH, count = T / L, blocks = (L + 15) / 16;
  const bf16* qp = cptr<bf16>(q);
  const bf16* kp = cptr<bf16>(k);
  const bf16* vp = cptr<bf16>(v);
  bf16* op = mptr<bf16>(out);
  const int64_t qs = q.stride(0), ks = k.stride(0), vs = v.stride(0), os = H * D;
  at::parallel_for(0, count * KVH * blocks, 1, [&](int64_t b0, int64_t e0) {
    for (int64_t t = b0; t < e0; ++t) {
      // the longest blocks (last positions) first, so threads end together
      const int64_t qb = blocks - 1 - t % blocks, kh = (t / blocks) % KVH, b = t / blocks / KVH;
      const bf16* qb0 = qp + b * L * qs + kh * G * D;
      const bf16* kb0 = kp + b * L * ks + kh * D;
      const bf16* vb0 = vp + b * L * vs + kh * D;
      bf16* ob0 = op + b * L * os + kh * G * D;
      if (D == 64)
        prefill_block<4>(qb0, qs, kb0, ks, vb0, vs, G, L, qb * 16, float(scale), ob0, os);
      else
        prefill_block<8>(qb0, qs, kb0, ks, vb0, vs, G, L, qb * 16, float(scale), ob0, os);
    }
  });
#endif
}

constexpr int64_t kGemvRows = 8;

bool small_linear_supported() {
#ifdef __AVX512BF16__
  return true;
#else
  return false;
#endif
}

// out [M, N] = x [M, K] @ w[N, K].T (+ b [N]), bfloat16, M <= kGemvRows (a decode batch).
at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w,
                        const c10::optional<at::Tensor>& b) {
  check_cpu(x, "x");
  TORCH_CHECK(small_linear_supported(), "small_linear needs a CPU with AVX512-BF16");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16,
              "small_linear takes bfloat16, got ", x.scalar_type(), " and ", w.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && w.dim() == 2 && w.is_contiguous() &&
                  x.size(1) == w.size(1),
              "small_linear takes x [M, K] with contiguous rows and a contiguous w [N, K]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kGemvRows, "small_linear: rows ", x.size(0),
              " outside 1..", kGemvRows);
  if (b) {
    TORCH_CHECK(b->scalar_type() == at::kBFloat16 && b->is_contiguous() && b->dim() == 1 &&
                    b->size(0) == w.size(0),
                "small_linear: bias must be a contiguous bfloat16 [N]");
  }
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
#ifdef __AVX512BF16__
  const bf16* xp = cptr<bf16>(x);
  const bf16* wp = cptr<bf16>(w);
  const bf16* bp = b ? cptr<bf16>(*b) : nullptr;
  bf16* op = mptr<bf16>(out);
  const int64_t xs = x.stride(0);
  switch (M) {
    case 1: gemv_m<1>(xp, xs, wp, K, bp, op, N); break;
    case 2: gemv_m<2>(xp, xs, wp, K, bp, op, N); break;
    case 3: gemv_m<3>(xp, xs, wp, K, bp, op, N); break;
    case 4: gemv_m<4>(xp, xs, wp, K, bp, op, N); break;
    case 5: gemv_m<5>(xp, xs, wp, K, bp, op, N); break;
    case 6: gemv_m<6>(xp, xs, wp, K, bp, op, N); break;
    case 7: gemv_m<7>(xp, xs, wp, K, bp, op, N); break;
    default: gemv_m<8>(xp, xs, wp, K, bp, op, N); break;
  }
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY(omniflow_engine, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps, Tensor(a!) out) -> ()");
  m.def("add_rms_norm(Tensor(a!) h, Tensor d, Tensor w, float eps, Tensor(b!) out) -> ()");
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("silu_mul(Tensor gu, Tensor(a!) out) -> ()");
  m.def("write_kv(Tensor k, Tensor v, Tensor slots, Tensor(a!) k_cache, Tensor(b!) v_cache) -> ()");
  m.def(
      "decode_attention(Tensor q, Tensor rows, Tensor k_cache, Tensor v_cache, Tensor tables, "
      "Tensor lens, float scale, Tensor(a!) out) -> ()");
  m.def("small_linear(Tensor x, Tensor w, Tensor? b) -> Tensor");
  m.def("small_linear_supported() -> bool", &small_linear_supported);
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, int L, float scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(omniflow_engine, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("add_rms_norm", add_rms_norm);
  m.impl("rotary_", rotary_);
  m.impl("silu_mul", silu_mul);
  m.impl("write_kv", write_kv);
  m.impl("decode_attention", decode_attention);
  m.impl("small_linear", small_linear);
  m.impl("prefill_attention", prefill_attention);
}
