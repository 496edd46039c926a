// api/loss.cpp — validation and backend choice for the cross-entropy rows of the chunked LM loss.
#include <cstdint>

#include "api/common.h"
#include "api/ops.h"
#include "core/check.h"
#include "cpu/ops.h"
#include "cuda/ops.h"

namespace moe8::api {

void cross_entropy_rows(const TensorView& logits, const TensorView& target, int64_t ignore_index,
                        const TensorView& loss, intptr_t stream) {
  check_float_matrix("logits", logits);
  const int64_t n = logits.size(0);
  check_tensor("target", target, "logits", logits);
  check_dtype("target", target, {DType::kI64});
  check_shape("target", target, {n});
  check_tensor("loss", loss, "logits", logits);
  check_dtype("loss", loss, {DType::kF32});
  check_shape("loss", loss, {n});
  if (on_cuda(logits, "cross_entropy_rows")) {
    cuda::cross_entropy_rows(logits, target, ignore_index, loss, as_ptr(stream));
  } else {
    cpu::cross_entropy_rows(logits, target, ignore_index, loss);
  }
}

}  // namespace moe8::api
