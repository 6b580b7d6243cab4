// flyspec_cpp::packed_linear: flyspec::packed_linear's body in C++, for the graphs `--compile` calls from C++.
//
// The packed weights stay owned by their PackedLinear modules (runtime/packed_linears.py); `remember` keeps a
// reference here under the module's handle and `forget` (the module's finalizer) drops it. Many rows (a prompt) go to
// oneDNN's linear (mkldnn::_linear_pointwise) through the dispatcher: no Python on the way. A cached step's few rows
// (up to kStepRows; kBfloat16StepRows in bf16) are read here straight out of oneDNN's packed weight (`streamed`),
// where `remember` found its layout to be the one below: oneDNN's own call costs ~10 us of bookkeeping (through
// ideep), times 121 linears a SmolLM2 step, on weights that take 15-60 us to stream (BENCHMARKS.md, issue 53). Built
// on first use by inductor's C++ builder, as `--compile` builds its own kernels.
//
// The layout oneDNN gives a weight [N, K] packed for a few rows (measured on AVX-512 CPUs, checked value by value for
// each weight at `remember`): blocks of 64 outputs, each block K rows of its 64 outputs' weights (float32), or K/2
// rows of the 64 outputs' weight pairs for k and k + 1 (bfloat16). Each output is summed over k in order in one
// float32 lane whatever the number of rows, so a row's result does not depend on the rows beside it: a float32 draft's
// verification computes each position exactly as a one-token step does. A weight in any other layout (another CPU's
// oneDNN, a padded one) keeps oneDNN's call.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <type_traits>
#include <unordered_map>

namespace at::native {  // exported by libtorch_cpu (ATen/native/mkldnn/MKLDNNCommon.h, not shipped in the wheel)
void* data_ptr_from_mkldnn(const at::Tensor& mkldnn_tensor);
int64_t nbytes_from_mkldnn(const at::Tensor& mkldnn_tensor);
}  // namespace at::native

namespace {

using Vec = at::vec::Vectorized<float>;
using IntVec = at::vec::Vectorized<int32_t>;
constexpr int64_t kBlock = 64;     // outputs per block of the packed layout
// rows read here; more go to oneDNN. float32: a cached step's (up to 64), 6-16 % less time than oneDNN's from 1 to 64
// rows (a step's 121 SmolLM2 linears, Zen 5). bfloat16: up to 4, where oneDNN's bf16 dot products (two products an
// instruction) overtake these float32 ones (-19 % at one row, -12 % at 4, +1 % at 8, +24 % at 16).
constexpr int64_t kStepRows = 64;
constexpr int64_t kBfloat16StepRows = 4;
constexpr int64_t kColumns = kBlock / Vec::size();  // vectors of outputs per block
#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kRowChunk = 6;  // rows at a time: 6 x 4 accumulators, 4 weight vectors (32 registers)
#else
constexpr int64_t kRowChunk = 2;
#endif

struct Weight {
  at::Tensor packed;
  bool streamed = false;  // its layout is the one above: a step's rows are read here
  int64_t outputs = 0, inputs = 0, stride = 0;  // N, K and K as packed (a block's rows)
  const void* data = nullptr;
};

std::mutex weights_lock;
std::unordered_map<int64_t, Weight> weights;

// where the packed layout keeps weight (n, k), in elements
inline int64_t packed_index(bool pairs, int64_t stride, int64_t n, int64_t k) {
  int64_t block = (n / kBlock) * stride * kBlock;
  return pairs ? block + (k / 2) * 2 * kBlock + (n % kBlock) * 2 + k % 2 : block + k * kBlock + n % kBlock;
}

// whether `packed` holds `dense` [N, K] in the layout above, value for value
template <typename T>
bool laid_out_as_read(const T* packed, int64_t elements, const at::Tensor& dense, bool pairs, int64_t* stride) {
  const int64_t outputs = dense.size(0), inputs = dense.size(1);
  const int64_t padded = (outputs + kBlock - 1) / kBlock * kBlock;
  if (elements % padded != 0) return false;
  *stride = elements / padded;
  if (*stride < inputs || (pairs && (*stride % 2 != 0 || inputs % 2 != 0))) return false;
  const T* values = dense.data_ptr<T>();
  for (int64_t n = 0; n < outputs; ++n)
    for (int64_t k = 0; k < inputs; ++k)
      if (std::memcmp(&packed[packed_index(pairs, *stride, n, k)], &values[n * inputs + k], sizeof(T)) != 0)
        return false;
  return true;
}

// `dense`: the same weight unpacked [N, K] (packed.to_dense()), to check the packed layout against
void remember(int64_t handle, const at::Tensor& packed, const at::Tensor& dense) {
  Weight weight{packed};
  weight.outputs = dense.size(0);
  weight.inputs = dense.size(1);
  const bool readable = Vec::size() * kColumns == kBlock && dense.dim() == 2 && dense.is_contiguous();
  if (readable && packed.is_mkldnn() && (dense.scalar_type() == at::kFloat || dense.scalar_type() == at::kBFloat16)) {
    weight.data = at::native::data_ptr_from_mkldnn(packed);
    const int64_t elements = at::native::nbytes_from_mkldnn(packed) / dense.element_size();
    weight.streamed = dense.scalar_type() == at::kFloat
                          ? laid_out_as_read(static_cast<const float*>(weight.data), elements, dense, false,
                                             &weight.stride)
                          : laid_out_as_read(static_cast<const at::BFloat16*>(weight.data), elements, dense, true,
                                             &weight.stride);
  }
  std::lock_guard<std::mutex> guard(weights_lock);
  weights[handle] = weight;
}

bool streamed(int64_t handle) {
  std::lock_guard<std::mutex> guard(weights_lock);
  auto found = weights.find(handle);
  return found != weights.end() && found->second.streamed;
}

// R rows (x: float32 [R, ld]) times C vector columns of one block (its rows of weights from `block`), into
// acc[r][c]; a float32 block's row k is 64 outputs' weights, a bfloat16 block's row k/2 their (k, k+1) pairs
template <int R, int C>
inline void block_rows(const float* block, int64_t inputs, const float* x, int64_t ld,
                       Vec (&acc)[kRowChunk][kColumns]) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = Vec(0.f);
  for (int64_t k = 0; k < inputs; ++k) {
    Vec w[C];
    for (int c = 0; c < C; ++c) w[c] = Vec::loadu(block + k * kBlock + c * Vec::size());
    for (int r = 0; r < R; ++r) {
      const Vec xv(x[r * ld + k]);
      for (int c = 0; c < C; ++c) acc[r][c] = at::vec::fmadd(w[c], xv, acc[r][c]);
    }
  }
}

