// api/rmsnorm.cpp — validation and backend choice for RMSNorm, forward and backward, and the size of the
// backward's GPU workspace (its weight-gradient partials).
#include <cmath>
#include <cstdint>

#include "api/common.h"
#include "api/ops.h"
#include "core/check.h"
#include "cpu/ops.h"
#include "cuda/ops.h"
#include "cuda/rmsnorm_heuristics.h"

namespace moe8::api {
namespace {

// weight [H] of x's dtype on x's device.
void check_weight(const char* name, const TensorView& w, const TensorView& x) {
  check_tensor(name, w, "x", x);
  check_same_dtype(name, w, "x", x);
  check_shape(name, w, {x.shape[1]});
}

}  // namespace

int64_t rms_norm_workspace_elems(int64_t rows, int64_t cols, bool on_cuda) {
  MOE8_CHECK(rows >= 0 && cols >= 0, "rows, cols: expected sizes >= 0, got ", rows, ", ", cols);
  return on_cuda ? cuda::rmsnorm_heuristics::workspace_rows(rows) * cols : 0;
}

void rms_norm_forward(const TensorView& x, const TensorView& weight, double eps, const TensorView& y,
                      const TensorView& rstd, intptr_t stream) {
  check_float_matrix("x", x);
  const int64_t R = x.shape[0], H = x.shape[1];
  check_weight("weight", weight, x);
  MOE8_CHECK(std::isfinite(eps) && eps >= 0, "eps: expected a finite value >= 0, got ", eps);
  check_tensor("y", y, "x", x);
  check_same_dtype("y", y, "x", x);
  check_shape("y", y, {R, H});
  check_tensor("rstd", rstd, "x", x);
  check_dtype("rstd", rstd, {DType::kF32});
  check_shape("rstd", rstd, {R});
  if (on_cuda(x, "rms_norm_forward")) {
    cuda::rms_norm_forward(x, weight, static_cast<float>(eps), y, rstd, as_ptr(stream));
  } else {
    cpu::rms_norm_forward(x, weight, static_cast<float>(eps), y, rstd);
  }
}

void rms_norm_backward(const TensorView& dy, const TensorView& x, const TensorView& weight, const TensorView& rstd,
                       const TensorView& dx, const TensorView& dweight, const TensorView& workspace, intptr_t stream) {
  check_float_matrix("x", x);
  const int64_t R = x.shape[0], H = x.shape[1];
  check_tensor("dy", dy, "x", x);
  check_same_dtype("dy", dy, "x", x);
  check_shape("dy", dy, {R, H});
  check_weight("weight", weight, x);
  check_tensor("rstd", rstd, "x", x);
  check_dtype("rstd", rstd, {DType::kF32});
  check_shape("rstd", rstd, {R});
  check_tensor("dx", dx, "x", x);
  check_same_dtype("dx", dx, "x", x);
  check_shape("dx", dx, {R, H});
  check_weight("dweight", dweight, x);
  if (on_cuda(x, "rms_norm_backward")) {
    const int64_t need = rms_norm_workspace_elems(R, H, true);
    check_tensor("workspace", workspace, "x", x);
    check_dtype("workspace", workspace, {DType::kF32});
    MOE8_CHECK(workspace.numel() >= need, "workspace: expected at least ", need,
               " float32 elements (rms_norm_workspace_elems), got ", workspace.numel());
    cuda::rms_norm_backward(dy, x, weight, rstd, dx, dweight, workspace, as_ptr(stream));
  } else {
    cpu::rms_norm_backward(dy, x, weight, rstd, dx, dweight);
  }
}

}  // namespace moe8::api
