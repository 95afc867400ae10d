// Registers the kernels as torch.ops.deepserve.* (loaded with torch.ops.load_library
// by model/kernels.py; the library has no Python module of its own).

#include <ATen/ATen.h>
#include <torch/library.h>

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed,
                          const c10::optional<at::Tensor>& bias, int64_t N);
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                     const at::Tensor& v_cache, const at::Tensor& tables,
                                     const at::Tensor& lens, double scale);

TORCH_LIBRARY(deepserve, m) {
  m.def("linear_bf16(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor", &linear_bf16);
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, "
        "Tensor lens, float scale) -> Tensor", &paged_decode_attention);
}
