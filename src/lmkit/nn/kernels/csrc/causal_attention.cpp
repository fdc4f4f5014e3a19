// Causal softmax(Q K^T * scale) V in float32 on CPU, forward and backward, for training.
//
// Per (batch, head), queries in blocks of `block` rows, each block against its key prefix alone (the keys
// right of the block are never touched): S = scale Q_s K_{<e}^T, P = softmax(S + causal mask),
// O_s = P V_{<e}, and the row's log-sum-exp L kept for the backward. Backward, per block, with P
// recomputed as exp(S - L) and D = rowsum(dO * O):
//   dV_{<e} += P^T dO_s,  dP = dO_s V_{<e}^T,  dS = P * (dP - D),
//   dQ_s = scale dS K_{<e},  dK_{<e} += scale dS^T Q_s.
// When the caller keeps P (a T x T buffer a head), the backward reads it instead, and forms dK and dV per
// key block over all the queries that see it (stored_head_backward).
// A (batch, head)'s keys, values, scores and gradients (about 400 KB at 256 positions and head size 64)
// stay in the core's cache from one product to the next; the products are MKL's sgemm (linked from
// libtorch_cpu, sequential inside the OpenMP loop). Tensors are addressed by (batch, head, position)
// strides with unit stride along the head dimension, so q, k and v may be views of one joined projection
// and the gradients may be written into one joined buffer. Grouped-query attention: key/value head
// h / (heads / kv_heads); the backward loops over a key/value head's query heads in one task, so the
// accumulation into dK and dV needs no lock.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc);

namespace {

// C (m x n) = alpha op(A) op(B) + beta C, all row-major: the column-major call on the transposes.
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
          const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  const char ta = trans_a ? 'T' : 'N', tb = trans_b ? 'T' : 'N';
  const int im = (int)m, in = (int)n, ik = (int)k, ilda = (int)lda, ildb = (int)ldb, ildc = (int)ldc;
  sgemm_(&tb, &ta, &in, &im, &ik, &alpha, b, &ildb, a, &ilda, &beta, c, &ildc);
}

#if defined(__AVX2__) && defined(__FMA__)
// e^x for x <= 0 (every softmax argument here): 2^n * p(r), r = x - n ln 2 in [-ln2/2, ln2/2], p of degree 6
// (Cephes' expf coefficients, relative error about 2 float32 steps); below -87 it returns 0.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 low = _mm256_set1_ps(-87.0f);
  const __m256 under = _mm256_cmp_ps(x, low, _CMP_LT_OQ);
  x = _mm256_max_ps(x, low);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

float row_max(const float* row, int64_t n) {
  int64_t j = 0;
  float mx = -INFINITY;
#if defined(__AVX2__) && defined(__FMA__)
  if (n >= 8) {
    __m256 acc = _mm256_loadu_ps(row);
    for (j = 8; j + 8 <= n; j += 8) acc = _mm256_max_ps(acc, _mm256_loadu_ps(row + j));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    mx = _mm_cvtss_f32(m);
  }
#endif
  for (; j < n; ++j) mx = std::max(mx, row[j]);
  return mx;
}

float dot(const float* a, const float* b, int64_t n) {
  int64_t j = 0;
  float sum = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), acc);
  sum = hsum(acc);
#endif
  for (; j < n; ++j) sum += a[j] * b[j];
  return sum;
}

// row[j] = exp(row[j] - shift) for j < n; returns their sum.
float exp_shifted(float* row, int64_t n, float shift) {
  int64_t j = 0;
  float sum = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 m = _mm256_set1_ps(shift);
  __m256 acc = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(row + j), m));
    _mm256_storeu_ps(row + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = hsum(acc);
#endif
  for (; j < n; ++j) {
    row[j] = std::exp(row[j] - shift);
    sum += row[j];
  }
  return sum;
}

struct View {  // a (batch, head, position, feature) tensor with unit feature stride
  float* data;
  int64_t sb, sh, st;
  float* at(int64_t b, int64_t h, int64_t t) const { return data + b * sb + h * sh + t * st; }
};

View view(const float* data, const int64_t* strides) {
  return View{const_cast<float*>(data), strides[0], strides[1], strides[2]};
}

