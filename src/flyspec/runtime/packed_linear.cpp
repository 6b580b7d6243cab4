// flyspec_cpp::packed_linear: flyspec::packed_linear's body in C++, for the graphs `--compile` calls from C++.
//
// The packed weights stay owned by their PackedLinear modules (runtime/packed_linears.py); `remember` keeps a
// reference here under the module's handle and `forget` (the module's finalizer) drops it. The operator looks the
// weight up and calls oneDNN's linear (mkldnn::_linear_pointwise) through the dispatcher: no Python on the way.
// Built on first use by inductor's C++ builder, as `--compile` builds its own kernels (BENCHMARKS.md, issue 53).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <mutex>
#include <unordered_map>

namespace {

std::mutex weights_lock;
std::unordered_map<int64_t, at::Tensor> weights;

void remember(int64_t handle, const at::Tensor& packed) {
  std::lock_guard<std::mutex> guard(weights_lock);
  weights[handle] = packed;
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
  at::Tensor weight;
  {
    std::lock_guard<std::mutex> guard(weights_lock);
    auto found = weights.find(handle);
    TORCH_CHECK(found != weights.end(), "flyspec_cpp::packed_linear: no packed weight under handle ", handle);
    weight = found->second;
  }
  TORCH_CHECK(rows.dim() == 2 && weight.size(0) == out_features, "flyspec_cpp::packed_linear: rows ", rows.sizes(),
              " do not fit the weight under handle ", handle);
  return linear.call(rows, weight, bias, "none", c10::List<std::optional<c10::Scalar>>(), std::nullopt);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flyspec_cpp, m) {
  m.def("remember(int handle, Tensor packed) -> ()", remember);
  m.def("forget(int handle) -> ()", forget);
  m.def("packed_linear(Tensor rows, int handle, int out_features, Tensor? bias) -> Tensor");
  m.impl("packed_linear", c10::DispatchKey::CPU, TORCH_FN(packed_linear));
}
