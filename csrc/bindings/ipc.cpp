// bindings/ipc.cpp — moe8._C.IpcBuffer (the `ipc` transport's per-rank buffer, api/ipc.h) and
// moe8._C.ipc_layout. Tensors arrive as DLPack arrays; the methods validate and run in api/.
#include "api/ipc.h"

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <string>
#include <vector>

#include "bindings/view.h"
#include "core/error.h"

namespace nb = nanobind;
using moe8::TensorView;

namespace {

using moe8::bindings::Array;
using moe8::bindings::OptArray;
using moe8::bindings::view;

// Row dtypes by name, as torch prints them without the "torch." prefix.
moe8::DType row_dtype(const std::string& name) {
  const std::string n = name.rfind("torch.", 0) == 0 ? name.substr(6) : name;
  if (n == "float32") return moe8::DType::kF32;
  if (n == "float16") return moe8::DType::kF16;
  if (n == "bfloat16") return moe8::DType::kBF16;
  if (n == "uint8") return moe8::DType::kU8;
  if (n == "float8_e4m3fn") return moe8::DType::kF8E4M3;
  moe8::fail("dtype: expected float32, float16, bfloat16, uint8 or float8_e4m3fn, got ", name);
}

nb::dict layout_dict(const moe8::IpcLayout& L) {
  nb::dict d;
  d["world"] = L.world;
  d["num_local_experts"] = L.num_local_experts;
  d["capacity"] = L.capacity;
  d["row_bytes"] = L.row_bytes;
  d["scale_bytes"] = L.scale_bytes;
  d["stride"] = L.stride;
  d["signals"] = L.signals;
  d["abort"] = L.abort;
  d["counts"] = L.counts;
  d["meta"] = L.meta;
  d["rows"] = L.rows;
  d["ret"] = L.ret;
  d["total"] = L.total;
  return d;
}

}  // namespace

#define V(x) view(x, #x)

void bind_ipc(nb::module_& m) {
  using moe8::api::IpcBuffer;
  m.def(
      "ipc_layout",
      [](int rank, int world, int num_local_experts, int64_t capacity, int64_t hidden, const std::string& dtype,
         int64_t scale_cols) {
        return layout_dict(
            moe8::api::ipc_layout(rank, world, num_local_experts, capacity, hidden, row_dtype(dtype), scale_cols));
      },
      nb::arg("rank"), nb::arg("world"), nb::arg("num_local_experts"), nb::arg("capacity"), nb::arg("hidden"),
      nb::arg("dtype"), nb::arg("scale_cols") = 0);
  nb::class_<IpcBuffer>(m, "IpcBuffer")
      .def(
          "__init__",
          [](IpcBuffer* self, int rank, int world, int num_local_experts, int64_t capacity, int64_t hidden,
             const std::string& dtype, int64_t scale_cols, int device) {
            new (self)
                IpcBuffer(rank, world, num_local_experts, capacity, hidden, row_dtype(dtype), scale_cols, device);
          },
          nb::arg("rank"), nb::arg("world"), nb::arg("num_local_experts"), nb::arg("capacity"), nb::arg("hidden"),
          nb::arg("dtype"), nb::arg("scale_cols"), nb::arg("device"))
      .def("handle",
           [](const IpcBuffer& b) {
             const std::string h = b.handle();
             return nb::bytes(h.data(), h.size());
           })
      .def(
          "open",
          [](IpcBuffer& b, const std::vector<nb::bytes>& handles) {
            std::vector<std::string> hs;
            for (const nb::bytes& h : handles) hs.emplace_back(h.c_str(), h.size());
            b.open(hs);
          },
          nb::arg("handles"))
      .def("close_peers", &IpcBuffer::close_peers, nb::call_guard<nb::gil_scoped_release>())
      .def_prop_ro("bytes", &IpcBuffer::bytes)
      .def_prop_ro("rank", &IpcBuffer::rank)
      .def_prop_ro("layout", [](const IpcBuffer& b) { return layout_dict(b.layout()); })
      .def("check", &IpcBuffer::check, nb::arg("sync") = false, nb::arg("stream") = 0,
           nb::call_guard<nb::gil_scoped_release>())
      .def(
          "dispatch_send",
          [](IpcBuffer& b, Array src, OptArray src_scale, OptArray row_to_slot, Array offsets, OptArray counts,
             OptArray bad, int k, bool by_token, double timeout_s, intptr_t stream, bool check_indices) {
            b.dispatch_send(V(src), V(src_scale), V(row_to_slot), V(offsets), V(counts), V(bad), k, by_token, timeout_s,
                            stream, check_indices);
          },
          nb::arg("src"), nb::arg("src_scale").none(), nb::arg("row_to_slot").none(), nb::arg("offsets"),
          nb::arg("counts").none(), nb::arg("bad").none(), nb::arg("k"), nb::arg("by_token"), nb::arg("timeout_s"),
          nb::arg("stream") = 0, nb::arg("check_indices") = false)
      .def(
          "dispatch_plan",
          [](IpcBuffer& b, Array recv_counts, Array recv_offsets, Array recv_base, bool expert_major, intptr_t stream) {
            b.dispatch_plan(V(recv_counts), V(recv_offsets), V(recv_base), expert_major, stream);
          },
          nb::arg("recv_counts"), nb::arg("recv_offsets"), nb::arg("recv_base"), nb::arg("expert_major"),
          nb::arg("stream") = 0)
      .def(
          "dispatch_recv",
          [](IpcBuffer& b, Array recv_offsets, Array recv_base, bool expert_major, Array rows, OptArray rows_scale,
             OptArray local_ids, OptArray ret, intptr_t stream) {
            b.dispatch_recv(V(recv_offsets), V(recv_base), expert_major, V(rows), V(rows_scale), V(local_ids), V(ret),
                            stream);
          },
          nb::arg("recv_offsets"), nb::arg("recv_base"), nb::arg("expert_major"), nb::arg("rows"),
          nb::arg("rows_scale").none(), nb::arg("local_ids").none(), nb::arg("ret").none(), nb::arg("stream") = 0)
      .def(
          "combine_send",
          [](IpcBuffer& b, Array rows, OptArray rows_scale, Array ret, double timeout_s, intptr_t stream,
             bool check_indices) { b.combine_send(V(rows), V(rows_scale), V(ret), timeout_s, stream, check_indices); },
          nb::arg("rows"), nb::arg("rows_scale").none(), nb::arg("ret"), nb::arg("timeout_s"), nb::arg("stream") = 0,
          nb::arg("check_indices") = false)
      .def(
          "combine_recv",
          [](IpcBuffer& b, Array out, OptArray out_scale, intptr_t stream) {
            b.combine_recv(V(out), V(out_scale), stream);
          },
          nb::arg("out"), nb::arg("out_scale").none(), nb::arg("stream") = 0);
}