// One head's backward from its stored P (T x T, rows valid up to the end of their block). Row blocks first:
// dS_s = P_s * (dO_s V^T - D) into the head's T x T dS, dQ_s = scale dS_s K. Then per key block [c, c + w),
// one product over every query that sees it: dV_c (+)= P_{>=c, c}^T dO_{>=c}, dK_c (+)= scale dS_{>=c, c}^T Q_{>=c}
// (a long inner dimension, and each dK/dV row written once instead of once per query block).
void stored_head_backward(const View& Q, const View& K, const View& V, const View& O, const View& dO, const View& dQ,
                          int64_t b, int64_t h, int64_t g, int64_t T, int64_t D, const float* P, float* dS,
                          float* delta, float scale, int64_t block, float beta, const View& dK, const View& dV) {
  const float* k0 = K.at(b, g, 0);
  const float* v0 = V.at(b, g, 0);
  for (int64_t s = 0; s < T; s += block) {
    const int64_t e = std::min(s + block, T), rows = e - s;
    const float* do_s = dO.at(b, h, s);
    for (int64_t i = 0; i < rows; ++i) delta[i] = dot(O.at(b, h, s + i), do_s + i * dO.st, D);
    float* d_s = dS + s * T;
    gemm(false, true, rows, e, D, 1.0f, do_s, dO.st, v0, V.st, 0.0f, d_s, T);
    for (int64_t i = 0; i < rows; ++i) {
      const float* p = P + (s + i) * T;
      float* d = d_s + i * T;
      const float di = delta[i];
      for (int64_t j = 0; j < e; ++j) d[j] = p[j] * (d[j] - di);
    }
    gemm(false, false, rows, D, e, scale, d_s, T, k0, K.st, 0.0f, dQ.at(b, h, s), dQ.st);
  }
  // key blocks line up with the query blocks: a diagonal block's rows hold P and dS up to their block's end only
  for (int64_t c = 0; c < T; c += block) {
    const int64_t w = std::min(block, T - c), n = T - c;
    gemm(true, false, w, D, n, 1.0f, P + c * T + c, T, dO.at(b, h, c), dO.st, beta, dV.at(b, g, c), dV.st);
    gemm(true, false, w, D, n, scale, dS + c * T + c, T, Q.at(b, h, c), Q.st, beta, dK.at(b, g, c), dK.st);
  }
}

}  // namespace

extern "C" {

// o = attention(q, k, v); lse (batch, heads, T) contiguous gets each query's log-sum-exp of its scaled scores.
int lmkit_causal_attention_forward(int64_t batch, int64_t heads, int64_t kv_heads, int64_t T, int64_t D,
                                   const float* q, const int64_t* q_strides, const float* k,
                                   const int64_t* k_strides, const float* v, const int64_t* v_strides, float* o,
                                   const int64_t* o_strides, float* lse, float* stored, float scale,
                                   int64_t block, int threads) {
  const View Q = view(q, q_strides), K = view(k, k_strides), V = view(v, v_strides), O = view(o, o_strides);
  const int64_t group = heads / kv_heads;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scores(stored ? 0 : (size_t)(block * T)), inverse((size_t)block);
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < batch * heads; ++task) {
      const int64_t b = task / heads, h = task % heads, g = h / group;
      const float* k0 = K.at(b, g, 0);
      const float* v0 = V.at(b, g, 0);
      float* row_lse = lse + task * T;
      for (int64_t s = 0; s < T; s += block) {
        const int64_t e = std::min(s + block, T), rows = e - s;
        // stored: rows s .. e of the head's T x T matrix (columns from e on are never written or read)
        float* S = stored ? stored + task * T * T + s * T : scores.data();
        const int64_t ld = stored ? T : e;
        gemm(false, true, rows, e, D, scale, Q.at(b, h, s), Q.st, k0, K.st, 0.0f, S, ld);
        for (int64_t i = 0; i < rows; ++i) {
          float* r = S + i * ld;
          const int64_t n = s + i + 1;  // query s + i sees keys 0 .. s + i
          const float mx = row_max(r, n);
          const float sum = exp_shifted(r, n, mx);
          std::fill(r + n, r + e, 0.0f);
          inverse[i] = 1.0f / sum;
          row_lse[s + i] = mx + std::log(sum);
        }
        float* o_s = O.at(b, h, s);
        if (stored) {  // the backward reads P itself
          for (int64_t i = 0; i < rows; ++i) {
            float* r = S + i * ld;
            const float inv = inverse[i];
            for (int64_t j = 0; j <= s + i; ++j) r[j] *= inv;
          }
          gemm(false, false, rows, D, e, 1.0f, S, ld, v0, V.st, 0.0f, o_s, O.st);
        } else {  // P V unnormalised, its rows scaled after: D entries a row instead of e
          gemm(false, false, rows, D, e, 1.0f, S, e, v0, V.st, 0.0f, o_s, O.st);
          for (int64_t i = 0; i < rows; ++i) {
            float* oi = o_s + i * O.st;
            const float inv = inverse[i];
            for (int64_t j = 0; j < D; ++j) oi[j] *= inv;
          }
        }
      }
    }
  }
  return 0;
}

