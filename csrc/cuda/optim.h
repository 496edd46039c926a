// cuda/optim.h — the optimizer steps' kernels (optim.cu), launched on `stream`, never synchronising. Arguments
// are validated by api/optim.cpp; semantics: cpu/ops.h, the same bits.
#pragma once
#include <vector>

#include "core/adamw.h"
#include "core/tensor.h"

namespace moe8::cuda {

// Tensors per launch: the batch travels as a kernel argument.
constexpr int kAdamWBatch = 48;

// One AdamW step over the tensors: params[i], grads[i], exp_avgs[i], exp_avg_sqs[i] of one shape, one float dtype
// for all, on one device; one launch per kAdamWBatch tensors, every tensor's chunks in one grid.
void adamw_step(const std::vector<TensorView>& params, const std::vector<TensorView>& grads,
                const std::vector<TensorView>& exp_avgs, const std::vector<TensorView>& exp_avg_sqs,
                const AdamWScalars& s, void* stream);

}  // namespace moe8::cuda
