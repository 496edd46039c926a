# cmake/cutlass.cmake — the Hopper kernels built on CUTLASS (csrc/cuda/grouped_gemm_sm90.cu, bf16/f16;
# csrc/cuda/grouped_gemm_act_sm90.cu, the down projection's dgrad with the activation backward in its epilogue;
# csrc/cuda/grouped_gemm_fp8_sm90.cu, FP8 blockwise).
# Included from CMakeLists.txt after the moe8 target has its CUDA sources. CUTLASS is header-only and
# comes, pinned, from the nvidia-cutlass wheel (its headers are under cutlass_library/source/include);
# it is never copied into the repository. Without it the file compiles to stubs that report the sm90
# path unsupported, and the portable grouped GEMM is used.
#   MOE8_CUTLASS      AUTO | ON | OFF   build the CUTLASS kernels (AUTO: when the headers are found)
#   MOE8_CUTLASS_DIR  path              CUTLASS include root (holding cutlass/ and cute/); when empty,
#                                       $ENV{MOE8_CUTLASS_DIR}, then the installed nvidia-cutlass wheel
set(MOE8_CUTLASS AUTO CACHE STRING "Build the CUTLASS sm90a kernels: AUTO, ON or OFF")
set(MOE8_CUTLASS_DIR "" CACHE PATH "CUTLASS include root (holds cutlass/cutlass.h and cute/tensor.hpp)")
set(MOE8_CUTLASS_VERSION_PINNED "4.2.0")

set(MOE8_WITH_CUTLASS OFF)
if(MOE8_WITH_CUDA AND NOT MOE8_CUTLASS STREQUAL "OFF")
  if(NOT MOE8_CUTLASS_DIR AND DEFINED ENV{MOE8_CUTLASS_DIR})
    set(MOE8_CUTLASS_DIR "$ENV{MOE8_CUTLASS_DIR}")
  endif()
  if(NOT MOE8_CUTLASS_DIR)
    # Locate the wheel without importing it (importing cutlass_library pulls in its Python generator).
    if(Python_EXECUTABLE)
      set(_moe8_py "${Python_EXECUTABLE}")
    elseif(Python3_EXECUTABLE)
      set(_moe8_py "${Python3_EXECUTABLE}")
    else()
      find_program(_moe8_py NAMES python3 python)
    endif()
    if(_moe8_py)
      execute_process(
        COMMAND "${_moe8_py}" -c
                "import importlib.util as u, os; s = u.find_spec('cutlass_library'); print(os.path.join(list(s.submodule_search_locations)[0], 'source', 'include') if s else '')"
        OUTPUT_VARIABLE _moe8_cutlass_found OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE _moe8_rc)
      if(_moe8_rc EQUAL 0 AND _moe8_cutlass_found)
        set(MOE8_CUTLASS_DIR "${_moe8_cutlass_found}")
      endif()
    endif()
  endif()

  if(MOE8_CUTLASS_DIR AND EXISTS "${MOE8_CUTLASS_DIR}/cutlass/cutlass.h" AND EXISTS "${MOE8_CUTLASS_DIR}/cute/tensor.hpp")
    file(STRINGS "${MOE8_CUTLASS_DIR}/cutlass/version.h" _moe8_v REGEX "^#define CUTLASS_(MAJOR|MINOR|PATCH) ")
    string(REGEX REPLACE ".*CUTLASS_MAJOR ([0-9]+).*CUTLASS_MINOR ([0-9]+).*CUTLASS_PATCH ([0-9]+).*" "\\1.\\2.\\3"
                         MOE8_CUTLASS_VERSION "${_moe8_v}")
    if(NOT MOE8_CUTLASS_VERSION VERSION_EQUAL MOE8_CUTLASS_VERSION_PINNED)
      message(WARNING "moe8: CUTLASS ${MOE8_CUTLASS_VERSION} at ${MOE8_CUTLASS_DIR}; the sm90 kernels are "
                      "tested with ${MOE8_CUTLASS_VERSION_PINNED} (pip install nvidia-cutlass==4.2.0.0)")
    endif()
    # Only these files see CUTLASS. -DNDEBUG keeps CUTLASS's device-side asserts out of every build type.
    set_source_files_properties("${PROJECT_SOURCE_DIR}/csrc/cuda/grouped_gemm_sm90.cu"
                                "${PROJECT_SOURCE_DIR}/csrc/cuda/grouped_gemm_act_sm90.cu"
                                "${PROJECT_SOURCE_DIR}/csrc/cuda/grouped_gemm_fp8_sm90.cu" PROPERTIES
      COMPILE_DEFINITIONS "MOE8_WITH_CUTLASS=1;NDEBUG"
      INCLUDE_DIRECTORIES "${MOE8_CUTLASS_DIR}")
    set(MOE8_WITH_CUTLASS ON)
  elseif(MOE8_CUTLASS STREQUAL "ON")
    message(FATAL_ERROR "MOE8_CUTLASS=ON but no CUTLASS headers were found (MOE8_CUTLASS_DIR='${MOE8_CUTLASS_DIR}'); "
                        "pip install nvidia-cutlass==4.2.0.0 or set MOE8_CUTLASS_DIR to <cutlass>/include")
  endif()
endif()
if(MOE8_WITH_CUTLASS)
  message(STATUS "moe8: CUTLASS sm90a kernels ON (CUTLASS ${MOE8_CUTLASS_VERSION} at ${MOE8_CUTLASS_DIR})")
else()
  message(STATUS "moe8: CUTLASS sm90a kernels OFF (stubs)")
endif()
