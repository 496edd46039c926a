// api/optim.cpp — validation and backend choice for the optimizer steps.
#include "cuda/optim.h"

#include <cmath>
#include <string>

#include "api/common.h"
#include "api/ops.h"
#include "core/adamw.h"
#include "core/check.h"
#include "cpu/ops.h"

namespace moe8::api {
namespace {

bool same_shape(const TensorView& a, const TensorView& b) {
  if (a.ndim != b.ndim) return false;
  for (int d = 0; d < a.ndim; ++d)
    if (a.shape[d] != b.shape[d]) return false;
  return true;
}

}  // namespace

void adamw_step(const std::vector<TensorView>& params, const std::vector<TensorView>& grads,
                const std::vector<TensorView>& exp_avgs, const std::vector<TensorView>& exp_avg_sqs, double lr,
                double beta1, double beta2, double eps, double weight_decay, int64_t step, bool maximize,
                intptr_t stream) {
  const size_t n = params.size();
  MOE8_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n,
             "grads, exp_avgs, exp_avg_sqs: expected one tensor per param (", n, "), got ", grads.size(), ", ",
             exp_avgs.size(), ", ", exp_avg_sqs.size());
  MOE8_CHECK(std::isfinite(lr) && lr >= 0, "lr: expected a finite value >= 0, got ", lr);
  MOE8_CHECK(beta1 >= 0 && beta1 < 1, "beta1: expected a value in [0, 1), got ", beta1);
  MOE8_CHECK(beta2 >= 0 && beta2 < 1, "beta2: expected a value in [0, 1), got ", beta2);
  MOE8_CHECK(std::isfinite(eps) && eps >= 0, "eps: expected a finite value >= 0, got ", eps);
  MOE8_CHECK(std::isfinite(weight_decay) && weight_decay >= 0, "weight_decay: expected a finite value >= 0, got ",
             weight_decay);
  MOE8_CHECK(step >= 1, "step: expected the step count after this step (>= 1), got ", step);
  if (n == 0) return;
  const TensorView& ref = params[0];
  check_present("params[0]", ref);
  check_float("params[0]", ref);
  for (size_t i = 0; i < n; ++i) {
    const std::string idx = "[" + std::to_string(i) + "]";
    const std::string pn = "params" + idx;
    check_tensor(pn.c_str(), params[i], "params[0]", ref);
    check_same_dtype(pn.c_str(), params[i], "params[0]", ref);
    const std::pair<const char*, const TensorView*> others[] = {
        {"grads", &grads[i]}, {"exp_avgs", &exp_avgs[i]}, {"exp_avg_sqs", &exp_avg_sqs[i]}};
    for (const auto& [list, t] : others) {
      const std::string name = list + idx;
      check_tensor(name.c_str(), *t, "params[0]", ref);
      check_same_dtype(name.c_str(), *t, pn.c_str(), params[i]);
      MOE8_CHECK(same_shape(*t, params[i]), name, ": expected the shape of ", pn, " ", params[i].shape_str(), ", got ",
                 t->shape_str());
    }
    MOE8_CHECK(params[i].numel() == 0 || (params[i].data != exp_avgs[i].data && params[i].data != exp_avg_sqs[i].data &&
                                          exp_avgs[i].data != exp_avg_sqs[i].data),
               pn, ", exp_avgs", idx, ", exp_avg_sqs", idx, ": expected three distinct tensors (each is written)");
  }
  const AdamWScalars s = adamw_scalars(lr, beta1, beta2, eps, weight_decay, static_cast<double>(step), maximize);
  if (on_cuda(ref, "adamw_step")) {
    cuda::adamw_step(params, grads, exp_avgs, exp_avg_sqs, s, as_ptr(stream));
  } else {
    cpu::adamw_step(params, grads, exp_avgs, exp_avg_sqs, s);
  }
}

}  // namespace moe8::api
