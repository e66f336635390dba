// cast_transpose with amax on large bf16 matrices: effective bandwidth against a
// device-to-device copy measured in the same run, and speedup over eager LibTorch doing
// amax, scale+cast and transpose as separate ops; with the fused bias gradient (dbias) against
// cast_transpose + LibTorch's column sum; with GELU / GELU's backward inside the cast against
// LibTorch's GELU kernels before it. Also the plain quantize kernel, and the blockwise
// quantization (1×128 and 128×128 tiles, with transposes; 1×128 with GELU or its backward inside
// against LibTorch's GELU kernels before it), and every FP8 weight of a GPT
// quantized in one quantize_many launch against one quantize per weight, and in 128×128 blocks
// (in two passes over shards, and in one read of whole weights).

#include <ATen/ATen.h>

#include <tuple>
#include <vector>

#include "bench/bench_util.h"
#include "ops/blockwise.h"
#include "ops/cuda/kernels.h"
#include "ops/quantize.h"
#include "ops/swiglu.h"

int main(int argc, char** argv) {
  using namespace amp8;
  const std::string cmd = bench::command_line(argc, argv);
  at::manual_seed(0);
  const auto cuda = at::TensorOptions().device(at::kCUDA);

  // The copy ceiling, counting bytes read plus bytes written.
  {
    auto src = at::randn({8192, 8192}, cuda.dtype(at::kBFloat16));
    auto dst = at::empty_like(src);
    const double bytes = 2.0 * src.nbytes();
    const double ms = bench::median_ms([&] { dst.copy_(src); });
    bench::Record("device_copy", "8192x8192 bf16", cmd)
        .set("ours_ms", ms)
        .set("gbps", bytes / ms / 1e6)
        .print();
  }

  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{8192, 8192}, {16384, 8192}, {4096, 4096}}) {
    auto x = at::randn({rows, cols}, cuda.dtype(at::kBFloat16));
    auto scale = at::full({1}, 64.0f, cuda.dtype(at::kFloat));
    auto amax_slot = at::zeros({1}, cuda.dtype(at::kFloat));
    auto copy_dst = at::empty_like(x);
    const double copy_ms = bench::median_ms([&] { copy_dst.copy_(x); });
    const double copy_gbps = 2.0 * x.nbytes() / copy_ms / 1e6;

    const double ours_ms =
        bench::median_ms([&] { cast_transpose(x, scale, Fp8Format::kE4M3, amax_slot); });
    // Eager: amax, scale + saturating cast, then a separate transpose copy.
    const double eager_ms = bench::median_ms([&] {
      auto amax = x.abs().amax();
      auto q = (x * scale).clamp(-448.0, 448.0).to(at::kFloat8_e4m3fn);
      auto qt = q.t().contiguous();
    });
    const double bytes = x.nbytes() + 2.0 * x.numel();  // read bf16, write FP8 twice
    const double gbps = bytes / ours_ms / 1e6;
    const std::string shape = std::to_string(rows) + "x" + std::to_string(cols) + " bf16->e4m3";
    bench::Record("cast_transpose_amax", shape, cmd)
        .timing(ours_ms, "eager LibTorch amax + scale/clamp/cast + t().contiguous()", eager_ms)
        .set("gbps", gbps)
        .set("copy_gbps", copy_gbps)
        .set("fraction_of_copy", gbps / copy_gbps)
        .print();

    // Blockwise FP8 (DeepSeek-V3 / TE's Float8BlockScaling): x in 1×128 tiles plus xᵀ in its
    // own 1×128 tiles (an activation's two copies), and a weight's 128×128 blocks with the
    // transpose; against the tensorwise cast_transpose above, same bytes moved.
    for (const auto block : {Fp8BlockShape::k1x128, Fp8BlockShape::k128x128}) {
      BlockwiseQuantizeOptions options;
      options.block = block;
      const double ms = bench::median_ms([&] { quantize_blockwise(x, options, true); });
      bench::Record(block == Fp8BlockShape::k1x128 ? "quantize_blockwise_1x128_transpose"
                                                   : "quantize_blockwise_128x128_transpose",
                    shape, cmd)
          .timing(ms, "cast_transpose (tensorwise, delayed scale)", ours_ms)
          .set("gbps", bytes / ms / 1e6)
          .set("fraction_of_copy", bytes / ms / 1e6 / copy_gbps)
          .print();
    }

    // The blockwise recipe's MLP casts: GELU inside FC2's input quantization (1×128 tiles and
    // the transpose) against LibTorch's GELU then quantize_blockwise, and GELU's backward with
    // FC1's bias gradient inside its gradient's against LibTorch's gelu_backward then
    // quantize_blockwise with dbias (what the blockwise MLP did before). The dGELU kernel also
    // reads GELU's input: its bytes count them.
    {
      BlockwiseQuantizeOptions tiles;
      const double fused_ms = bench::median_ms([&] { quantize_blockwise_gelu(x, tiles, true); });
      const double separate_ms =
          bench::median_ms([&] { quantize_blockwise(at::gelu(x, "tanh"), tiles, true); });
      bench::Record("quantize_blockwise_gelu", shape, cmd)
          .timing(fused_ms, "at::gelu(tanh) + quantize_blockwise", separate_ms)
          .set("gbps", bytes / fused_ms / 1e6)
          .set("fraction_of_copy", bytes / fused_ms / 1e6 / copy_gbps)
          .print();
      auto gelu_input = at::randn({rows, cols}, cuda.dtype(at::kBFloat16));
      auto dbias = at::empty({cols}, cuda.dtype(at::kFloat));
      tiles.format = Fp8Format::kE5M2;
      const double dgelu_ms =
          bench::median_ms([&] { quantize_blockwise_dgelu(x, gelu_input, tiles, true, dbias); });
      const double dgelu_separate_ms = bench::median_ms([&] {
        quantize_blockwise(at::gelu_backward(x, gelu_input, "tanh"), tiles, true, dbias);
      });
      const double dgelu_bytes = bytes + gelu_input.nbytes();
      bench::Record("quantize_blockwise_dgelu_dbias", shape, cmd)
          .timing(dgelu_ms, "at::gelu_backward(tanh) + quantize_blockwise with dbias",
                  dgelu_separate_ms)
          .set("gbps", dgelu_bytes / dgelu_ms / 1e6)
          .set("fraction_of_copy", dgelu_bytes / dgelu_ms / 1e6 / copy_gbps)
          .print();
    }

    // Tile widths of the fused kernel, same run (tuning record).
    {
      auto out = at::empty({rows, cols}, cuda.dtype(at::kFloat8_e4m3fn));
      auto out_t = at::empty({cols, rows}, cuda.dtype(at::kFloat8_e4m3fn));
      auto scale_inv = at::empty({1}, cuda.dtype(at::kFloat));
      auto stream = at::cuda::getCurrentCUDAStream().stream();
      for (int tile_cols : {64, 128}) {
        const double ms = bench::median_ms([&] {
          cuda::launch_cast_transpose_tiled(
              x.data_ptr(), cuda::InputType::kBFloat16, out.data_ptr(), out_t.data_ptr(), rows,
              cols, scale.data_ptr<float>(), scale_inv.data_ptr<float>(),
              amax_slot.data_ptr<float>(), false, false, tile_cols, stream);
        });
        bench::Record("cast_transpose_tile" + std::to_string(tile_cols), shape, cmd)
            .timing(ms, "cast_transpose (default tile)", ours_ms)
            .set("gbps", bytes / ms / 1e6)
            .set("fraction_of_copy", bytes / ms / 1e6 / copy_gbps)
            .print();
      }
    }

    // The bias gradient from the same read (cast_transpose's dbias_out) against cast_transpose
    // followed by LibTorch's column sum, which the FP8 linear backward did before.
    {
      auto dbias = at::empty({cols}, cuda.dtype(at::kFloat));
      const double fused_ms = bench::median_ms(
          [&] { cast_transpose(x, scale, Fp8Format::kE4M3, amax_slot, false, dbias); });
      const double separate_ms = bench::median_ms([&] {
        cast_transpose(x, scale, Fp8Format::kE4M3, amax_slot);
        auto db = x.sum(0, false, at::kFloat);
      });
      bench::Record("cast_transpose_dbias", shape, cmd)
          .timing(fused_ms, "cast_transpose + x.sum(0) (LibTorch)", separate_ms)
          .set("gbps", bytes / fused_ms / 1e6)
          .set("fraction_of_copy", bytes / fused_ms / 1e6 / copy_gbps)
          .set("plain_cast_transpose_ms", ours_ms)
          .print();
    }

    // GELU inside the cast (an MLP's FC2 input) against LibTorch's GELU then cast_transpose,
    // and GELU's backward inside the gradient's cast with dbias (FC1's output gradient)
    // against LibTorch's gelu_backward then cast_transpose with dbias: what the MLP did before
    // Fp8LayerNormMLP.
    {
      const double fused_ms =
          bench::median_ms([&] { cast_transpose_gelu(x, scale, Fp8Format::kE4M3, amax_slot); });
      const double separate_ms = bench::median_ms([&] {
        cast_transpose(at::gelu(x, "tanh"), scale, Fp8Format::kE4M3, amax_slot);
      });
      bench::Record("cast_transpose_gelu", shape, cmd)
          .timing(fused_ms, "at::gelu(tanh) + cast_transpose", separate_ms)
          .set("gbps", bytes / fused_ms / 1e6)
          .set("fraction_of_copy", bytes / fused_ms / 1e6 / copy_gbps)
          .print();
      auto gelu_input = at::randn({rows, cols}, cuda.dtype(at::kBFloat16));
      auto dbias = at::empty({cols}, cuda.dtype(at::kFloat));
      const double dgelu_ms = bench::median_ms([&] {
        cast_transpose_dgelu(x, gelu_input, scale, Fp8Format::kE5M2, amax_slot, false, dbias);
      });
      const double dgelu_separate_ms = bench::median_ms([&] {
        cast_transpose(at::gelu_backward(x, gelu_input, "tanh"), scale, Fp8Format::kE5M2,
                       amax_slot, false, dbias);
      });
      const double dgelu_bytes = 2.0 * x.nbytes() + 2.0 * x.numel();  // two bf16 reads
      const std::string dgelu_shape =
          std::to_string(rows) + "x" + std::to_string(cols) + " bf16->e5m2";
      bench::Record("cast_transpose_dgelu_dbias", dgelu_shape, cmd)
          .timing(dgelu_ms, "at::gelu_backward(tanh) + cast_transpose with dbias",
                  dgelu_separate_ms)
          .set("gbps", dgelu_bytes / dgelu_ms / 1e6)
          .set("fraction_of_copy", dgelu_bytes / dgelu_ms / 1e6 / copy_gbps)
          .print();
    }

    // SwiGLU inside the cast (a Llama MLP's FC2 input, x the gate/up output [rows, 2·cols])
    // against amp8's SwiGLU kernel then cast_transpose (the unfused path).
    {
      auto gate_up = at::randn({rows, 2 * cols}, cuda.dtype(at::kBFloat16));
      const double fused_ms = bench::median_ms(
          [&] { cast_transpose_swiglu(gate_up, scale, Fp8Format::kE4M3, amax_slot); });
      const double separate_ms = bench::median_ms([&] {
        cast_transpose(swiglu(gate_up), scale, Fp8Format::kE4M3, amax_slot);
      });
      const double swiglu_bytes = 1.0 * gate_up.nbytes() + 2.0 * x.numel();
      bench::Record("cast_transpose_swiglu", std::to_string(rows) + "x2x" + std::to_string(cols),
                    cmd)
          .timing(fused_ms, "amp8 swiglu + cast_transpose", separate_ms)
          .set("gbps", swiglu_bytes / fused_ms / 1e6)
          .set("fraction_of_copy", swiglu_bytes / fused_ms / 1e6 / copy_gbps)
          .print();
      // SwiGLU's backward inside the gradient's cast (FC1's output gradient [rows, 2·cols] from
      // x, SwiGLU's output gradient) against amp8's swiglu_backward then cast_transpose.
      const double dswiglu_ms = bench::median_ms(
          [&] { cast_transpose_dswiglu(x, gate_up, scale, Fp8Format::kE5M2, amax_slot); });
      const double dswiglu_separate_ms = bench::median_ms([&] {
        cast_transpose(swiglu_backward(x, gate_up), scale, Fp8Format::kE5M2, amax_slot);
      });
      // Reads x and gate_up; writes both FP8 layouts of [rows, 2·cols].
      const double dswiglu_bytes = 1.0 * x.nbytes() + gate_up.nbytes() + 4.0 * x.numel();
      bench::Record("cast_transpose_dswiglu",
                    std::to_string(rows) + "x2x" + std::to_string(cols) + " bf16->e5m2", cmd)
          .timing(dswiglu_ms, "amp8 swiglu_backward + cast_transpose", dswiglu_separate_ms)
          .set("gbps", dswiglu_bytes / dswiglu_ms / 1e6)
          .set("fraction_of_copy", dswiglu_bytes / dswiglu_ms / 1e6 / copy_gbps)
          .print();
    }

    const double quant_ms =
        bench::median_ms([&] { quantize(x, scale, Fp8Format::kE4M3, amax_slot); });
    const double eager_quant_ms = bench::median_ms([&] {
      auto amax = x.abs().amax();
      auto q = (x * scale).clamp(-448.0, 448.0).to(at::kFloat8_e4m3fn);
    });
    const double quant_gbps = (x.nbytes() + 1.0 * x.numel()) / quant_ms / 1e6;
    bench::Record("quantize_amax", shape, cmd)
        .timing(quant_ms, "eager LibTorch amax + scale/clamp/cast", eager_quant_ms)
        .set("gbps", quant_gbps)
        .set("copy_gbps", copy_gbps)
        .set("fraction_of_copy", quant_gbps / copy_gbps)
        .print();
  }

  // Every FP8 weight of a GPT written from its float32 master after a step (fp8_params): one
  // quantize_many launch against one quantize per weight, as DistributedOptimizer::publish_params
  // did. Host launch time counts: the events enclose the whole sequence.
  for (auto [config, hidden, layers] : {std::tuple<const char*, int64_t, int64_t>{"350m", 1024, 24}, {"1b", 2048, 24}}) {
    std::vector<at::Tensor> masters, weights;
    std::vector<int64_t> slots;
    for (int64_t layer = 0; layer < layers; ++layer) {
      for (auto [out, in] : {std::pair<int64_t, int64_t>{3 * hidden, hidden}, {hidden, hidden}, {4 * hidden, hidden},
                             {hidden, 4 * hidden}}) {
        masters.push_back(at::randn({out, in}, cuda.dtype(at::kFloat)));
        weights.push_back(at::empty({out, in}, cuda.dtype(at::kFloat8_e4m3fn)));
        slots.push_back(static_cast<int64_t>(slots.size()));
      }
    }
    auto scales = at::full({static_cast<int64_t>(slots.size())}, 64.0f, cuda.dtype(at::kFloat));
    double elements = 0;
    for (const auto& m : masters) elements += m.numel();
    const double many_ms = bench::median_ms([&] { quantize_many(masters, scales, slots, Fp8Format::kE4M3, weights); });
    const double each_ms = bench::median_ms([&] {
      for (size_t i = 0; i < masters.size(); ++i) {
        quantize(masters[i], scales.narrow(0, slots[i], 1), Fp8Format::kE4M3, {}, false, weights[i]);
      }
    });
    bench::Record("quantize_many", std::string(config) + ": " + std::to_string(masters.size()) +
                                       " FP8 weights from float32 masters", cmd)
        .timing(many_ms, "one amp8 quantize per weight", each_ms)
        .set("tensors", static_cast<double>(masters.size()))
        .set("gbps", 5.0 * elements / many_ms / 1e6)  // read 4 bytes, write 1 per element
        .print();
    // The same weights in 128×128 blocks (blockwise fp8_params): block amaxes, then the bytes
    // and every block's scale_inv, against quantize_many's one scale per weight.
    std::vector<Fp8WeightShard> shards;
    std::vector<at::Tensor> amaxes, outs, scale_invs;
    for (size_t i = 0; i < masters.size(); ++i) {
      const int64_t rows = masters[i].size(0), cols = masters[i].size(1);
      shards.push_back({masters[i].view(-1), rows, cols, 0});
      amaxes.push_back(at::zeros(blockwise_amax_shape(rows, cols), cuda.dtype(at::kFloat)));
      outs.push_back(weights[i].view(-1));
      scale_invs.push_back(at::zeros(blockwise_scale_shape(rows, cols, Fp8BlockShape::k128x128), cuda.dtype(at::kFloat)));
    }
    const double blocks_ms = bench::median_ms([&] {
      for (auto& amax : amaxes) amax.zero_();
      blockwise_shard_amax(shards, amaxes);
      quantize_shards_blockwise(shards, amaxes, weight_block_options(), outs, scale_invs);
    });
    bench::Record("quantize_shards_blockwise", std::string(config) + ": " + std::to_string(masters.size()) +
                                                   " FP8 weights in 128x128 blocks from float32 masters", cmd)
        .timing(blocks_ms, "quantize_many (one scale per weight)", many_ms)
        .set("tensors", static_cast<double>(masters.size()))
        .set("gbps", 9.0 * elements / blocks_ms / 1e6)  // read 4 bytes twice, write 1 per element
        .print();
    // The same whole weights in one read each (one rank holds them all; DistributedOptimizer at
    // world size 1): quantize_whole_weights_blockwise against the two passes above.
    const double whole_ms = bench::median_ms(
        [&] { quantize_whole_weights_blockwise(shards, weight_block_options(), outs, scale_invs); });
    bench::Record("quantize_whole_weights_blockwise", std::string(config) + ": " + std::to_string(masters.size()) +
                                                          " FP8 weights in 128x128 blocks from float32 masters", cmd)
        .timing(whole_ms, "blockwise_shard_amax + quantize_shards_blockwise", blocks_ms)
        .set("tensors", static_cast<double>(masters.size()))
        .set("gbps", 5.0 * elements / whole_ms / 1e6)  // read 4 bytes, write 1 per element
        .print();
  }
  return 0;
}
