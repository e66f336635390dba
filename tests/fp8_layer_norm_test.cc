#include "plugin/modules/fp8_layer_norm.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <optional>
#include <sstream>

#include "ops/fp8_format.h"
#include "ops/layer_norm.h"
#include "plugin/fp8/fp8_autocast.h"
#include "plugin/precision/autocast_guard.h"
#include "tests/fp8_recipes.h"
#include "tests/module_pairs.h"
#include "tests/test_util.h"

namespace amp8 {
namespace {

using testing::BytesEqual;
using testing::ExpectErrorContaining;
using testing::kForwardBound;
using testing::kHybridGradBound;
using testing::relative_error;

using testing::recipe_of;

class Fp8LayerNormTest : public testing::SeededTest {};

TEST_F(Fp8LayerNormTest, HasLayerNormsParametersAndInitialisation) {
  Fp8LayerNorm ln(std::vector<int64_t>{4, 8});
  torch::nn::LayerNorm reference(torch::nn::LayerNormOptions({4, 8}));
  EXPECT_TRUE(BytesEqual(ln->weight, reference->weight));
  EXPECT_TRUE(BytesEqual(ln->bias, reference->bias));
  EXPECT_THAT(ln->named_parameters().keys(), ::testing::ElementsAre("weight", "bias"));
  std::ostringstream os;
  os << *ln;
  EXPECT_EQ(os.str(), "amp8::Fp8LayerNorm([4, 8], eps=1e-05, elementwise_affine=true, bias=true)");
  EXPECT_FALSE(Fp8LayerNorm(Fp8LayerNormOptions({8}).elementwise_affine(false))->weight.defined());
}

// Values and gradients against ATen's own op in float32 (at::layer_norm, what torch::nn::LayerNorm
// runs; at::rms_norm for normalization(kRMSNorm), Llama's RMSNorm, which has no bias parameter)
// on the same parameters, over a two-dimensional normalized_shape.
void matches_torch_case(torch::Device device, torch::ScalarType dtype,
                        Normalization norm = Normalization::kLayerNorm) {
  const bool rms = norm == Normalization::kRMSNorm;
  Fp8LayerNorm ln(Fp8LayerNormOptions({4, 24}).normalization(norm).eps(1e-6));
  if (rms) {
    EXPECT_THAT(ln->named_parameters().keys(), ::testing::ElementsAre("weight"));
  }
  {
    torch::NoGradGuard no_grad;
    ln->weight.copy_(torch::rand({4, 24}) + 0.5);
    if (!rms) ln->bias.copy_(torch::randn({4, 24}));
  }
  ln->to(device);
  auto weight = ln->weight.detach().clone().requires_grad_(true);
  auto bias = rms ? torch::Tensor() : ln->bias.detach().clone().requires_grad_(true);
  auto x = (torch::randn({3, 5, 4, 24}) * 2 + 1).to(device).to(dtype);
  auto grad = torch::randn({3, 5, 4, 24}).to(device).to(dtype);
  auto x1 = x.clone().requires_grad_(true), x2 = x.to(torch::kFloat).requires_grad_(true);
  auto y1 = ln->forward(x1);
  auto y2 = rms ? at::rms_norm(x2, {4, 24}, weight, 1e-6)
                : at::layer_norm(x2, {4, 24}, weight, bias, 1e-6);
  y1.backward(grad);
  y2.backward(grad.to(torch::kFloat));
  EXPECT_EQ(y1.scalar_type(), dtype);
  const double bound = dtype == torch::kFloat ? 1e-5 : 1.0 / 256;  // output rounding
  EXPECT_LE(relative_error(y1, y2), bound);
  EXPECT_LE(relative_error(x1.grad(), x2.grad()), 2 * bound);
  EXPECT_LE(relative_error(ln->weight.grad(), weight.grad()), 2 * bound);
  if (!rms) {
    EXPECT_LE(relative_error(ln->bias.grad(), bias.grad()), 2 * bound);
  }
}

TEST_F(Fp8LayerNormTest, MatchesTorchLayerNorm) {
  matches_torch_case(torch::kCPU, torch::kFloat);
  matches_torch_case(torch::kCPU, torch::kBFloat16);
}

TEST_F(Fp8LayerNormTest, MatchesTorchLayerNorm_CUDA) {
  AMP8_REQUIRE_CUDA();
  matches_torch_case(torch::kCUDA, torch::kFloat);
  matches_torch_case(torch::kCUDA, torch::kBFloat16);
}

TEST_F(Fp8LayerNormTest, RmsNormMatchesAtRmsNorm) {
  matches_torch_case(torch::kCPU, torch::kFloat, Normalization::kRMSNorm);
  matches_torch_case(torch::kCPU, torch::kBFloat16, Normalization::kRMSNorm);
  std::ostringstream os;
  os << *Fp8LayerNorm(Fp8LayerNormOptions({8}).normalization(Normalization::kRMSNorm));
  EXPECT_EQ(os.str(),
            "amp8::Fp8LayerNorm([8], normalization=RMSNorm, eps=1e-05, elementwise_affine=true, "
            "bias=false)");
  ExpectErrorContaining(
      [] { Fp8LayerNorm(Fp8LayerNormOptions({8}).normalization(Normalization::kRMSNorm).bias(true)); },
      "bias must be false (or unset) with normalization RMSNorm");
  Fp8LayerNormLinear lnl(Fp8LayerNormLinearOptions(32, 16).normalization(Normalization::kRMSNorm));
  EXPECT_THAT(lnl->named_parameters().keys(),
              ::testing::ElementsAre("layer_norm.weight", "linear.weight", "linear.bias"));
}

TEST_F(Fp8LayerNormTest, RmsNormMatchesAtRmsNorm_CUDA) {
  AMP8_REQUIRE_CUDA();
  matches_torch_case(torch::kCUDA, torch::kFloat, Normalization::kRMSNorm);
  matches_torch_case(torch::kCUDA, torch::kBFloat16, Normalization::kRMSNorm);
}

TEST_F(Fp8LayerNormTest, BadInputIsNamed) {
  Fp8LayerNorm ln(std::vector<int64_t>{8});
  ExpectErrorContaining(
      [&] {
        ln->forward(torch::randn({2, 7}));
      },
      "input must end with normalized_shape [8]");
  ExpectErrorContaining([&] { Fp8LayerNorm(Fp8LayerNormOptions({8}).eps(0)); },
                        "eps must be positive");
  ExpectErrorContaining([&] { Fp8LayerNorm(std::vector<int64_t>{0}); },
                        "normalized_shape must be positive");
  Fp8LayerNormLinear lnl(32, 16);
  ExpectErrorContaining(
      [&] {
        lnl->forward(torch::randn({2, 31}));
      },
      "input must have in_features=32");
}

Fp8LayerNormLinear make_layer_norm_linear(torch::Device device, int64_t in, int64_t out,
                                          Normalization norm = Normalization::kLayerNorm) {
  Fp8LayerNormLinear layer(Fp8LayerNormLinearOptions(in, out)
                               .normalization(norm)
                               .fp8_amax_history_len(4)
                               .fp8_min_gemm_size(0));
  torch::NoGradGuard no_grad;
  layer->layer_norm->weight.copy_(torch::rand({in}) + 0.5);
  if (norm == Normalization::kLayerNorm) layer->layer_norm->bias.copy_(torch::randn({in}) * 0.2);
  layer->to(device);
  return layer;
}

TEST_F(Fp8LayerNormTest, LayerNormLinearOutsideARegionIsTheTwoModules) {
  auto layer = make_layer_norm_linear(torch::kCPU, 48, 40);
  auto x = torch::randn({3, 7, 48});
  EXPECT_TRUE(BytesEqual(layer->forward(x), layer->linear->forward(layer->layer_norm->forward(x))));
  EXPECT_THAT(layer->named_parameters().keys(),
              ::testing::ElementsAre("layer_norm.weight", "layer_norm.bias", "linear.weight",
                                     "linear.bias"));
}

// On the CPU with float32 input the fused module quantizes exactly the float32 LayerNorm output
// the unfused pair would, so in an FP8 region both give the same bytes: forward, every
// gradient, and the FP8 metadata after the updates.
// Also with RMSNorm (rms_norm_fp8 in the fused module).
TEST_F(Fp8LayerNormTest, FusedEqualsUnfusedPairInFp8) {
  for (const auto norm : {Normalization::kLayerNorm, Normalization::kRMSNorm})
  for (const std::string recipe_kind : {"delayed", "tensorwise"}) {
    SCOPED_TRACE(normalization_name(norm));
    auto fused = make_layer_norm_linear(torch::kCPU, 64, 48, norm);
    auto unfused = make_layer_norm_linear(torch::kCPU, 64, 48, norm);
    {
      torch::NoGradGuard no_grad;
      for (auto& p : unfused->named_parameters())
        p.value().copy_(fused->named_parameters()[p.key()]);
    }
    const auto recipe = recipe_of(recipe_kind);
    for (int step = 0; step < 3; ++step) {
      auto x = torch::randn({5, 9, 64}) * (step + 1);  // 45 rows: padded internally
      auto grad = torch::randn({5, 9, 48});
      auto x1 = x.clone().requires_grad_(true), x2 = x.clone().requires_grad_(true);
      torch::Tensor y1, y2;
      {
        Fp8Autocast region(recipe);
        y1 = fused->forward(x1);
        y2 = unfused->linear->forward(unfused->layer_norm->forward(x2));
      }
      y1.backward(grad);
      y2.backward(grad);
      EXPECT_TRUE(BytesEqual(y1, y2)) << recipe_kind << " step " << step;
      EXPECT_TRUE(BytesEqual(x1.grad(), x2.grad())) << recipe_kind << " step " << step;
      for (auto& p : fused->named_parameters()) {
        EXPECT_TRUE(BytesEqual(p.value().grad(), unfused->named_parameters()[p.key()].grad()))
            << p.key() << " " << recipe_kind;
      }
      for (auto& b : fused->named_buffers()) {
        EXPECT_TRUE(BytesEqual(b.value(), unfused->named_buffers()[b.key()])) << b.key();
      }
    }
    EXPECT_GT(fused->linear->fp8_fwd_amax_history.max().item<float>(), 0) << recipe_kind;
  }
}

// forward_split's pieces are forward's output split, and their gradients, arriving apart (one
// piece unused: autograd hands the backward zeros for it) or as views of one buffer, give the
// bytes the concatenated gradient gives: input, every parameter, FP8 metadata. In each recipe;
// blockwise runs LayerNorm, then Fp8Linear::forward_split, whose backward quantizes the pieces
// in their 1×128 tiles where they are (quantize_blockwise_columns: on the GPU, pieces of whole
// tiles take one launch each, other pieces are concatenated). A piece's gradient at the wrong
// columns, or one piece's gradient standing for all, shows.
void forward_split_case(torch::Device device, torch::ScalarType dtype, int64_t rows,
                        const std::vector<int64_t>& splits = {40, 16, 40}) {
  int64_t out = 0;
  for (const auto size : splits) out += size;
  ASSERT_EQ(splits.size(), 3u);
  for (const std::string recipe_kind : {"delayed", "tensorwise", "blockwise"}) {
    SCOPED_TRACE(recipe_kind + " " + c10::toString(dtype));
    auto whole = make_layer_norm_linear(device, 128, out);
    auto split = make_layer_norm_linear(device, 128, out);
    testing::copy_parameters(*whole, *split);
    const auto recipe = recipe_of(recipe_kind);
    for (int step = 0; step < 3; ++step) {
      auto x = (torch::randn({rows, 128}) * (step + 1)).to(device).to(dtype);
      std::vector<torch::Tensor> grads = {torch::randn({rows, splits[0]}),
                                          torch::randn({rows, splits[1]}) * 9,
                                          torch::randn({rows, splits[2]})};
      if (step == 1) grads[1].zero_();  // step 1: piece 1 unused
      for (auto& g : grads) g = g.to(device).to(dtype);
      auto x1 = x.clone().requires_grad_(true), x2 = x.clone().requires_grad_(true);
      torch::Tensor y;
      std::vector<torch::Tensor> pieces;
      {
        Fp8Autocast region(recipe);
        y = whole->forward(x1);
        pieces = split->forward_split(x2, splits);
      }
      ASSERT_EQ(pieces.size(), 3u);
      for (int i = 0; i < 3; ++i) {
        EXPECT_TRUE(BytesEqual(pieces[i], y.split_with_sizes(splits, -1)[i])) << i;
      }
      y.backward(at::cat(grads, -1));
      if (step == 1) {
        torch::autograd::backward({pieces[0], pieces[2]}, {grads[0], grads[2]});
      } else if (step == 2) {
        // Gradients that are adjacent column blocks of one buffer (an attention backward that
        // fills one dq|dk|dv buffer): cast as that buffer.
        torch::autograd::backward(pieces, at::cat(grads, -1).split_with_sizes(splits, -1));
      } else {
        torch::autograd::backward(pieces, grads);
      }
      EXPECT_TRUE(BytesEqual(x1.grad(), x2.grad())) << "step " << step;
      testing::expect_same_gradients(*split, *whole, "step " + std::to_string(step),
                                     /*buffers=*/true);
    }
  }
}

TEST_F(Fp8LayerNormTest, ForwardSplitGradientsAreTheConcatenatedGradients) {
  forward_split_case(torch::kCPU, torch::kFloat, 45);
}

// Pieces at column offsets 0, 40 and 56 (multiples of 8, not all of 16): each piece's cast and
// bias gradient on the fused kernel, whose column sums do not depend on the matrix's width.
// Pieces of 128, 256 and 128 columns: blockwise's per-piece launches (a QKV projection's shape).
TEST_F(Fp8LayerNormTest, ForwardSplitGradientsAreTheConcatenatedGradients_CUDA) {
  AMP8_REQUIRE_CUDA();
  forward_split_case(torch::kCUDA, torch::kBFloat16, 48);
  forward_split_case(torch::kCUDA, torch::kFloat, 45);  // padded to 48 rows
  forward_split_case(torch::kCUDA, torch::kBFloat16, 48, {128, 256, 128});
}

// forward_split_with_residual_branch's residual is the input (a view of it), its pieces are
// forward_split's, and the input's gradient is the LayerNorm's plus the residual's, summed by
// the LayerNorm's backward kernel: in float32 the bytes of autograd's sum, in bfloat16 one
// rounding against autograd's two (and not its bytes). Every parameter's gradient and buffer
// is the same bytes. Outside a region (the two modules in sequence) and in each recipe (the
// fused function for delayed and tensorwise, LayerNorm then Fp8Linear for blockwise); 45 rows
// are padded in the GEMMs. bfloat16 under autocast.
void residual_branch_case(torch::Device device, torch::ScalarType dtype, int64_t rows,
                          Normalization norm = Normalization::kLayerNorm) {
  const std::vector<int64_t> splits{48, 16, 32};
  for (const std::string recipe_kind : {"none", "delayed", "tensorwise", "blockwise"}) {
    SCOPED_TRACE(recipe_kind + " " + c10::toString(dtype) + " rows " + std::to_string(rows) +
                 " " + normalization_name(norm));
    auto plain = make_layer_norm_linear(device, 128, 96, norm);
    auto branch = make_layer_norm_linear(device, 128, 96, norm);
    testing::copy_parameters(*plain, *branch);
    auto x = (torch::randn({rows, 128}) * 2).to(device).to(dtype);
    auto x1 = x.clone().requires_grad_(true), x2 = x.clone().requires_grad_(true);
    std::vector<torch::Tensor> pieces;
    WithResidualBranch with_branch;
    {
      std::optional<AutocastGuard> autocast;  // bfloat16 activations, float32 weights
      if (dtype != torch::kFloat) autocast.emplace(at::kBFloat16);
      std::optional<Fp8Autocast> region;
      if (recipe_kind != "none") region.emplace(recipe_of(recipe_kind));
      pieces = plain->forward_split(x1, splits);
      with_branch = branch->forward_split_with_residual_branch(x2, splits);
    }
    ASSERT_EQ(with_branch.outputs.size(), 3u);
    for (int i = 0; i < 3; ++i) EXPECT_TRUE(BytesEqual(with_branch.outputs[i], pieces[i])) << i;
    EXPECT_EQ(with_branch.residual.data_ptr(), x2.data_ptr());
    EXPECT_EQ(with_branch.residual.sizes(), x2.sizes());
    std::vector<torch::Tensor> grads;
    for (const auto size : splits) grads.push_back(torch::randn({rows, size}).to(device).to(dtype));
    const auto residual_grad = (torch::randn({rows, 128}) * 3).to(device).to(dtype);
    pieces.push_back(x1);
    with_branch.outputs.push_back(with_branch.residual);
    grads.push_back(residual_grad);
    torch::autograd::backward(pieces, grads);
    torch::autograd::backward(with_branch.outputs, grads);
    testing::expect_sum_rounded_once(x2.grad(), x1.grad(), dtype != torch::kFloat,
                                     "the LayerNorm's backward");
    testing::expect_same_gradients(*branch, *plain, "", /*buffers=*/true);
  }
}

TEST_F(Fp8LayerNormTest, ResidualBranchGradientIsSummedByTheLayerNorm) {
  residual_branch_case(torch::kCPU, torch::kFloat, 48);
  residual_branch_case(torch::kCPU, torch::kBFloat16, 48);
  residual_branch_case(torch::kCPU, torch::kBFloat16, 45);
  residual_branch_case(torch::kCPU, torch::kBFloat16, 48, Normalization::kRMSNorm);
  ExpectErrorContaining(
      [&] {
        make_layer_norm_linear(torch::kCPU, 64, 48)
            ->forward_split_with_residual_branch(torch::randn({4, 64}), {16, 16});
      },
      "Fp8LayerNormLinear::forward_split_with_residual_branch: split_sizes must sum to "
      "out_features=48, got [16, 16]");
}

TEST_F(Fp8LayerNormTest, ResidualBranchGradientIsSummedByTheLayerNorm_CUDA) {
  AMP8_REQUIRE_CUDA();
  residual_branch_case(torch::kCUDA, torch::kFloat, 48);
  residual_branch_case(torch::kCUDA, torch::kBFloat16, 48);
  residual_branch_case(torch::kCUDA, torch::kBFloat16, 45);
  residual_branch_case(torch::kCUDA, torch::kBFloat16, 48, Normalization::kRMSNorm);
}

// Fp8LayerNorm::forward_with_residual_branch: its output is forward's; its residual the input
// (a view of it; of its contiguous copy for a non-contiguous input), whose gradient the
// backward adds into the input's (float32: autograd's bytes); with an input that needs no
// gradient, the weights' gradients are those of x + f(norm(x)). The residual cannot be
// modified in place (one output of several of an autograd function).
TEST_F(Fp8LayerNormTest, LayerNormResidualBranch) {
  for (const bool contiguous : {true, false}) {
    for (const bool input_grad : {true, false}) {
      SCOPED_TRACE(std::string(contiguous ? "contiguous" : "transposed") +
                   (input_grad ? "" : ", input needs no gradient"));
      auto plain = Fp8LayerNorm(std::vector<int64_t>{64});
      auto branch = Fp8LayerNorm(std::vector<int64_t>{64});
      {
        torch::NoGradGuard no_grad;
        plain->weight.copy_(torch::rand({64}) + 0.5);
        plain->bias.copy_(torch::randn({64}));
      }
      testing::copy_parameters(*plain, *branch);
      auto base = contiguous ? torch::randn({6, 64}) : torch::randn({64, 6}).t();
      auto x1 = base.clone(at::MemoryFormat::Preserve).requires_grad_(input_grad);
      auto x2 = base.clone(at::MemoryFormat::Preserve).requires_grad_(input_grad);
      ASSERT_EQ(x2.is_contiguous(), contiguous);
      auto normalized = branch->forward_with_residual_branch(x2);
      EXPECT_TRUE(BytesEqual(normalized.outputs.front(), plain->forward(x1)));
      EXPECT_TRUE(BytesEqual(normalized.residual, x2));
      if (contiguous) {
        EXPECT_EQ(normalized.residual.data_ptr(), x2.data_ptr());
      }
      const auto g = torch::randn({6, 64});
      ((x1 + plain->forward(x1).square()) * g).sum().backward();
      ((normalized.residual + normalized.outputs.front().square()) * g).sum().backward();
      if (input_grad) {
        EXPECT_TRUE(BytesEqual(x2.grad(), x1.grad()));
      }
      testing::expect_same_gradients(*branch, *plain);
      if (input_grad) {
        ExpectErrorContaining([&] { normalized.residual.add_(1.0); }, "inplace");
      }
    }
  }
}

TEST_F(Fp8LayerNormTest, ForwardSplitNamesBadSizes) {
  auto layer = make_layer_norm_linear(torch::kCPU, 64, 48);
  auto x = torch::randn({4, 64});
  ExpectErrorContaining([&] { layer->forward_split(x, {16, 16}); },
                        "Fp8LayerNormLinear::forward_split: split_sizes must sum to "
                        "out_features=48, got [16, 16]");
  ExpectErrorContaining([&] { layer->forward_split(x, {}); }, "must sum to out_features=48");
  ExpectErrorContaining([&] { layer->forward_split(x, {56, -8}); },
                        "Fp8LayerNormLinear::forward_split: split_sizes must be positive, got "
                        "[56, -8]");
}

// The fused module in an FP8 region against LayerNorm + Linear in fp64 on the same
// parameters, within the bounds FP8 rounding allows.
void fused_fp64_case(torch::Device device, const std::string& fp8, torch::ScalarType dtype,
                     Normalization norm = Normalization::kLayerNorm) {
  SCOPED_TRACE(normalization_name(norm));
  const bool rms = norm == Normalization::kRMSNorm;
  auto layer = make_layer_norm_linear(device, 128, 96, norm);
  const auto recipe = Fp8RecipeOptions().fp8(fp8).fp8_amax_history_len(4);
  auto x = (torch::randn({5, 13, 128}) * 2 + 0.3).to(device).to(dtype);
  auto grad = torch::randn({5, 13, 96}).to(device).to(dtype);
  for (int step = 0; step < 2; ++step) {  // step 2 runs with scales from step 1's amaxes
    layer->zero_grad();
    auto xr = x.clone().requires_grad_(true);
    torch::Tensor y;
    {
      Fp8Autocast region(recipe);
      y = layer->forward(xr);
    }
    y.backward(grad);
    if (step == 0) continue;
    auto xd = x.to(torch::kDouble).requires_grad_(true);
    auto lnw = layer->layer_norm->weight.detach().to(torch::kDouble).requires_grad_(true);
    auto lnb = rms ? torch::Tensor()
                   : layer->layer_norm->bias.detach().to(torch::kDouble).requires_grad_(true);
    auto w = layer->linear->weight.detach().to(torch::kDouble).requires_grad_(true);
    auto b = layer->linear->bias.detach().to(torch::kDouble).requires_grad_(true);
    auto normalized = rms ? at::rms_norm(xd, {128}, lnw, 1e-5)
                          : torch::layer_norm(xd, {128}, lnw, lnb, 1e-5);
    auto yd = torch::nn::functional::linear(normalized, w, b);
    yd.backward(grad.to(torch::kDouble));
    const double grad_bound = fp8 == "hybrid" ? kHybridGradBound : kForwardBound;
    // bfloat16 input and output add their own rounding (2^-9 relative) to the FP8 error.
    const double extra = dtype == torch::kFloat ? 0 : 1.0 / 256;
    EXPECT_EQ(y.scalar_type(), dtype);
    EXPECT_LE(relative_error(y, yd), kForwardBound + extra) << device << " " << fp8;
    EXPECT_LE(relative_error(xr.grad(), xd.grad()), grad_bound + extra) << device << " dx";
    EXPECT_LE(relative_error(layer->linear->weight.grad(), w.grad()), grad_bound + extra);
    EXPECT_LE(relative_error(layer->layer_norm->weight.grad(), lnw.grad()), grad_bound + extra);
    if (!rms) {
      EXPECT_LE(relative_error(layer->layer_norm->bias.grad(), lnb.grad()), grad_bound + extra);
    }
    EXPECT_LE(relative_error(layer->linear->bias.grad(), b.grad()), 1e-5 + extra);
  }
}

TEST_F(Fp8LayerNormTest, LayerNormLinearMatchesFp64WithinFp8Bounds) {
  fused_fp64_case(torch::kCPU, "hybrid", torch::kFloat);
  fused_fp64_case(torch::kCPU, "e4m3", torch::kFloat);
  fused_fp64_case(torch::kCPU, "hybrid", torch::kFloat, Normalization::kRMSNorm);
}

TEST_F(Fp8LayerNormTest, LayerNormLinearMatchesFp64WithinFp8Bounds_CUDA) {
  AMP8_REQUIRE_CUDA();
  fused_fp64_case(torch::kCUDA, "hybrid", torch::kFloat);
  fused_fp64_case(torch::kCUDA, "e4m3", torch::kFloat);
  fused_fp64_case(torch::kCUDA, "hybrid", torch::kBFloat16);
  fused_fp64_case(torch::kCUDA, "hybrid", torch::kFloat, Normalization::kRMSNorm);
  fused_fp64_case(torch::kCUDA, "hybrid", torch::kBFloat16, Normalization::kRMSNorm);
}

// The first FP8 step records max|LayerNorm output| (not max|x|) in the linear layer's input
// slot: the activation that is quantized is the normalized one.
void records_output_amax_case(torch::Device device) {
  auto layer = make_layer_norm_linear(device, 64, 32);
  auto x = (torch::randn({32, 64}) * 10).to(device);
  {
    Fp8Autocast region(Fp8RecipeOptions().fp8_amax_history_len(4));
    layer->forward(x);
  }
  const auto ln_out =
      layer_norm(x, layer->layer_norm->weight.detach(), layer->layer_norm->bias.detach(), 1e-5).out;
  const float expected = ln_out.abs().max().item<float>();
  // After the region's update the newest amax sits in the last row (row 0 is zeroed for the
  // next step).
  const float recorded = layer->linear->fp8_fwd_amax_history[-1][0].item<float>();
  EXPECT_NEAR(recorded, expected, 1e-6 * expected);
  EXPECT_NEAR(layer->linear->fp8_fwd_scale[0].item<float>(), 448.0f / recorded,
              1e-6 * 448.0f / recorded);
}

TEST_F(Fp8LayerNormTest, RecordsTheNormalizedOutputsAmax) { records_output_amax_case(torch::kCPU); }

TEST_F(Fp8LayerNormTest, RecordsTheNormalizedOutputsAmax_CUDA) {
  AMP8_REQUIRE_CUDA();
  records_output_amax_case(torch::kCUDA);
}

TEST_F(Fp8LayerNormTest, SaveLoadKeepsFp8Metadata) {
  auto layer = make_layer_norm_linear(torch::kCPU, 32, 32);
  for (int step = 0; step < 3; ++step) {
    Fp8Autocast region(Fp8RecipeOptions().fp8_amax_history_len(4));
    layer->forward(torch::randn({16, 32}) * (step + 1)).sum().backward();
  }
  std::stringstream buffer;
  torch::save(layer, buffer);
  auto restored = make_layer_norm_linear(torch::kCPU, 32, 32);
  torch::load(restored, buffer);
  for (auto& b : layer->named_buffers()) {
    EXPECT_TRUE(BytesEqual(restored->named_buffers()[b.key()], b.value())) << b.key();
  }
  for (auto& p : layer->named_parameters()) {
    EXPECT_TRUE(BytesEqual(restored->named_parameters()[p.key()], p.value())) << p.key();
  }
  EXPECT_GT(layer->linear->fp8_fwd_scale[0].item<float>(), 1.0f);
}

// Under Fp8ModelInit the linear weight lives in FP8 and its gradient reaches main_grad through
// the fused backward.
TEST_F(Fp8LayerNormTest, Fp8ParamsUnderModelInit) {
  Fp8LayerNormLinear layer{nullptr};
  {
    Fp8ModelInit init;
    layer = Fp8LayerNormLinear(Fp8LayerNormLinearOptions(64, 32).fp8_min_gemm_size(0));
  }
  EXPECT_TRUE(layer->options.fp8_params());
  EXPECT_EQ(layer->linear->weight.scalar_type(), torch::kFloat8_e4m3fn);
  auto x = torch::randn({20, 64}).requires_grad_(true);
  {
    Fp8Autocast region(Fp8RecipeOptions().fp8_amax_history_len(4));
    layer->forward(x).sum().backward();
  }
  ASSERT_TRUE(layer->linear->main_grad().defined());
  EXPECT_GT(layer->linear->main_grad().abs().sum().item<float>(), 0);
  EXPECT_TRUE(x.grad().defined());
  EXPECT_TRUE(layer->layer_norm->weight.grad().defined());
}

// ---- Fp8LayerNormMLP ----

// GELU with LayerNorm (GPT's MLP) or SwiGLU with RMSNorm (Llama's).
Fp8LayerNormMLP make_mlp(torch::Device device, int64_t hidden, int64_t ffn,
                         MlpActivation activation = MlpActivation::kGelu) {
  const bool swiglu = activation == MlpActivation::kSwiGlu;
  Fp8LayerNormMLP mlp(Fp8LayerNormMLPOptions(hidden, ffn)
                          .activation(activation)
                          .normalization(swiglu ? Normalization::kRMSNorm : Normalization::kLayerNorm)
                          .fp8_amax_history_len(4)
                          .fp8_min_gemm_size(0));
  torch::NoGradGuard no_grad;
  mlp->ln_fc1->layer_norm->weight.copy_(torch::rand({hidden}) + 0.5);
  if (!swiglu) mlp->ln_fc1->layer_norm->bias.copy_(torch::randn({hidden}) * 0.2);
  mlp->to(device);
  return mlp;
}

// The activation as LibTorch computes it, for the modules run one after the other: GELU (tanh)
// or silu(gate) · up over FC1's fused output.
torch::Tensor libtorch_activation(MlpActivation activation, const torch::Tensor& fc1_out) {
  if (activation == MlpActivation::kGelu) return at::gelu(fc1_out, "tanh");
  const auto halves = fc1_out.chunk(2, -1);
  return torch::silu(halves[0]) * halves[1];
}

const char* activation_name(MlpActivation activation) {
  return activation == MlpActivation::kSwiGlu ? "swiglu" : "gelu";
}

// The fused MLP (GELU inside FC2's input cast, dGELU inside FC1's gradient cast; or SwiGLU) against
// its own modules run one after the other (a copy with fused(false): LayerNormLinear, LibTorch's
// GELU or amp8's SwiGLU, Linear),
// over three steps of a region (so that the second and third use the scales the first
// recorded): outputs, every gradient and every FP8 buffer. In float32 the two differ only in
// how tanh is computed, which moves an FP8 rounding now and then; with bfloat16 inputs (float32
// parameters, the GEMMs' outputs in bfloat16) the sequence also rounds GELU's output and
// gradient to bfloat16 before their casts.
void mlp_matches_sequence_case(torch::Device device, torch::ScalarType dtype,
                               const std::string& recipe_kind, double bound,
                               int64_t batch = 5, MlpActivation activation = MlpActivation::kGelu) {
  auto fused = make_mlp(device, 64, 160, activation);
  // clone() without a device: LibTorch's clone(device) copies a tensor only where its device
  // differs from `device`, and cuda:0 differs from "cuda", so clone(torch::kCUDA) of a module
  // on cuda:0 returns a module that shares every parameter and buffer with it.
  auto sequence = std::dynamic_pointer_cast<Fp8LayerNormMLPImpl>(fused->clone());
  ASSERT_NE(sequence->fc2->fp8_fwd_scale.data_ptr(), fused->fc2->fp8_fwd_scale.data_ptr());
  // The copy runs its modules one after the other, with the module's own activation between
  // them (LibTorch's GELU; amp8's SwiGLU, rounded once to the compute dtype as GELU is).
  sequence->options.fused(false);
  const auto recipe = recipe_of(recipe_kind);
  for (int step = 0; step < 3; ++step) {
    const std::string where = std::string(activation_name(activation)) + " " + recipe_kind + " " +
                              c10::toString(dtype) + " " + std::to_string(batch * 9) +
                              " rows, step " + std::to_string(step);
    // 45 rows (padded internally to 48) or 144, a mean away from zero so that both sides of
    // GELU are used.
    auto x = ((torch::randn({batch, 9, 64}) + 0.3) * (step + 1)).to(device).to(dtype);
    auto grad = torch::randn({batch, 9, 64}).to(device).to(dtype);
    auto x1 = x.clone().requires_grad_(true), x2 = x.clone().requires_grad_(true);
    torch::Tensor y1, y2;
    {
      Fp8Autocast region(recipe);
      y1 = fused->forward(x1);
      y2 = sequence->forward(x2);
    }
    y1.backward(grad);
    y2.backward(grad);
    EXPECT_LT(relative_error(y1, y2), bound) << where;
    EXPECT_LT(relative_error(x1.grad(), x2.grad()), bound) << where;
    const auto sequence_parameters = sequence->named_parameters();  // held: [] returns into it
    for (auto& p : fused->named_parameters()) {
      const auto& other = sequence_parameters[p.key()];
      ASSERT_TRUE(p.value().grad().defined()) << p.key();
      EXPECT_LT(relative_error(p.value().grad(), other.grad()), bound) << p.key() << " " << where;
    }
    const auto sequence_buffers = sequence->named_buffers();  // held, as the parameters above
    for (auto& b : fused->named_buffers()) {
      const auto& other = sequence_buffers[b.key()];
      if (recipe_kind == "blockwise") {
        // Its scales come from the tiles: neither side touches the FP8 metadata.
        EXPECT_TRUE(BytesEqual(b.value(), other)) << b.key() << " " << where;
      } else {
        EXPECT_LT(relative_error(b.value(), other), bound) << b.key() << " " << where;
      }
    }
  }
  // Every slot was written (FC2's input and FC1's gradient by the fused casts); the blockwise
  // recipe keeps no amax history (its scales come from each tile).
  if (recipe_kind == "blockwise") return;
  for (const auto& linear : {fused->ln_fc1->linear, fused->fc2}) {
    EXPECT_GT(linear->fp8_fwd_amax_history.select(1, 0).max().item<float>(), 0);
    EXPECT_GT(linear->fp8_bwd_amax_history.max().item<float>(), 0);
  }
}

// Also Llama's MLP: RMSNorm and SwiGLU (inside FC2's input cast; its backward by ops/swiglu.h)
// against the same module with fused(false) (amp8's SwiGLU kernel between the modules). Under
// the blockwise recipe GELU and its backward happen inside the 1×128 quantizations
// (BlockwiseGeluMLPFunction); SwiGLU runs the modules in sequence there.
TEST_F(Fp8LayerNormTest, LayerNormMLPMatchesItsModulesInSequence) {
  for (const auto activation : {MlpActivation::kGelu, MlpActivation::kSwiGlu}) {
    for (const std::string recipe_kind : {"delayed", "tensorwise", "blockwise"}) {
      mlp_matches_sequence_case(torch::kCPU, torch::kFloat, recipe_kind, 2e-3, 5, activation);
    }
  }
}

TEST_F(Fp8LayerNormTest, LayerNormMLPMatchesItsModulesInSequence_CUDA) {
  AMP8_REQUIRE_CUDA();
  for (const auto activation : {MlpActivation::kGelu, MlpActivation::kSwiGlu}) {
    for (const std::string recipe_kind : {"delayed", "tensorwise", "blockwise"}) {
      mlp_matches_sequence_case(torch::kCUDA, torch::kFloat, recipe_kind, 2e-3, 5, activation);
      mlp_matches_sequence_case(torch::kCUDA, torch::kFloat, recipe_kind, 2e-3, 16, activation);
      mlp_matches_sequence_case(torch::kCUDA, torch::kBFloat16, recipe_kind, 3e-2, 5, activation);
    }
  }
}

// On the GPU (its kernels) against the CPU (the references), on the same parameters and
// inputs, float32, delayed scaling, each device in a region of its own: the fused MLP, and its
// modules in sequence. Outputs and every gradient, over two steps. (Not under current scaling:
// there each scale comes from the amax of values the two devices' activations compute a float32
// ulp apart, and a different scale re-rounds every element.)
// The bound, 1e-2: the devices' FC1 GEMMs accumulate differently (cuBLASLt's FP8 fast
// accumulation, the CPU's float32 sums): FC1's outputs differ by about 7e-5, and where such a
// difference moves a value across an FP8 rounding boundary of FC2's input cast, that element
// moves by a whole E4M3 step. Measured on an H200 (bench/results/llama_dswiglu_cast/): FC2 alone
// fed the same input differs by at most 1.9e-4 between the devices, the whole MLP by up to
// 3.6e-3 with SwiGLU (2.8e-3 with GELU) on one draw and 5.8e-3 on another. A kernel off by one
// step on every element differs by several percent.
constexpr double kMlpDeviceBound = 1e-2;

void mlp_gpu_matches_cpu_case(bool fused, const std::string& recipe_kind,
                              MlpActivation activation = MlpActivation::kGelu) {
  auto cpu = make_mlp(torch::kCPU, 64, 160, activation);
  auto gpu = std::dynamic_pointer_cast<Fp8LayerNormMLPImpl>(cpu->clone(torch::kCUDA));
  auto run = [&](Fp8LayerNormMLPImpl& mlp, const torch::Tensor& x) {
    Fp8Autocast region(recipe_of(recipe_kind));
    return fused ? mlp.forward(x)
                 : mlp.fc2->forward(libtorch_activation(activation, mlp.ln_fc1->forward(x)));
  };
  for (int step = 0; step < 2; ++step) {
    const std::string where = std::string(fused ? "fused " : "sequence ") +
                              activation_name(activation) + " " + recipe_kind + " step " +
                              std::to_string(step);
    // Each step starts from the CPU's FP8 scales and amax histories: the amaxes the devices
    // recorded differ in the last float32 places (their GEMMs and expf differ), and a scale an
    // ulp apart would re-round every element of the next step, as under current scaling.
    {
      torch::NoGradGuard no_grad;
      const auto gpu_buffers = gpu->named_buffers();
      for (const auto& b : cpu->named_buffers()) gpu_buffers[b.key()].copy_(b.value());
    }
    auto x = (torch::randn({5, 9, 64}) + 0.3) * (step + 1);
    auto grad = torch::randn({5, 9, 64});
    auto x1 = x.clone().requires_grad_(true), x2 = x.cuda().requires_grad_(true);
    auto y1 = run(*cpu, x1);
    auto y2 = run(*gpu, x2);
    y1.backward(grad);
    y2.backward(grad.cuda());
    EXPECT_LT(relative_error(y2, y1), kMlpDeviceBound) << where;
    EXPECT_LT(relative_error(x2.grad(), x1.grad()), kMlpDeviceBound) << where;
    for (auto& p : cpu->named_parameters()) {
      EXPECT_LT(relative_error(gpu->named_parameters()[p.key()].grad(), p.value().grad()),
                kMlpDeviceBound)
          << p.key() << " " << where;
    }
  }
}

TEST_F(Fp8LayerNormTest, LayerNormMLPOnGpuMatchesCpu_CUDA) {
  AMP8_REQUIRE_CUDA();
  for (const auto activation : {MlpActivation::kGelu, MlpActivation::kSwiGlu}) {
    for (bool fused : {true, false}) mlp_gpu_matches_cpu_case(fused, "delayed", activation);
  }
}

// forward_with_residual(h, r) is r + forward(h), with r = h (a pre-norm block's MLP half) and r
// another tensor, on every path: the
// fused functions of each recipe (GELU and SwiGLU), the modules in sequence (fused(false)), with
// the residual added by FC2's GEMM (48 rows of bfloat16 under autocast: within one rounding of
// the sum, and not its bytes) or after it (46 rows, padded in the GEMM: the same bytes). Every
// parameter's gradient is the same bytes (the backward sees the same output gradient), and
// the other residual's; h's is its two parts summed by the LayerNorm's backward kernel (one
// rounding against autograd's two).
void mlp_residual_case(torch::Device device, int64_t rows) {
  for (const auto activation : {MlpActivation::kGelu, MlpActivation::kSwiGlu}) {
    for (const bool fused_mlp : {true, false}) {
      for (const std::string recipe_kind : {"delayed", "tensorwise", "blockwise"}) {
        SCOPED_TRACE(recipe_kind + " " + activation_name(activation) +
                     (fused_mlp ? "" : " fused(false)") + " rows " + std::to_string(rows));
        auto plain = make_mlp(device, 64, 128, activation);
        auto with_residual = make_mlp(device, 64, 128, activation);
        with_residual->options.fused(fused_mlp);
        plain->options.fused(fused_mlp);
        testing::copy_parameters(*plain, *with_residual);
        const auto h = (torch::randn({2, rows / 2, 64}) * 2).to(device).to(at::kBFloat16);
        const auto other = (torch::randn({2, rows / 2, 64}) * 5).to(device).to(at::kBFloat16);
        auto h1 = h.clone().requires_grad_(true), h2 = h.clone().requires_grad_(true);
        auto o1 = other.clone().requires_grad_(true), o2 = other.clone().requires_grad_(true);
        torch::Tensor y1, y2;
        {
          AutocastGuard autocast(at::kBFloat16);
          Fp8Autocast region(recipe_of(recipe_kind));
          // (h + mlp(h)) + mlp(other): the first residual is the input, the second another
          // tensor (each input's gradient sums at most two parts, so the order autograd adds
          // them in cannot round them apart).
          y1 = h1 + plain->forward(h1);
          y2 = with_residual->forward_with_residual(h2, h2);
          y1 = y1 + plain->forward(o1);
          y2 = with_residual->forward_with_residual(o2, y2);
        }
        testing::expect_residual_added(y2, y1, /*by_gemm=*/rows % 16 == 0);
        testing::backward_with_one_gradient(y1, y2);
        // h's two gradients (the LayerNorm's and the residual's) are summed by the LayerNorm's
        // backward, before one rounding, on every path (where FC2's GEMM could not add the
        // residual, 46 rows, through the fused function's residual branch).
        testing::expect_sum_rounded_once(h2.grad(), h1.grad(), /*fused=*/true,
                                         "the LayerNorm's backward");
        EXPECT_TRUE(BytesEqual(o1.grad(), o2.grad()));
        testing::expect_same_gradients(*with_residual, *plain);
      }
    }
  }
}

TEST_F(Fp8LayerNormTest, LayerNormMLPForwardWithResidualIsResidualPlusForward) {
  mlp_residual_case(torch::kCPU, 48);
  mlp_residual_case(torch::kCPU, 46);
  auto mlp = make_mlp(torch::kCPU, 64, 128);
  ExpectErrorContaining(
      [&] { mlp->forward_with_residual(torch::randn({4, 64}), torch::randn({4, 32})); },
      "Fp8LayerNormMLP::forward_with_residual: residual must have the output's shape, the "
      "input's [4, 64], got [4, 32]");
}

TEST_F(Fp8LayerNormTest, LayerNormMLPForwardWithResidualIsResidualPlusForward_CUDA) {
  AMP8_REQUIRE_CUDA();
  mlp_residual_case(torch::kCUDA, 48);
  mlp_residual_case(torch::kCUDA, 46);
}

TEST_F(Fp8LayerNormTest, LayerNormMLPOutsideARegionIsItsModules) {
  auto mlp = make_mlp(torch::kCPU, 48, 80);
  auto x = torch::randn({3, 7, 48});
  EXPECT_TRUE(BytesEqual(mlp->forward(x),
                         mlp->fc2->forward(at::gelu(mlp->ln_fc1->forward(x), "tanh"))));
  EXPECT_THAT(c10::str(*mlp), ::testing::HasSubstr("Fp8LayerNormMLP(hidden_size=48, "
                                                   "ffn_hidden_size=80"));
  ExpectErrorContaining([&] { mlp->forward(torch::randn({3, 47})); },
                        "Fp8LayerNormMLP: input must have hidden_size=48");
  // SwiGLU: FC1 is twice ffn_hidden_size wide; outside a region, amp8's SwiGLU between the
  // modules, which equals LibTorch's silu(gate) · up in float32 but for expf's last place.
  auto llama_mlp = make_mlp(torch::kCPU, 48, 80, MlpActivation::kSwiGlu);
  EXPECT_EQ(llama_mlp->ln_fc1->linear->options.out_features(), 160);
  EXPECT_EQ(llama_mlp->fc2->options.in_features(), 80);
  EXPECT_THAT(c10::str(*llama_mlp), ::testing::HasSubstr("normalization=RMSNorm, activation=swiglu"));
  const auto expected = llama_mlp->fc2->forward(
      libtorch_activation(MlpActivation::kSwiGlu, llama_mlp->ln_fc1->forward(x)));
  EXPECT_TRUE(torch::allclose(llama_mlp->forward(x), expected, 1e-5, 1e-6));
  ExpectErrorContaining([] { Fp8LayerNormMLP(0, 16); }, "hidden_size and ffn_hidden_size");
}

// Under the blockwise recipe the GELU MLP runs its own function (GELU inside FC2's input
// quantization, dGELU inside FC1's gradient's: LayerNormMLPMatchesItsModulesInSequence compares
// its values), while a SwiGLU MLP and Fp8LayerNormLinear (no blockwise LayerNorm fusion) run
// their parts one after the other, each Fp8Linear blockwise: the same bytes as the parts, and
// the same gradients.
TEST_F(Fp8LayerNormTest, UnderTheBlockwiseRecipeTheMLPFusesGeluAndTheRestRunTheirParts) {
  const auto recipe = Fp8RecipeOptions().fp8_recipe("blockwise");
  const auto x = torch::randn({3, 16, 128});
  {
    auto mlp = make_mlp(torch::kCPU, 128, 256);
    Fp8Autocast region(recipe);
    const auto y = mlp->forward(x.clone().requires_grad_(true));
    ASSERT_TRUE(y.grad_fn());
    EXPECT_THAT(y.grad_fn()->name(), ::testing::HasSubstr("BlockwiseGeluMLPFunction"));
  }
  auto mlp = make_mlp(torch::kCPU, 128, 256, MlpActivation::kSwiGlu);
  auto run = [&](bool fused) {
    mlp->zero_grad();
    mlp->options.fused(fused);
    const auto xr = x.clone().requires_grad_(true);
    torch::Tensor y, ln_linear, ln_then_linear;
    {
      Fp8Autocast region(recipe);
      y = mlp->forward(xr);
      ln_linear = mlp->ln_fc1->forward(x);
      ln_then_linear = mlp->ln_fc1->linear->forward(mlp->ln_fc1->layer_norm->forward(x));
    }
    EXPECT_TRUE(BytesEqual(ln_linear, ln_then_linear));
    y.sum().backward();
    return std::vector<torch::Tensor>{y, xr.grad(), mlp->ln_fc1->linear->weight.grad().clone(),
                                      mlp->fc2->weight.grad().clone()};
  };
  const auto fused = run(true), parts = run(false);
  for (size_t i = 0; i < fused.size(); ++i) EXPECT_TRUE(BytesEqual(fused[i], parts[i])) << i;
  // And they are FP8 results: not the high-precision ones.
  EXPECT_FALSE(BytesEqual(fused[0], mlp->forward(x)));
}

TEST_F(Fp8LayerNormTest, LayerNormMLPFp8ParamsFeedBothMainGrads) {
  Fp8LayerNormMLP mlp{nullptr};
  {
    Fp8ModelInit init;
    mlp = Fp8LayerNormMLP(Fp8LayerNormMLPOptions(64, 96).fp8_min_gemm_size(0));
  }
  EXPECT_EQ(mlp->ln_fc1->linear->weight.scalar_type(), torch::kFloat8_e4m3fn);
  EXPECT_EQ(mlp->fc2->weight.scalar_type(), torch::kFloat8_e4m3fn);
  auto x = torch::randn({20, 64}).requires_grad_(true);
  auto g = torch::randn({20, 64});
  {
    Fp8Autocast region(Fp8RecipeOptions().fp8_amax_history_len(4));
    mlp->forward(x).backward(g);
  }
  for (const auto& linear : {mlp->ln_fc1->linear, mlp->fc2}) {
    ASSERT_TRUE(linear->main_grad().defined());
    EXPECT_GT(linear->main_grad().abs().sum().item<float>(), 0);
  }
  EXPECT_TRUE(x.grad().defined());
  // fc2's bias gradient: the output gradient's column sums, not rounded through the FP8
  // weight's dtype on the way.
  ASSERT_TRUE(mlp->fc2->bias.grad().defined());
  EXPECT_LE(relative_error(mlp->fc2->bias.grad(), g.to(torch::kDouble).sum(0)), 1e-5);
}

}  // namespace
}  // namespace amp8
