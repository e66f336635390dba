"""Compiler flags for every amp8 target, defined once."""

AMP8_COPTS = [
    "-std=c++20",
    "-Wall",
    "-Wextra",
    "-Wno-unused-parameter",
    "-Wno-missing-field-initializers",
    "-fPIC",
]

# nvcc: sm_90 machine code (H100/H200) plus compute_90 PTX for newer chips. No fast-math:
# the scale formula must round exactly like the CPU reference.
AMP8_NVCC_FLAGS = [
    "-std=c++20",
    "-O3",
    "--expt-relaxed-constexpr",
    "-Xcompiler=-fPIC",
    "-gencode=arch=compute_90,code=sm_90",
    "-gencode=arch=compute_90,code=compute_90",
]
