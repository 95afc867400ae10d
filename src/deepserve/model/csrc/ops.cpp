// Registers the kernels as torch.ops.deepserve.* (loaded with torch.ops.load_library
// by model/kernels.py; the library has no Python module of its own).

#define TORCH_ASSERT_ONLY_METHOD_OPERATORS  // per-operator headers (ATen.h: a quarter more compile time)
#include <ATen/core/Tensor.h>
#include <torch/library.h>

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed,
                          const c10::optional<at::Tensor>& bias, int64_t N);
at::Tensor linear_w8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                     const c10::optional<at::Tensor>& bias, int64_t N);
bool vnni_supported();
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                     const at::Tensor& v_cache, const at::Tensor& tables,
                                     const at::Tensor& lens, double scale);
at::Tensor add_rms_norm(const c10::optional<at::Tensor>& x, const at::Tensor& residual,
                        const at::Tensor& weight, double eps);
void rotary(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
            const at::Tensor& sin, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim);
at::Tensor silu_and_mul(const at::Tensor& gate_up);

TORCH_LIBRARY(deepserve, m) {
  m.def("linear_bf16(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor", &linear_bf16);
  m.def("linear_w8(Tensor x, Tensor packed, Tensor scales, Tensor? bias, int n) -> Tensor",
        &linear_w8);
  m.def("vnni_supported() -> bool", [] { return vnni_supported(); });
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, "
        "Tensor lens, float scale) -> Tensor", &paged_decode_attention);
  m.def("add_rms_norm(Tensor? x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor",
        &add_rms_norm);
  m.def("rotary(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, int num_heads, "
        "int num_kv_heads, int head_dim) -> ()", &rotary);
  m.def("silu_and_mul(Tensor gate_up) -> Tensor", &silu_and_mul);
}