template <int R, int C>
inline void block_rows(const at::BFloat16* block, int64_t inputs, const float* x, int64_t ld,
                       Vec (&acc)[kRowChunk][kColumns]) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = Vec(0.f);
  const IntVec high(static_cast<int32_t>(0xFFFF0000u));
  const IntVec sixteen(16);
  for (int64_t k = 0; k < inputs; k += 2) {
    Vec even[C], odd[C];  // the weights for k and for k + 1, as float32 (exact)
    for (int c = 0; c < C; ++c) {
      const IntVec pairs = IntVec::loadu(block + k * kBlock + c * 2 * Vec::size());
      even[c] = at::vec::cast<float>(pairs << sixteen);
      odd[c] = at::vec::cast<float>(pairs & high);
    }
    for (int r = 0; r < R; ++r) {
      const Vec x0(x[r * ld + k]), x1(x[r * ld + k + 1]);
      for (int c = 0; c < C; ++c) {
        acc[r][c] = at::vec::fmadd(even[c], x0, acc[r][c]);
        acc[r][c] = at::vec::fmadd(odd[c], x1, acc[r][c]);
      }
    }
  }
}

template <int R, typename T>
void rows_of_block(const T* block, const Weight& weight, const float* x, int64_t first_column, int64_t columns,
                   int64_t n0, const float* bias, T* out) {
  Vec acc[kRowChunk][kColumns];
  const int64_t ld = weight.inputs;
  const T* base = block + first_column * Vec::size() * (std::is_same_v<T, float> ? 1 : 2);
  switch (columns) {
#define FLYSPEC_COLUMNS(C) \
  case C:                  \
    block_rows<R, C>(base, weight.inputs, x, ld, acc); \
    break;
    FLYSPEC_COLUMNS(1)
    FLYSPEC_COLUMNS(2)
    FLYSPEC_COLUMNS(3)
    FLYSPEC_COLUMNS(4)
#if !defined(CPU_CAPABILITY_AVX512)
    FLYSPEC_COLUMNS(5)
    FLYSPEC_COLUMNS(6)
    FLYSPEC_COLUMNS(7)
    FLYSPEC_COLUMNS(8)
#endif
#undef FLYSPEC_COLUMNS
    default:
      TORCH_CHECK(false, "flyspec_cpp::packed_linear: ", columns, " columns of a block");
  }
  for (int r = 0; r < R; ++r) {
    for (int64_t c = 0; c < columns; ++c) {
      const int64_t n = n0 + c * Vec::size();
      const int64_t count = std::min<int64_t>(Vec::size(), weight.outputs - n);
      if (count <= 0) break;
      Vec result = acc[r][c];
      if (bias != nullptr) result = result + Vec::loadu(bias + n, count);
      float lanes[Vec::size()];
      result.store(lanes);
      T* row = out + r * weight.outputs + n;
      for (int64_t lane = 0; lane < count; ++lane) row[lane] = static_cast<T>(lanes[lane]);
    }
  }
}

