// cpu/optim.cpp — the AdamW step's reference: each element updated by core/adamw.h, tensor by tensor.
#include "core/adamw.h"
#include "core/parallel.h"
#include "cpu/common.h"
#include "cpu/ops.h"

namespace moe8::cpu {

void adamw_step(const std::vector<TensorView>& params, const std::vector<TensorView>& grads,
                const std::vector<TensorView>& exp_avgs, const std::vector<TensorView>& exp_avg_sqs,
                const AdamWScalars& s) {
  for (size_t i = 0; i < params.size(); ++i) {
    MOE8_CPU_DISPATCH_FLOAT(params[i].dtype, "adamw_step", [&] {
      scalar_t* p = params[i].ptr<scalar_t>();
      const scalar_t* g = grads[i].ptr<scalar_t>();
      scalar_t* m = exp_avgs[i].ptr<scalar_t>();
      scalar_t* v = exp_avg_sqs[i].ptr<scalar_t>();
      parallel_for(params[i].numel(), 1 << 16, [&](int64_t j) {
        float pf = to_f(p[j]), mf = to_f(m[j]), vf = to_f(v[j]);
        adamw_update(s, to_f(g[j]), pf, mf, vf);
        p[j] = from_f<scalar_t>(pf);
        m[j] = from_f<scalar_t>(mf);
        v[j] = from_f<scalar_t>(vf);
      });
    });
  }
}

}  // namespace moe8::cpu