// dq, dk, dv (written whole, not accumulated into) from the output gradient do, the forward's o and lse.
int lmkit_causal_attention_backward(int64_t batch, int64_t heads, int64_t kv_heads, int64_t T, int64_t D,
                                    const float* q, const int64_t* q_strides, const float* k,
                                    const int64_t* k_strides, const float* v, const int64_t* v_strides,
                                    const float* o, const int64_t* o_strides, const float* dout,
                                    const int64_t* dout_strides, const float* lse, const float* stored, float* dq,
                                    const int64_t* dq_strides, float* dk, const int64_t* dk_strides, float* dv,
                                    const int64_t* dv_strides, float scale, int64_t block, int threads) {
  const View Q = view(q, q_strides), K = view(k, k_strides), V = view(v, v_strides), O = view(o, o_strides);
  const View dO = view(dout, dout_strides), dQ = view(dq, dq_strides), dK = view(dk, dk_strides),
             dV = view(dv, dv_strides);
  const int64_t group = heads / kv_heads;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> probs(stored ? 0 : (size_t)(block * T)), dscores((size_t)((stored ? T : block) * T)),
        delta((size_t)block);
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < batch * kv_heads; ++task) {
      const int64_t b = task / kv_heads, g = task % kv_heads;
      const float* k0 = K.at(b, g, 0);
      const float* v0 = V.at(b, g, 0);
      float* dk0 = dK.at(b, g, 0);
      float* dv0 = dV.at(b, g, 0);
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        if (stored) {
          stored_head_backward(Q, K, V, O, dO, dQ, b, h, g, T, D, stored + (b * heads + h) * T * T,
                               dscores.data(), delta.data(), scale, block, h == g * group ? 0.0f : 1.0f, dK, dV);
          continue;
        }
        const float* row_lse = lse + (b * heads + h) * T;
        // the last block sees every key: going backwards, the group's first one writes dK and dV whole
        for (int64_t s = (T - 1) / block * block; s >= 0; s -= block) {
          const int64_t e = std::min(s + block, T), rows = e - s;
          const float first = (h == g * group && e == T) ? 0.0f : 1.0f;
          float* dS = dscores.data();
          const float* q_s = Q.at(b, h, s);
          const float* do_s = dO.at(b, h, s);
          for (int64_t i = 0; i < rows; ++i) {
            delta[i] = dot(O.at(b, h, s + i), do_s + i * dO.st, D);
          }
          float* P = probs.data();  // P = exp(S - L), recomputed
          gemm(false, true, rows, e, D, scale, q_s, Q.st, k0, K.st, 0.0f, P, e);
          for (int64_t i = 0; i < rows; ++i) {
            float* r = P + i * e;
            const int64_t n = s + i + 1;
            exp_shifted(r, n, row_lse[s + i]);
            std::fill(r + n, r + e, 0.0f);
          }
          gemm(true, false, e, D, rows, 1.0f, P, e, do_s, dO.st, first, dv0, dV.st);
          gemm(false, true, rows, e, D, 1.0f, do_s, dO.st, v0, V.st, 0.0f, dS, e);
          for (int64_t i = 0; i < rows; ++i) {
            const float* p = P + i * e;
            float* d = dS + i * e;
            const float di = delta[i];
            for (int64_t j = 0; j < e; ++j) d[j] = p[j] * (d[j] - di);
          }
          gemm(false, false, rows, D, e, scale, dS, e, k0, K.st, 0.0f, dQ.at(b, h, s), dQ.st);
          gemm(true, false, e, D, rows, scale, dS, e, q_s, Q.st, first, dk0, dK.st);
        }
      }
    }
  }
  return 0;
}

}  // extern "C"
