#pragma once

#include <string>

namespace amp8 {

/// The dense (no sparsity) bf16 tensor-core peak of a GPU, in FLOP/s, from its name as CUDA
/// reports it ("NVIDIA H200", "NVIDIA A100-SXM4-80GB", ...), for MFU: NVIDIA's data-sheet
/// figures (H100/H200 SXM 989 TFLOP/s, H100 PCIe 756, H100 NVL 835, A100 312, L40S 362, B200
/// 2250). 0 when the GPU is not in the table.
double dense_bf16_peak_flops(const std::string& device_name);

/// The name of CUDA device `index` ("" without CUDA).
std::string cuda_device_name(int index);

}  // namespace amp8