template <typename T>
void chunk_of_rows(int64_t rows, const T* packed, const Weight& weight, const float* x, int64_t first, int64_t last,
                   const float* bias, T* out) {
  // items [first, last): vector columns of the blocks in order; this thread's blocks one at a time, all its rows on
  // a block before the next (the block stays in cache while the rows read it)
  const int64_t block_elements = weight.stride * kBlock;
  for (int64_t item = first; item < last;) {
    const int64_t block = item / kColumns, column = item % kColumns;
    const int64_t columns = std::min(kColumns - column, last - item);
    const T* base = packed + block * block_elements;
    const int64_t n0 = block * kBlock + column * Vec::size();
    for (int64_t r0 = 0; r0 < rows; r0 += kRowChunk) {
      const float* xr = x + r0 * weight.inputs;
      T* outr = out + r0 * weight.outputs;
      switch (std::min(kRowChunk, rows - r0)) {
#define FLYSPEC_ROWS(R) \
  case R:               \
    rows_of_block<R>(base, weight, xr, column, columns, n0, bias, outr); \
    break;
        FLYSPEC_ROWS(1)
        FLYSPEC_ROWS(2)
#if defined(CPU_CAPABILITY_AVX512)
        FLYSPEC_ROWS(3)
        FLYSPEC_ROWS(4)
        FLYSPEC_ROWS(5)
        FLYSPEC_ROWS(6)
#endif
#undef FLYSPEC_ROWS
      }
    }
    item += columns;
  }
}

at::Tensor streamed_linear(const at::Tensor& rows, const Weight& weight, const std::optional<at::Tensor>& bias) {
  const int64_t count = rows.size(0);
  const at::Tensor x = rows.to(at::kFloat).contiguous();  // float32 copies of the rows (exact for bf16)
  at::Tensor bias32;
  if (bias.has_value() && bias->defined()) bias32 = bias->to(at::kFloat).contiguous();
  const float* bias_data = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({count, weight.outputs}, rows.options());
  const int64_t items = (weight.outputs + kBlock - 1) / kBlock * kColumns;
  at::parallel_for(0, items, 1, [&](int64_t first, int64_t last) {
    if (rows.scalar_type() == at::kFloat)
      chunk_of_rows(count, static_cast<const float*>(weight.data), weight, x.data_ptr<float>(), first, last, bias_data,
                    out.data_ptr<float>());
    else
      chunk_of_rows(count, static_cast<const at::BFloat16*>(weight.data), weight, x.data_ptr<float>(), first, last,
                    bias_data, out.data_ptr<at::BFloat16>());
  });
  return out;
}

void forget(int64_t handle) {
  std::lock_guard<std::mutex> guard(weights_lock);
  weights.erase(handle);
}

at::Tensor packed_linear(const at::Tensor& rows, int64_t handle, int64_t out_features,
                         const std::optional<at::Tensor>& bias) {
  static auto linear = c10::Dispatcher::singleton()
                           .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                           .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                             c10::string_view, c10::List<std::optional<c10::Scalar>>,
                                             std::optional<c10::string_view>)>();
  Weight weight;
  {
    std::lock_guard<std::mutex> guard(weights_lock);
    auto found = weights.find(handle);
    TORCH_CHECK(found != weights.end(), "flyspec_cpp::packed_linear: no packed weight under handle ", handle);
    weight = found->second;
  }
  TORCH_CHECK(rows.dim() == 2 && weight.outputs == out_features && rows.size(1) == weight.inputs,
              "flyspec_cpp::packed_linear: rows ", rows.sizes(), " do not fit the weight under handle ", handle);
  const int64_t most = rows.scalar_type() == at::kBFloat16 ? kBfloat16StepRows : kStepRows;
  if (weight.streamed && rows.size(0) <= most && rows.scalar_type() == weight.packed.scalar_type())
    return streamed_linear(rows, weight, bias);
  return linear.call(rows, weight.packed, bias, "none", c10::List<std::optional<c10::Scalar>>(), std::nullopt);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flyspec_cpp, m) {
  m.def("remember(int handle, Tensor packed, Tensor dense) -> ()", remember);
  m.def("streamed(int handle) -> bool", streamed);
  m.def("forget(int handle) -> ()", forget);
  m.def("packed_linear(Tensor rows, int handle, int out_features, Tensor? bias) -> Tensor");
  m.impl("packed_linear", c10::DispatchKey::CPU, TORCH_FN(packed_linear));
}
