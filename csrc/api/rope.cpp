// api/rope.cpp — validation and backend choice for the rotary position embedding. x and out are strided
// (transformers hands q and k over as a [B,S,H,D] buffer viewed as [B,H,S,D]), so the checks here are of
// strides rather than of contiguity.
#include <algorithm>
#include <cstdint>

#include "api/common.h"
#include "api/ops.h"
#include "core/check.h"
#include "cpu/ops.h"
#include "cuda/ops.h"

namespace moe8::api {
namespace {

void check_last_dim_contiguous(const char* name, const TensorView& t) {
  MOE8_CHECK(t.strides[3] == 1, name,
             ": expected a contiguous last dim (stride(3) == 1), got stride(3) = ", t.strides[3],
             "; call .contiguous() first");
}

// Written in parallel, so no two elements may share an address: the outer dims, by increasing stride,
// each step past everything the inner dims span. An empty tensor has no elements to collide.
void check_no_overlap(const char* name, const TensorView& t) {
  if (t.numel() == 0) return;
  int dims[3] = {0, 1, 2};
  std::sort(dims, dims + 3, [&](int a, int b) { return t.strides[a] < t.strides[b]; });
  int64_t span = t.shape[3];  // elements [0, span) of one row
  for (int d : dims) {
    if (t.shape[d] <= 1) continue;
    MOE8_CHECK(t.strides[d] >= span, name, ": expected non-overlapping strides, got stride(", d, ") = ", t.strides[d],
               " inside the ", span, " elements the inner dims span");
    span += t.strides[d] * (t.shape[d] - 1);
  }
}

void check_table(const char* name, const TensorView& t, const TensorView& x) {
  check_tensor(name, t, "x", x);
  check_same_dtype(name, t, "x", x);
  check_ndim(name, t, 3);
  const int64_t B = x.shape[0], S = x.shape[2], D = x.shape[3];
  MOE8_CHECK((t.shape[0] == B || t.shape[0] == 1) && t.shape[1] == S && t.shape[2] == D, name, ": expected shape [", B,
             " or 1, ", S, ", ", D, "] (x [B, H, S, D] = ", x.shape_str(), "), got ", t.shape_str());
}

}  // namespace

void rope(const TensorView& x, const TensorView& cos, const TensorView& sin, const TensorView& out, bool backward,
          intptr_t stream) {
  check_present("x", x);
  check_ndim("x", x, 4);
  check_float("x", x);
  const int64_t D = x.shape[3];
  MOE8_CHECK(D >= 2 && D % 2 == 0, "x: expected an even head dim x.shape[3] >= 2 (pairs i, i + D/2), got ", D);
  check_last_dim_contiguous("x", x);
  check_table("cos", cos, x);
  check_table("sin", sin, x);
  MOE8_CHECK(sin.shape[0] == cos.shape[0], "sin: expected shape ", cos.shape_str(), " (same as cos), got ",
             sin.shape_str());
  check_present("out", out);
  check_device("out", out, "x", x);
  check_same_dtype("out", out, "x", x);
  check_shape("out", out, {x.shape[0], x.shape[1], x.shape[2], D});
  check_last_dim_contiguous("out", out);
  check_no_overlap("out", out);
  if (on_cuda(x, "rope")) {
    cuda::rope(x, cos, sin, out, backward, as_ptr(stream));
  } else {
    cpu::rope(x, cos, sin, out, backward);
  }
}

}  // namespace moe8::api
