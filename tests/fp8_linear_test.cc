#include "plugin/modules/fp8_linear.h"

#if __has_include(<c10/cuda/CUDACachingAllocator.h>)
#include <c10/cuda/CUDACachingAllocator.h>
#define AMP8_HAS_CUDA_ALLOCATOR 1
#endif

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <sstream>

#include "ops/scaling.h"
#include "plugin/fp8/fp8_autocast.h"
#include "plugin/fp8/fp8_gemm_choice.h"
#include "plugin/precision/autocast_guard.h"
#include "tests/fp8_recipes.h"
#include "tests/module_pairs.h"
#include "tests/test_util.h"

namespace amp8 {
namespace {

using testing::BytesEqual;
using ::testing::HasSubstr;
using testing::kE4M3Rms;
using testing::kForwardBound;
using testing::kHybridGradBound;
using testing::relative_error;

using testing::recipe_of;

class Fp8LinearTest : public testing::SeededTest {};

TEST_F(Fp8LinearTest, HasLinearsParametersAndInitialisation) {
  torch::manual_seed(1);
  Fp8Linear fp8(64, 32);
  torch::manual_seed(1);
  torch::nn::Linear reference(64, 32);
  EXPECT_TRUE(BytesEqual(fp8->weight, reference->weight));
  EXPECT_TRUE(BytesEqual(fp8->bias, reference->bias));
  auto names = fp8->named_parameters().keys();
  EXPECT_THAT(names, ::testing::ElementsAre("weight", "bias"));
  std::ostringstream os;
  os << *fp8;
  EXPECT_EQ(os.str(),
            "amp8::Fp8Linear(in_features=64, out_features=32, bias=true, fp8_eligible=true)");
  EXPECT_FALSE(Fp8Linear(Fp8LinearOptions(64, 32).bias(false))->bias.defined());
}

// Outside an FP8 region the layer computes at::linear, what Python's nn.Linear computes: for a
// 3-D input one GEMM with the bias inside it. The C++ frontend's torch::nn::Linear adds the bias
// in a separate pass for such inputs (matmul, then `+=`): in float32 on the CPU the two agree to
// the bit, in bfloat16 they do not (the separate add rounds a second time).
TEST_F(Fp8LinearTest, OutsideAnFp8RegionItIsTorchLinear) {
  Fp8Linear fp8(48, 80);
  torch::nn::Linear reference(48, 80);
  reference->weight.data().copy_(fp8->weight);
  reference->bias.data().copy_(fp8->bias);
  auto x = torch::randn({3, 7, 48});
  EXPECT_TRUE(BytesEqual(fp8->forward(x), reference->forward(x)));
  fp8->to(torch::kBFloat16);
  const auto xb = x.to(torch::kBFloat16);
  const auto expected = at::linear(xb, fp8->weight, fp8->bias);
  ASSERT_FALSE(BytesEqual(expected, torch::nn::functional::linear(xb, fp8->weight, fp8->bias)))
      << "this input cannot tell at::linear from the C++ frontend's linear";
  EXPECT_TRUE(BytesEqual(fp8->forward(xb), expected));
}

void forward_backward_case(torch::Device device, const std::string& fp8,
                           const std::string& recipe_name = "delayed") {
  torch::manual_seed(3);
  Fp8Linear layer(Fp8LinearOptions(128, 96).fp8_amax_history_len(4).fp8_min_gemm_size(0));
  layer->to(device);
  auto recipe = recipe_of(recipe_name).fp8(fp8);
  auto x = torch::randn({5, 13, 128}, device);  // 65 rows: padded to 80 internally
  auto grad_y = torch::randn({5, 13, 96}, device);
  // Step 1 records amaxes (scales still 1); step 2 runs with scales from the history.
  for (int step = 0; step < 2; ++step) {
    layer->zero_grad();
    auto xr = x.clone().requires_grad_(true);
    torch::Tensor y;
    {
      Fp8Autocast region(recipe);
      y = layer->forward(xr);
    }
    y.backward(grad_y);
    if (step == 0) continue;
    // fp64 reference on the same weights.
    auto xd = x.to(torch::kDouble).requires_grad_(true);
    auto wd = layer->weight.detach().to(torch::kDouble).requires_grad_(true);
    auto bd = layer->bias.detach().to(torch::kDouble).requires_grad_(true);
    auto yd = torch::nn::functional::linear(xd, wd, bd);
    yd.backward(grad_y.to(torch::kDouble));
    const double grad_bound = fp8 == "hybrid" ? kHybridGradBound : kForwardBound;
    const std::string what = device.str() + " " + fp8 + " " + recipe_name;
    EXPECT_LE(relative_error(y, yd), kForwardBound) << what;
    EXPECT_LE(relative_error(xr.grad(), xd.grad()), grad_bound) << what << " dgrad";
    EXPECT_LE(relative_error(layer->weight.grad(), wd.grad()), grad_bound) << what << " wgrad";
    EXPECT_LE(relative_error(layer->bias.grad(), bd.grad()), 1e-5) << what << " bias grad";
    EXPECT_EQ(xr.grad().sizes(), x.sizes());
  }
}

TEST_F(Fp8LinearTest, ForwardBackwardMatchFp64WithinFp8Bounds) {
  forward_backward_case(torch::kCPU, "hybrid");
  forward_backward_case(torch::kCPU, "e4m3");
}

// The blockwise recipe (1×128 tiles for x and the gradient, 128×128 blocks for W; a scale per
// tile, so the bounds of per-tensor scaling hold with room to spare), forward and both GEMMs of
// the backward pass; the bias gradient is an exact float32 column sum.
TEST_F(Fp8LinearTest, BlockwiseForwardBackwardMatchFp64WithinFp8Bounds) {
  forward_backward_case(torch::kCPU, "hybrid", "blockwise");
  forward_backward_case(torch::kCPU, "e4m3", "blockwise");
}

TEST_F(Fp8LinearTest, BlockwiseForwardBackwardMatchFp64WithinFp8Bounds_CUDA) {
  AMP8_REQUIRE_CUDA();
  forward_backward_case(torch::kCUDA, "hybrid", "blockwise");
  forward_backward_case(torch::kCUDA, "e4m3", "blockwise");
}

// Under the blockwise recipe an fp8_params weight is read in 128×128 blocks. Stored with one
// scale, that is an error naming what writes it in blocks; written in blocks from some values,
// the layer computes exactly as a layer holding those values in float32 (whose blocks are
// quantized from the same values): the same output, input gradient, bias gradient and, in
// main_grad, weight gradient. A region of another recipe then names the blocks, and
// update_fp8_weight gives the weight one scale again.
TEST_F(Fp8LinearTest, BlockwiseFp8ParamsWeightsAreStoredInBlocks) {
  const int64_t in = 144, out = 272;  // blocks cut in both dimensions
  Fp8Linear layer = [&] {
    Fp8ModelInit init;
    return Fp8Linear(Fp8LinearOptions(in, out).fp8_min_gemm_size(0));
  }();
  Fp8Linear reference(Fp8LinearOptions(in, out).fp8_min_gemm_size(0));
  const auto master = testing::random_wide({out, in}, at::kFloat) * 0.01;
  {
    torch::NoGradGuard no_grad;
    reference->weight.copy_(master);
    reference->bias.copy_(layer->bias);
  }
  const auto x = torch::randn({40, in});  // rows not a multiple of 16
  const auto blockwise = Fp8RecipeOptions().fp8_recipe("blockwise");
  {
    Fp8Autocast region(blockwise);
    testing::ExpectErrorContaining([&] { layer->forward(x); },
                                   "Fp8Linear(144, 272): under the blockwise recipe the FP8 weight "
                                   "must be stored in 128x128 blocks");
  }
  layer->update_fp8_weight_blocks(master);
  EXPECT_TRUE(layer->fp8_weight_in_blocks());
  EXPECT_EQ(layer->weight_scale_inv.sizes(), at::IntArrayRef({3, 4}));  // 3 x 2 blocks, padded to 4
  auto x_layer = x.clone().requires_grad_(), x_reference = x.clone().requires_grad_();
  torch::Tensor y_layer, y_reference;
  {
    Fp8Autocast region(blockwise);
    y_layer = layer->forward(x_layer);
    y_reference = reference->forward(x_reference);
  }
  EXPECT_TRUE(testing::BytesEqual(y_layer, y_reference));
  const auto grad = torch::randn_like(y_reference);
  y_layer.backward(grad);
  y_reference.backward(grad);
  EXPECT_TRUE(testing::BytesEqual(x_layer.grad(), x_reference.grad()));
  EXPECT_TRUE(testing::BytesEqual(layer->bias.grad(), reference->bias.grad()));
  ASSERT_TRUE(layer->main_grad().defined());
  EXPECT_TRUE(testing::BytesEqual(layer->main_grad(), reference->weight.grad()));
  // Outside a region (evaluation, a GEMM kept in high precision) the blocks, dequantized.
  layer->zero_main_grad();
  const auto y_outside = layer->forward(x_layer);
  EXPECT_TRUE(testing::BytesEqual(
      y_outside, at::linear(x, layer->fp8_weight_blocks().dequantize(at::kFloat), layer->bias)));
  y_outside.sum().backward();
  ASSERT_TRUE(layer->main_grad().defined()) << "the weight's gradient still goes to main_grad";
  EXPECT_TRUE(testing::BytesEqual(layer->main_grad(), torch::ones({40, out}).t().mm(x)));
  {
    Fp8Autocast region{Fp8RecipeOptions()};  // delayed
    testing::ExpectErrorContaining([&] { layer->forward(x); },
                                   "the FP8 weight is stored in 128x128 blocks");
  }
  layer->update_fp8_weight(master);
  EXPECT_FALSE(layer->fp8_weight_in_blocks());
  EXPECT_EQ(layer->weight_scale_inv.numel(), 1);
  Fp8Autocast region{Fp8RecipeOptions()};
  EXPECT_NO_THROW(layer->forward(x));
}

TEST_F(Fp8LinearTest, ForwardBackwardMatchFp64WithinFp8Bounds_CUDA) {
  AMP8_REQUIRE_CUDA();
  forward_backward_case(torch::kCUDA, "hybrid");
  forward_backward_case(torch::kCUDA, "e4m3");
}

// With small-integer data every FP8 rounding is exact at scale 1 (the first step), so the FP8
// backward must equal the derivative of the exact function, checked by central differences.
TEST_F(Fp8LinearTest, BackwardMatchesFiniteDifferencesOnExactlyRepresentableData) {
  Fp8Linear layer(Fp8LinearOptions(16, 16).fp8_amax_history_len(1).fp8_min_gemm_size(0));
  torch::NoGradGuard no_grad;
  layer->weight.copy_(torch::randint(-8, 9, {16, 16}));
  layer->bias.copy_(torch::randint(-4, 5, {16}));
  auto x = torch::randint(-8, 9, {3, 16}).to(torch::kFloat);
  auto g = torch::randint(-4, 5, {3, 16}).to(torch::kFloat);  // exact in E5M2 too
  torch::Tensor grad_x, grad_w, grad_b;
  {
    torch::AutoGradMode grad_on(true);
    auto xr = x.clone().requires_grad_(true);
    torch::Tensor y;
    {
      Fp8Autocast region(Fp8RecipeOptions().fp8_amax_history_len(1));
      y = layer->forward(xr);
    }
    (y * g).sum().backward();
    grad_x = xr.grad().clone();
    grad_w = layer->weight.grad().clone();
    grad_b = layer->bias.grad().clone();
  }
  auto loss = [&](const torch::Tensor& xx, const torch::Tensor& w, const torch::Tensor& b) {
    return (torch::nn::functional::linear(xx, w, b) * g.to(torch::kDouble)).sum().item<double>();
  };
  auto xd = x.to(torch::kDouble), wd = layer->weight.to(torch::kDouble),
       bd = layer->bias.to(torch::kDouble);
  const double h = 1e-3;
  auto fd = [&](torch::Tensor& param, int64_t index) {
    auto flat = param.view({-1});
    const double saved = flat[index].item<double>();
    flat[index] = saved + h;
    const double up = loss(xd, wd, bd);
    flat[index] = saved - h;
    const double down = loss(xd, wd, bd);
    flat[index] = saved;
    return (up - down) / (2 * h);
  };
  for (int64_t i : {0, 7, 20, 47})
    EXPECT_NEAR(grad_x.view({-1})[i].item<double>(), fd(xd, i), 1e-6);
  for (int64_t i : {0, 33, 130, 255})
    EXPECT_NEAR(grad_w.view({-1})[i].item<double>(), fd(wd, i), 1e-6);
  for (int64_t i : {0, 9, 15}) EXPECT_NEAR(grad_b[i].item<double>(), fd(bd, i), 1e-6);
}

// Five steps: the metadata follow the scale formula of docs/design.md exactly.
void five_step_case(torch::Device device) {
  torch::manual_seed(4);
  const int64_t history_len = 3;
  Fp8Linear layer(Fp8LinearOptions(32, 48).fp8_amax_history_len(history_len).fp8_min_gemm_size(0));
  layer->to(device);
  auto recipe = Fp8RecipeOptions().fp8_amax_history_len(history_len).fp8_margin(1);
  std::vector<float> x_amaxes, w_amaxes, g_amaxes;
  for (int step = 0; step < 5; ++step) {
    auto x = torch::randn({20, 32}, device) * std::pow(2.0, step - 2);
    auto g = torch::randn({20, 48}, device) * std::pow(2.0, 2 - step);
    x_amaxes.push_back(x.abs().max().item<float>());
    w_amaxes.push_back(layer->weight.detach().abs().max().item<float>());
    g_amaxes.push_back(g.abs().max().item<float>());
    torch::Tensor y;
    {
      Fp8Autocast region(recipe);
      y = layer->forward(x);
    }
    y.backward(g);
    // Expected: scale = (fp8_max / max(last `history_len` amaxes)) / 2^margin.
    auto window_max = [&](const std::vector<float>& v) {
      float m = 0;
      for (size_t i = v.size() > size_t(history_len) ? v.size() - history_len : 0; i < v.size();
           ++i)
        m = std::max(m, v[i]);
      return m;
    };
    auto fwd_scale = layer->fp8_fwd_scale.cpu();
    auto bwd_scale = layer->fp8_bwd_scale.cpu();
    EXPECT_EQ(fwd_scale[0].item<float>(), compute_scale(window_max(x_amaxes), 0, 448.0f, 1))
        << "step " << step;
    EXPECT_EQ(fwd_scale[1].item<float>(), compute_scale(window_max(w_amaxes), 0, 448.0f, 1))
        << "step " << step;
    EXPECT_EQ(bwd_scale[0].item<float>(), compute_scale(window_max(g_amaxes), 0, 57344.0f, 1))
        << "step " << step;
    EXPECT_EQ(layer->fp8_fwd_scale_inv.cpu()[0].item<float>(), 1.0f / fwd_scale[0].item<float>());
    // Row 0 is zeroed for the next step; the last row holds this step's amax.
    EXPECT_EQ(layer->fp8_fwd_amax_history.cpu()[0][0].item<float>(), 0.0f);
    EXPECT_EQ(layer->fp8_fwd_amax_history.cpu()[history_len - 1][0].item<float>(), x_amaxes.back());
    EXPECT_EQ(layer->fp8_bwd_amax_history.cpu()[history_len - 1][0].item<float>(), g_amaxes.back());
  }
}

TEST_F(Fp8LinearTest, FiveStepsFollowTheDelayedScalingFormula) { five_step_case(torch::kCPU); }

TEST_F(Fp8LinearTest, FiveStepsFollowTheDelayedScalingFormula_CUDA) {
  AMP8_REQUIRE_CUDA();
  five_step_case(torch::kCUDA);
}

// Language-model-like data: labels sampled from a fixed teacher's softmax (seed 10), so the
// loss settles at the teacher's entropy. Batches come from the global generator.
struct TeacherTask {
  explicit TeacherTask(torch::Device device_) : device(device_) {
    torch::manual_seed(10);
    teacher = torch::nn::Sequential(torch::nn::Linear(64, 64), torch::nn::Tanh(),
                                    torch::nn::Linear(64, 16));
    teacher->to(device);
  }
  std::pair<torch::Tensor, torch::Tensor> batch() {
    auto x = torch::randn({128, 64}, device);
    torch::NoGradGuard no_grad;
    auto labels = torch::multinomial(torch::softmax(teacher->forward(x) * 4, -1), 1).squeeze(1);
    return {x, labels};
  }
  torch::Device device;
  torch::nn::Sequential teacher{nullptr};
};

// A 3-layer MLP trained 200 steps in FP8 ends within 2% of the fp32 loss. The task is
// language-model-like: labels are sampled from a teacher's softmax, so the loss settles at the
// teacher's entropy instead of at zero, where FP8's rounding noise would be all that is left.
// Returns {mean loss of the first 20 steps, mean loss of the last 20 steps}.
std::pair<double, double> train_mlp(torch::Device device,
                                    const std::optional<Fp8RecipeOptions>& recipe) {
  TeacherTask task(device);
  torch::manual_seed(11);
  auto opts = [](int64_t in, int64_t out) {
    return Fp8LinearOptions(in, out).fp8_min_gemm_size(0);
  };
  auto model =
      torch::nn::Sequential(Fp8Linear(opts(64, 128)), torch::nn::GELU(), Fp8Linear(opts(128, 128)),
                            torch::nn::GELU(), Fp8Linear(opts(128, 16)));
  model->to(device);
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(3e-3));
  torch::manual_seed(12);
  double first_loss = 0, final_loss = 0;
  for (int step = 0; step < 200; ++step) {
    auto [x, labels] = task.batch();
    torch::Tensor loss;
    {
      Fp8Autocast region(recipe.value_or(Fp8RecipeOptions()), recipe.has_value());
      loss = torch::cross_entropy_loss(model->forward(x), labels);
    }
    opt.zero_grad();
    loss.backward();
    opt.step();
    if (step < 20) first_loss += loss.item<double>() / 20;
    if (step >= 180) final_loss += loss.item<double>() / 20;
  }
  return {first_loss, final_loss};
}

void mlp_case(torch::Device device) {
  const auto [fp32_first, fp32] = train_mlp(device, std::nullopt);
  const double hybrid = train_mlp(device, Fp8RecipeOptions().fp8_amax_history_len(16)).second;
  const double e4m3 =
      train_mlp(device, Fp8RecipeOptions().fp8("e4m3").fp8_amax_history_len(16)).second;
  const double tensorwise = train_mlp(device, Fp8RecipeOptions().fp8_recipe("tensorwise")).second;
  const double blockwise = train_mlp(device, Fp8RecipeOptions().fp8_recipe("blockwise")).second;
  EXPECT_LT(fp32, 0.9 * fp32_first) << "the fp32 run itself must learn";
  std::printf(
      "MLP final loss (mean of last 20 steps): fp32 %.5f, hybrid %.5f, e4m3 %.5f, "
      "tensorwise %.5f, blockwise %.5f (first 20 steps: %.5f)\n",
      fp32, hybrid, e4m3, tensorwise, blockwise, fp32_first);
  EXPECT_LE(std::abs(blockwise - fp32) / fp32, 0.02)
      << "blockwise " << blockwise << " vs " << fp32;
  EXPECT_LE(std::abs(hybrid - fp32) / fp32, 0.02) << "hybrid " << hybrid << " vs fp32 " << fp32;
  EXPECT_LE(std::abs(e4m3 - fp32) / fp32, 0.02) << "e4m3 " << e4m3 << " vs fp32 " << fp32;
  EXPECT_LE(std::abs(tensorwise - fp32) / fp32, 0.02)
      << "tensorwise " << tensorwise << " vs " << fp32;
}

TEST_F(Fp8LinearTest, MlpTrainsLikeFp32) { mlp_case(torch::kCPU); }

TEST_F(Fp8LinearTest, MlpTrainsLikeFp32_CUDA) {
  AMP8_REQUIRE_CUDA();
  mlp_case(torch::kCUDA);
}

TEST_F(Fp8LinearTest, SaveLoadKeepsFp8Metadata) {
  Fp8Linear layer(Fp8LinearOptions(32, 32).fp8_amax_history_len(8).fp8_min_gemm_size(0));
  for (int step = 0; step < 3; ++step) {
    Fp8Autocast region(Fp8RecipeOptions().fp8_amax_history_len(8));
    layer->forward(torch::randn({16, 32}) * (step + 1)).sum().backward();
  }
  std::stringstream buffer;
  torch::save(layer, buffer);
  Fp8Linear restored(Fp8LinearOptions(32, 32).fp8_amax_history_len(8).fp8_min_gemm_size(0));
  torch::load(restored, buffer);
  for (const auto& name : {"fp8_fwd_amax_history", "fp8_fwd_scale", "fp8_fwd_scale_inv",
                           "fp8_bwd_amax_history", "fp8_bwd_scale", "fp8_bwd_scale_inv"}) {
    EXPECT_TRUE(
        BytesEqual(*restored->named_buffers().find(name), *layer->named_buffers().find(name)))
        << name;
  }
  EXPECT_NE(layer->fp8_fwd_scale[0].item<float>(), 1.0f) << "the scales did move";
  EXPECT_TRUE(BytesEqual(restored->weight, layer->weight));
}

TEST_F(Fp8LinearTest, WithoutBias) {
  Fp8Linear layer(Fp8LinearOptions(32, 48).bias(false).fp8_min_gemm_size(0));
  auto x = torch::randn({16, 32}).requires_grad_(true);
  torch::Tensor y;
  {
    Fp8Autocast region;
    y = layer->forward(x);
  }
  y.sum().backward();
  auto reference = torch::nn::functional::linear(x.detach(), layer->weight.detach());
  EXPECT_LE(relative_error(y, reference), kForwardBound);
  EXPECT_TRUE(layer->weight.grad().defined());
  EXPECT_TRUE(x.grad().defined());
}

// forward_split's pieces are forward's output split, and their gradients, arriving apart, give
// the bytes the concatenated gradient gives (input, weight, bias, FP8 metadata) in each recipe:
// fp8_linear_backward's column casts, and the blockwise tiles of quantize_blockwise_columns
// (with pieces of whole 1×128 tiles on the GPU, one launch per piece). A piece's gradient at the
// wrong columns, or one piece's gradient standing for all, shows.
void linear_forward_split_case(torch::Device device, torch::ScalarType dtype, int64_t rows,
                               const std::vector<int64_t>& splits) {
  int64_t out = 0;
  for (const auto size : splits) out += size;
  for (const std::string recipe_kind : {"delayed", "tensorwise", "blockwise"}) {
    SCOPED_TRACE(recipe_kind + " " + c10::toString(dtype));
    Fp8Linear whole(Fp8LinearOptions(128, out).fp8_min_gemm_size(0));
    Fp8Linear split(Fp8LinearOptions(128, out).fp8_min_gemm_size(0));
    whole->to(device);
    split->to(device);
    testing::copy_parameters(*whole, *split);
    for (int step = 0; step < 2; ++step) {
      const auto x = (torch::randn({rows, 128}) * (step + 1)).to(device).to(dtype);
      std::vector<torch::Tensor> grads;
      for (size_t i = 0; i < splits.size(); ++i) {
        grads.push_back((torch::randn({rows, splits[i]}) * (1.0 + 4.0 * i)).to(device).to(dtype));
      }
      auto x1 = x.clone().requires_grad_(true), x2 = x.clone().requires_grad_(true);
      torch::Tensor y;
      std::vector<torch::Tensor> pieces;
      {
        Fp8Autocast region(recipe_of(recipe_kind));
        y = whole->forward(x1);
        pieces = split->forward_split(x2, splits);
      }
      ASSERT_EQ(pieces.size(), splits.size());
      for (size_t i = 0; i < splits.size(); ++i) {
        EXPECT_TRUE(BytesEqual(pieces[i], y.split_with_sizes(splits, -1)[i])) << i;
      }
      y.backward(at::cat(grads, -1));
      torch::autograd::backward(pieces, grads);
      EXPECT_TRUE(BytesEqual(x1.grad(), x2.grad())) << "step " << step;
      testing::expect_same_gradients(*split, *whole, "step " + std::to_string(step),
                                     /*buffers=*/true);
    }
  }
}

TEST_F(Fp8LinearTest, ForwardSplitGradientsAreTheConcatenatedGradients) {
  linear_forward_split_case(torch::kCPU, torch::kFloat, 45, {40, 16, 40});
}

TEST_F(Fp8LinearTest, ForwardSplitGradientsAreTheConcatenatedGradients_CUDA) {
  AMP8_REQUIRE_CUDA();
  linear_forward_split_case(torch::kCUDA, torch::kBFloat16, 48, {40, 16, 40});
  linear_forward_split_case(torch::kCUDA, torch::kBFloat16, 272, {256, 128, 128});
}

// forward_with_residual is residual + forward(input): in each recipe, within one rounding of
// the output where the GEMM adds the residual (rows a multiple of 16, the residual in the
// output dtype), the same bytes where it is added after (45 rows: the GEMM's rows are padded; a
// float32 residual under bf16 autocast); the gradients of input, weight and bias the same bytes
// (the backward sees the same output gradient), and the residual's gradient the output's.
void linear_residual_case(torch::Device device, int64_t rows, torch::ScalarType residual_dtype) {
  for (const std::string recipe_kind : {"delayed", "tensorwise", "blockwise"}) {
    SCOPED_TRACE(recipe_kind + " rows " + std::to_string(rows) + " residual " +
                 c10::toString(residual_dtype));
    Fp8Linear plain(Fp8LinearOptions(128, 96).fp8_min_gemm_size(0));
    Fp8Linear fused(Fp8LinearOptions(128, 96).fp8_min_gemm_size(0));
    plain->to(device);
    fused->to(device);
    testing::copy_parameters(*plain, *fused);
    const auto x = torch::randn({2, rows / 2, 128}).to(device);
    const auto r0 = (torch::randn({2, rows / 2, 96}) * 8).to(device).to(residual_dtype);
    auto x1 = x.clone().requires_grad_(true), x2 = x.clone().requires_grad_(true);
    auto r1 = r0.clone().requires_grad_(true), r2 = r0.clone().requires_grad_(true);
    torch::Tensor y1, y2;
    {
      AutocastGuard autocast(at::kBFloat16);
      Fp8Autocast region(recipe_of(recipe_kind));
      y1 = r1 + plain->forward(x1);
      y2 = fused->forward_with_residual(x2, r2);
    }
    testing::expect_residual_added(y2, y1,
                                   /*by_gemm=*/rows % 16 == 0 && residual_dtype == at::kBFloat16);
    testing::backward_with_one_gradient(y1, y2);
    EXPECT_TRUE(BytesEqual(x1.grad(), x2.grad()));
    EXPECT_TRUE(BytesEqual(r2.grad(), r1.grad()));
    testing::expect_same_gradients(*fused, *plain);
  }
}

TEST_F(Fp8LinearTest, ForwardWithResidualIsResidualPlusForward) {
  linear_residual_case(torch::kCPU, 48, at::kBFloat16);
  linear_residual_case(torch::kCPU, 46, at::kBFloat16);
  linear_residual_case(torch::kCPU, 48, at::kFloat);
  Fp8Linear layer(Fp8LinearOptions(64, 48));
  testing::ExpectErrorContaining(
      [&] { layer->forward_with_residual(torch::randn({4, 64}), torch::randn({4, 64})); },
      "Fp8Linear::forward_with_residual: residual must have the output's shape [4, 48], got [4, 64]");
  // Outside an FP8 region: residual + torch::nn::Linear's output.
  const auto x = torch::randn({4, 64}), r = torch::randn({4, 48});
  EXPECT_TRUE(BytesEqual(layer->forward_with_residual(x, r), r + layer->forward(x)));
}

TEST_F(Fp8LinearTest, ForwardWithResidualIsResidualPlusForward_CUDA) {
  AMP8_REQUIRE_CUDA();
  linear_residual_case(torch::kCUDA, 48, at::kBFloat16);
  linear_residual_case(torch::kCUDA, 46, at::kBFloat16);
  linear_residual_case(torch::kCUDA, 48, at::kFloat);
}

TEST_F(Fp8LinearTest, ForwardSplitNamesBadSizes) {
  Fp8Linear layer(Fp8LinearOptions(64, 48));
  const auto x = torch::randn({4, 64});
  testing::ExpectErrorContaining([&] { layer->forward_split(x, {16, 16}); },
                                 "Fp8Linear::forward_split: split_sizes must sum to "
                                 "out_features=48, got [16, 16]");
  testing::ExpectErrorContaining([&] { layer->forward_split(x, {56, -8}); },
                                 "Fp8Linear::forward_split: split_sizes must be positive");
  // Outside an FP8 region: torch::nn::Linear's output split.
  const auto pieces = layer->forward_split(x, {16, 32});
  ASSERT_EQ(pieces.size(), 2u);
  EXPECT_TRUE(BytesEqual(pieces[1], layer->forward(x).narrow(1, 16, 32)));
}

// The backward frees the saved FP8 input transpose before dgrad unless the graph is retained:
// with retain_graph a second backward still finds it and matches the fp64 gradients, and
// after the last one a further backward is LibTorch's usual error, not a missing tensor.
TEST_F(Fp8LinearTest, RetainedGraphKeepsTheSavedInputForASecondBackward) {
  Fp8Linear layer(Fp8LinearOptions(64, 48).fp8_min_gemm_size(0));
  auto x = torch::randn({24, 64}).requires_grad_(true);
  auto grad_y = torch::randn({24, 48});
  torch::Tensor y;
  {
    Fp8Autocast region;
    y = layer->forward(x);
  }
  y.backward(grad_y, /*retain_graph=*/true);
  layer->zero_grad();
  x.mutable_grad() = torch::Tensor();
  y.backward(grad_y);
  auto xd = x.detach().to(torch::kDouble).requires_grad_(true);
  auto wd = layer->weight.detach().to(torch::kDouble).requires_grad_(true);
  torch::nn::functional::linear(xd, wd, layer->bias.detach().to(torch::kDouble))
      .backward(grad_y.to(torch::kDouble));
  EXPECT_LE(relative_error(x.grad(), xd.grad()), kHybridGradBound);
  EXPECT_LE(relative_error(layer->weight.grad(), wd.grad()), kHybridGradBound);
  try {
    y.backward(grad_y);
    ADD_FAILURE() << "a third backward through a freed graph ran";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("second time"));
  }
}

TEST_F(Fp8LinearTest, SmallGemmsRunInHighPrecisionByDefault) {
  Fp8Linear layer(64, 64);  // default fp8_min_gemm_size: per shape, and 16 x 64 x 64 is below the grid
  auto x = torch::randn({16, 64});
  Fp8Autocast region;
  EXPECT_TRUE(
      BytesEqual(layer->forward(x), torch::nn::functional::linear(x, layer->weight, layer->bias)));
  EXPECT_TRUE(
      BytesEqual(layer->fp8_fwd_amax_history, torch::zeros_like(layer->fp8_fwd_amax_history)))
      << "no FP8 tensor was recorded";
}

// The default fp8_min_gemm_size chooses per shape from the measured grid: a shape is judged by
// the largest grid point it contains (each dimension rounded down), below the grid it stays in
// high precision, and Fp8Linear follows the choice for its own fp8_params.
TEST_F(Fp8LinearTest, DefaultChoosesFp8PerMeasuredShape) {
  EXPECT_EQ(Fp8LinearOptions(16, 16).fp8_min_gemm_size(), kFp8GemmSizeByShape);
  const std::vector<int64_t> rows = {1024, 2048, 4096, 8192, 16384}, dims = {1024, 2048, 4096, 8192};
  int chosen = 0, not_chosen = 0;
  for (const bool params : {false, true}) {
    for (size_t r = 0; r < rows.size(); ++r) {
      for (const int64_t i : dims) {
        for (const int64_t o : dims) {
          const bool at_point = fp8_gemm_pays_off(rows[r], i, o, params);
          (at_point ? chosen : not_chosen)++;
          // Between grid points (and beyond the last one) as at the point below.
          const int64_t between = r + 1 < rows.size() ? rows[r] + rows[r] / 2 : rows[r] * 4;
          EXPECT_EQ(fp8_gemm_pays_off(between, i + i / 2, o + 16, params), at_point)
              << between << " x " << i + i / 2 << " x " << o + 16;
          EXPECT_EQ(fp8_gemm_chosen(rows[r], i, o, kFp8GemmSizeByShape, params), at_point);
          // A size ≥ 0 is the product rule, whatever was measured.
          EXPECT_TRUE(fp8_gemm_chosen(rows[r], i, o, 0, params));
          EXPECT_EQ(fp8_gemm_chosen(rows[r], i, o, rows[r] * i * o + 1, params), false);
        }
      }
    }
    // Below the grid in any dimension: high precision.
    EXPECT_FALSE(fp8_gemm_pays_off(1008, 8192, 8192, params));
    EXPECT_FALSE(fp8_gemm_pays_off(16384, 1008, 8192, params));
    EXPECT_FALSE(fp8_gemm_pays_off(16384, 8192, 1008, params));
  }
  EXPECT_GT(chosen, 0) << "FP8 was measured faster nowhere";
  EXPECT_GT(not_chosen, 0) << "FP8 was measured faster everywhere";

  // The module follows the choice (16 rows: far below the grid; 16384 rows: on it).
  Fp8Linear layer(1024, 2048);
  Fp8Autocast region;
  EXPECT_FALSE(layer->runs_in_fp8(16));
  EXPECT_EQ(layer->runs_in_fp8(16384), fp8_gemm_pays_off(16384, 1024, 2048, false));
  testing::ExpectErrorContaining([] { check_fp8_min_gemm_size(-2, "fp8_min_gemm_size"); },
                        "fp8_min_gemm_size must be >= 0 (rows x in x out of the smallest GEMM in "
                        "FP8; 0: every GEMM) or -1 (per shape");
}

TEST_F(Fp8LinearTest, IneligibleShapesFallBackToHighPrecision) {
  Fp8Linear layer(Fp8LinearOptions(30, 20).fp8_min_gemm_size(0));
  EXPECT_FALSE(layer->fp8_eligible());
  auto x = torch::randn({4, 30});
  Fp8Autocast region;
  auto y = layer->forward(x);
  EXPECT_TRUE(BytesEqual(y, torch::nn::functional::linear(x, layer->weight, layer->bias)));
}

// Every recipe: per tensor, or (blockwise) the weight's 128x128 blocks and their transpose.
TEST_F(Fp8LinearTest, WeightCacheQuantizesOncePerWeightVersion) {
  for (const std::string kind : {"delayed", "tensorwise", "blockwise"}) {
    SCOPED_TRACE(kind);
    const auto options = Fp8LinearOptions(32, 48).fp8_amax_history_len(4).fp8_min_gemm_size(0);
    Fp8Linear cached(Fp8LinearOptions(options).cache_fp8_weight(true));
    Fp8Linear plain(options);
    {
      torch::NoGradGuard no_grad;
      plain->weight.copy_(cached->weight);
      plain->bias.copy_(cached->bias);
    }
    auto x = torch::randn({16, 32});
    auto run = [&](Fp8Linear& layer, const std::string& recipe) {
      Fp8Autocast region(recipe_of(recipe));
      return layer->forward(x);
    };
    auto y_cached = run(cached, kind), y_plain = run(plain, kind);
    EXPECT_TRUE(BytesEqual(y_cached, y_plain));

    // Writing through .data() does not bump the parameter's version: the cached FP8 weight is
    // reused (stale on purpose here, to prove the reuse), the uncached layer sees the change.
    cached->weight.data().mul_(0.5);
    plain->weight.data().mul_(0.5);
    auto y_cached_stale = run(cached, kind), y_plain_half = run(plain, kind);
    EXPECT_LE(relative_error(y_cached_stale - cached->bias, y_cached - cached->bias), kForwardBound);
    EXPECT_GT(relative_error(y_plain_half - plain->bias, y_cached - cached->bias), 0.3);

    // Another recipe's copy is never taken for this one's: under the other recipe the layer
    // quantizes the weight as it is now.
    for (const std::string other : {"delayed", "tensorwise", "blockwise"}) {
      if (other != kind) {
        EXPECT_TRUE(BytesEqual(run(cached, other), run(plain, other))) << other;
      }
    }

    // An in-place update of the parameter, as optimizers make, bumps the version: re-quantized.
    {
      torch::NoGradGuard no_grad;
      cached->weight.mul_(1.0);
    }
    auto y_cached_fresh = run(cached, kind), y_plain_again = run(plain, kind);
    EXPECT_LE(relative_error(y_cached_fresh - cached->bias, y_plain_again - plain->bias), 2 * kForwardBound);
    EXPECT_GT(relative_error(y_cached_fresh - cached->bias, y_cached - cached->bias), 0.3);
  }
}

TEST_F(Fp8LinearTest, MicroBatchesInOneRegionShareTheAmaxSlotByMax) {
  Fp8Linear layer(Fp8LinearOptions(32, 32).fp8_amax_history_len(2).fp8_min_gemm_size(0));
  auto x = torch::randn({16, 32});
  {
    Fp8Autocast region(Fp8RecipeOptions().fp8_amax_history_len(2));
    layer->forward(x * 3);
    layer->forward(x);  // a smaller second micro-batch must not overwrite the first's amax
  }
  // After the update the step's amax sits in the last history row.
  EXPECT_EQ(layer->fp8_fwd_amax_history[1][0].item<float>(), (x * 3).abs().max().item<float>());
}

TEST_F(Fp8LinearTest, NestedRegionsAndDisabledRegions) {
  Fp8Linear layer(Fp8LinearOptions(32, 32).fp8_min_gemm_size(0));
  auto x = torch::randn({16, 32});
  auto high = torch::nn::functional::linear(x, layer->weight, layer->bias);
  {
    Fp8Autocast outer;
    EXPECT_TRUE(Fp8Autocast::is_enabled());
    {
      Fp8Autocast inner(Fp8RecipeOptions(), /*enabled=*/false);
      EXPECT_FALSE(Fp8Autocast::is_enabled());
      EXPECT_TRUE(BytesEqual(layer->forward(x), high));
    }
    EXPECT_TRUE(Fp8Autocast::is_enabled());
    EXPECT_FALSE(BytesEqual(layer->forward(x), high)) << "FP8 inside the outer region";
  }
  EXPECT_FALSE(Fp8Autocast::is_enabled());
}

TEST_F(Fp8LinearTest, EveryLayerIsUpdatedOncePerRegionAndPerBackwardPass) {
  auto model = torch::nn::Sequential(
      Fp8Linear(Fp8LinearOptions(32, 64).fp8_amax_history_len(4).fp8_min_gemm_size(0)),
      Fp8Linear(Fp8LinearOptions(64, 16).fp8_amax_history_len(4).fp8_min_gemm_size(0)));
  auto x = torch::randn({8, 32});
  torch::Tensor y;
  {
    Fp8Autocast region(Fp8RecipeOptions().fp8_amax_history_len(4));
    y = model->forward(x);
  }
  for (const auto& child : model->children()) {
    auto* layer = child->as<Fp8LinearImpl>();
    ASSERT_NE(layer, nullptr);
    // Rolled once: the amax moved from row 0 to the last row, row 0 zeroed.
    EXPECT_GT(layer->fp8_fwd_amax_history[3][0].item<float>(), 0.0f);
    EXPECT_EQ(layer->fp8_fwd_amax_history[2][0].item<float>(), 0.0f);
    EXPECT_EQ(layer->fp8_bwd_amax_history[3][0].item<float>(), 0.0f) << "no backward yet";
  }
  y.sum().backward();
  for (const auto& child : model->children()) {
    auto* layer = child->as<Fp8LinearImpl>();
    EXPECT_GT(layer->fp8_bwd_amax_history[3][0].item<float>(), 0.0f) << "updated after backward";
    EXPECT_EQ(layer->fp8_bwd_amax_history[0][0].item<float>(), 0.0f);
    EXPECT_NE(layer->fp8_bwd_scale[0].item<float>(), 1.0f);
  }
}

// ---- fp8_params (Fp8ModelInit) ----

Fp8Linear make_fp8_params_layer(int64_t in, int64_t out, bool preserve = true) {
  Fp8ModelInit init(true, preserve);
  return Fp8Linear(Fp8LinearOptions(in, out).fp8_amax_history_len(16).fp8_min_gemm_size(0));
}

TEST_F(Fp8LinearTest, ModelInitKeepsWeightsOnlyInFp8) {
  torch::manual_seed(1);
  auto layer = make_fp8_params_layer(64, 32);
  torch::manual_seed(1);
  torch::nn::Linear reference(64, 32);
  EXPECT_FALSE(Fp8ModelInit::is_enabled()) << "the guard closed";
  EXPECT_TRUE(layer->options.fp8_params());
  EXPECT_EQ(layer->weight.scalar_type(), torch::kFloat8_e4m3fn);
  EXPECT_EQ(layer->weight.nbytes(), 64 * 32) << "one byte per weight";
  EXPECT_FALSE(layer->weight.requires_grad());
  // The master copy is to be seeded from the real initial values, not their FP8 rounding.
  EXPECT_TRUE(BytesEqual(layer->high_precision_init_val(), reference->weight));
  EXPECT_TRUE(BytesEqual(layer->bias, reference->bias));
  EXPECT_LE(relative_error(layer->fp8_weight().dequantize(), reference->weight), kE4M3Rms);
  layer->clear_high_precision_init_val();
  EXPECT_FALSE(layer->high_precision_init_val().defined());
  EXPECT_FALSE(
      make_fp8_params_layer(32, 32, /*preserve=*/false)->high_precision_init_val().defined());
  EXPECT_FALSE(Fp8Linear(32, 32)->options.fp8_params()) << "outside the guard";
  // A shape FP8 GEMMs cannot take (an output head of 10 classes) is no error under
  // Fp8ModelInit: the layer keeps its weight in high precision and computes like nn::Linear.
  for (const auto& [in, out] : std::vector<std::pair<int64_t, int64_t>>{{30, 20}, {64, 10}}) {
    auto head = make_fp8_params_layer(in, out);
    EXPECT_FALSE(head->options.fp8_params()) << in << "x" << out;
    EXPECT_EQ(head->weight.scalar_type(), at::kFloat);
    EXPECT_TRUE(head->weight.requires_grad());
    auto linear = torch::nn::Linear(in, out);
    {
      torch::NoGradGuard no_grad;
      linear->weight.copy_(head->weight);
      linear->bias.copy_(head->bias);
    }
    const auto x = torch::randn({5, in});
    Fp8Autocast region;
    EXPECT_TRUE(BytesEqual(head->forward(x), linear->forward(x)));
  }
}

// The distributed optimizer's per-step record of the weights it wrote, for all layers at once:
// each history slot keeps the max of what it held and the new amax (as fp8_weight_written),
// each layer takes its scale_inv.
TEST_F(Fp8LinearTest, WeightsWrittenForManyLayersAtOnce) {
  auto a = make_fp8_params_layer(32, 32), b = make_fp8_params_layer(32, 48);
  {
    torch::NoGradGuard no_grad;
    a->fp8_fwd_amax_history[0][1].fill_(5.0f);
    b->fp8_fwd_amax_history[0][1].fill_(1.0f);
  }
  Fp8LinearImpl::fp8_weights_written({a.get(), b.get()}, torch::tensor({3.0f, 4.0f}),
                                     torch::tensor({0.25f, 0.125f}));
  EXPECT_EQ(a->fp8_fwd_amax_history[0][1].item<float>(), 5.0f) << "kept the larger amax";
  EXPECT_EQ(b->fp8_fwd_amax_history[0][1].item<float>(), 4.0f);
  EXPECT_EQ(a->weight_scale_inv.item<float>(), 0.25f);
  EXPECT_EQ(b->weight_scale_inv.item<float>(), 0.125f);
  EXPECT_EQ(a->fp8_fwd_amax_history[1][1].item<float>(), 0.0f) << "only row 0 is the slot";
  EXPECT_EQ(a->fp8_fwd_amax_history[0][0].item<float>(), 0.0f) << "only the weight's slot";
  testing::ExpectErrorContaining(
      [&] {
        Fp8LinearImpl::fp8_weights_written({a.get(), b.get()}, torch::ones({3}), torch::ones({2}));
      },
      "Fp8Linear::fp8_weights_written: amaxes must be float32 [2] (one per layer), got Float [3]");
  auto plain = Fp8Linear(Fp8LinearOptions(32, 32));
  testing::ExpectErrorContaining(
      [&] { Fp8LinearImpl::fp8_weights_written({plain.get()}, torch::ones({1}), torch::ones({1})); },
      "every layer must be an Fp8Linear built with fp8_params");
}

// The plugin's batched re-quantization after a step is update_fp8_weight layer by layer, byte
// for byte: weights, scale_inv and the amax history slot (kept at the max), a NaN in a master
// included (its amax NaN, its scale the fallback 1, as compute_amax and the formula give).
void update_many_case(torch::Device device) {
  torch::manual_seed(3);
  std::vector<Fp8Linear> batched, one_by_one;
  std::vector<torch::Tensor> masters;
  for (auto [in, out] : std::vector<std::pair<int64_t, int64_t>>{{32, 48}, {64, 32}, {48, 16}}) {
    batched.push_back(make_fp8_params_layer(in, out));
    batched.back()->to(device);
    one_by_one.push_back(std::dynamic_pointer_cast<Fp8LinearImpl>(batched.back()->clone()));
    one_by_one.back()->to(device);
    masters.push_back(torch::randn({out, in}, device) * (masters.size() + 1));
  }
  masters[1][3][5].fill_(std::numeric_limits<float>::quiet_NaN());
  {
    torch::NoGradGuard no_grad;
    batched[2]->fp8_fwd_amax_history[0][1].fill_(1e4f);  // larger than the master's: kept
    one_by_one[2]->fp8_fwd_amax_history[0][1].fill_(1e4f);
  }
  std::vector<Fp8LinearImpl*> layers;
  for (auto& layer : batched) layers.push_back(layer.get());
  Fp8LinearImpl::update_fp8_weights(layers, masters);
  for (size_t i = 0; i < masters.size(); ++i) {
    SCOPED_TRACE("layer " + std::to_string(i));
    one_by_one[i]->update_fp8_weight(masters[i]);
    EXPECT_TRUE(BytesEqual(batched[i]->weight, one_by_one[i]->weight));
    EXPECT_TRUE(BytesEqual(batched[i]->weight_scale_inv, one_by_one[i]->weight_scale_inv));
    EXPECT_TRUE(BytesEqual(batched[i]->fp8_fwd_amax_history, one_by_one[i]->fp8_fwd_amax_history));
  }
  EXPECT_TRUE(std::isnan(batched[1]->fp8_fwd_amax_history[0][1].item<float>()));
  EXPECT_EQ(batched[1]->weight_scale_inv.item<float>(), 1.0f);
  EXPECT_EQ(batched[2]->fp8_fwd_amax_history[0][1].item<float>(), 1e4f);
  EXPECT_GT(batched[0]->weight_scale_inv.item<float>(), 0.0f);
  EXPECT_NE(batched[0]->weight_scale_inv.item<float>(), 1.0f);
  testing::ExpectErrorContaining(
      [&] { Fp8LinearImpl::update_fp8_weights(layers, {masters[0], masters[1]}); },
      "Fp8Linear::update_fp8_weights: 3 layers but 2 masters");
  testing::ExpectErrorContaining(
      [&] { Fp8LinearImpl::update_fp8_weights({layers[0]}, {masters[1]}); },
      "Fp8Linear::update_fp8_weights: masters[0] must have shape [48, 32], got [32, 64]");
}

TEST_F(Fp8LinearTest, UpdatingManyFp8WeightsIsUpdatingEachOne) { update_many_case(torch::kCPU); }

TEST_F(Fp8LinearTest, UpdatingManyFp8WeightsIsUpdatingEachOne_CUDA) {
  AMP8_REQUIRE_CUDA();
  update_many_case(torch::kCUDA);
}

void fp8_params_gradient_case(torch::Device device) {
  torch::manual_seed(6);
  auto layer = make_fp8_params_layer(96, 48);
  layer->to(device);
  auto x = torch::randn({40, 96}, device);
  auto g = torch::randn({40, 48}, device);
  auto w = layer->fp8_weight().dequantize().to(torch::kDouble);
  auto reference_dw = torch::matmul(g.to(torch::kDouble).t(), x.to(torch::kDouble));
  for (int step = 0; step < 2; ++step) {  // the second step runs with scales from the history
    layer->zero_main_grad();
    layer->bias.mutable_grad() = torch::Tensor();
    auto xr = x.clone().requires_grad_(true);
    torch::Tensor y;
    {
      Fp8Autocast region(Fp8RecipeOptions().fp8_amax_history_len(16));
      y = layer->forward(xr);
    }
    y.backward(g);
    if (step == 0) continue;
    auto yd =
        torch::nn::functional::linear(x.to(torch::kDouble), w, layer->bias.to(torch::kDouble));
    EXPECT_LE(relative_error(y, yd), kForwardBound) << device;
    ASSERT_TRUE(layer->main_grad().defined());
    EXPECT_EQ(layer->main_grad().scalar_type(), torch::kFloat);
    EXPECT_LE(relative_error(layer->main_grad(), reference_dw), kHybridGradBound) << device;
    EXPECT_LE(relative_error(xr.grad(), torch::matmul(g.to(torch::kDouble), w)), kHybridGradBound);
    // The bias gradient is the column sum of the (unquantized) output gradient, in the bias's
    // dtype: it once took the FP8 weight's dtype, an E4M3 rounding (~3% off) on its way.
    ASSERT_TRUE(layer->bias.grad().defined());
    EXPECT_EQ(layer->bias.grad().scalar_type(), layer->bias.scalar_type());
    EXPECT_LE(relative_error(layer->bias.grad(), g.to(torch::kDouble).sum(0)), 1e-5) << device;
  }
  // Outside a region: high precision, and the gradient still lands in main_grad (accumulated).
  auto before = layer->main_grad().clone();
  layer->forward(x).backward(g);
  EXPECT_LE(relative_error(layer->main_grad() - before, reference_dw), 1e-5) << device;
  // Cleared as zero_grad clears .grad: released by default, zero-filled on request.
  layer->zero_main_grad(/*set_to_none=*/false);
  ASSERT_TRUE(layer->main_grad().defined());
  EXPECT_EQ(layer->main_grad().abs().max().item<float>(), 0.0f);
  layer->zero_main_grad();
  EXPECT_FALSE(layer->main_grad().defined());
}

// Under fp8_params the forward saves the stored FP8 weight itself (no copy) for dgrad, whose
// byte transpose the backward makes: a model's layers do not all hold a transposed weight
// between their forward and backward.
TEST_F(Fp8LinearTest, Fp8ParamsForwardSavesNoWeightTranspose) {
  auto layer = make_fp8_params_layer(1024, 512);
  auto x = torch::randn({16, 1024}).requires_grad_(true);
  auto g = torch::randn({16, 512});
  const auto reference_dx = torch::matmul(g.to(torch::kDouble),
                                          layer->fp8_weight().dequantize().to(torch::kDouble));
  for (int step = 0; step < 2; ++step) {
    x.mutable_grad() = torch::Tensor();
    torch::Tensor y;
    const int64_t before = testing::CpuAllocationCounter::live_bytes();
    {
      Fp8Autocast region(Fp8RecipeOptions().fp8_amax_history_len(16));
      y = layer->forward(x);
    }
    const int64_t kept = testing::CpuAllocationCounter::live_bytes() - before;
    // y (16×512 float32, 32 KiB), the input transpose (16 KiB) and scale metadata; the
    // transposed weight alone would be 512 KiB.
    EXPECT_GT(kept, y.nbytes());
    EXPECT_LT(kept, layer->weight.nbytes() / 4);
    y.backward(g);
    EXPECT_LE(relative_error(x.grad(), reference_dx), kHybridGradBound) << "step " << step;
  }
}

// Issue 3's memory target, as fp8_linear_bench measures it: under Fp8ModelInit a 4096×4096
// layer's forward + backward over 16384 tokens peaks no higher than a bf16 torch::nn::Linear's
// (second step of each, so that gradients exist; allocated bytes, inputs included).
TEST_F(Fp8LinearTest, Fp8ParamsPeakMemoryIsAtMostBf16Linears_CUDA) {
  AMP8_REQUIRE_CUDA();
#ifdef AMP8_HAS_CUDA_ALLOCATOR
  namespace alloc = c10::cuda::CUDACachingAllocator;
  const int64_t m = 16384, k = 4096, n = 4096;
  const auto aggregate = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  auto second_step_peak = [&](const std::function<void()>& step) {
    step();
    torch::cuda::synchronize();
    alloc::resetPeakStats(0);
    step();
    torch::cuda::synchronize();
    return alloc::getDeviceStats(0).allocated_bytes[aggregate].peak;
  };
  const auto bf16 = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  int64_t bf16_peak = 0, fp8_peak = 0;
  {
    torch::nn::Linear reference(k, n);
    reference->to(torch::kCUDA, torch::kBFloat16);
    auto x = torch::randn({m, k}, bf16).requires_grad_(true);
    auto g = torch::randn({m, n}, bf16);
    bf16_peak = second_step_peak([&] {
      x.mutable_grad() = torch::Tensor();
      reference->forward(x).backward(g);
    });
  }
  {
    Fp8Linear layer{nullptr};
    {
      Fp8ModelInit init(true, /*preserve_high_precision_init_val=*/false);
      layer = Fp8Linear(Fp8LinearOptions(k, n));
    }
    layer->to(torch::kCUDA);
    layer->bias.set_data(layer->bias.to(torch::kBFloat16));
    auto x = torch::randn({m, k}, bf16).requires_grad_(true);
    auto g = torch::randn({m, n}, bf16);
    fp8_peak = second_step_peak([&] {
      x.mutable_grad() = torch::Tensor();
      torch::Tensor y;
      {
        Fp8Autocast region;
        y = layer->forward(x);
      }
      y.backward(g);
    });
    ASSERT_TRUE(layer->main_grad().defined());
  }
  EXPECT_LE(fp8_peak, bf16_peak) << "FP8 " << fp8_peak / 1e6 << " MB, bf16 " << bf16_peak / 1e6 << " MB";
#else
  GTEST_SKIP() << "LibTorch without the CUDA caching allocator";
#endif
}

TEST_F(Fp8LinearTest, Fp8ParamsGradientsGoToMainGrad) { fp8_params_gradient_case(torch::kCPU); }

TEST_F(Fp8LinearTest, Fp8ParamsGradientsGoToMainGrad_CUDA) {
  AMP8_REQUIRE_CUDA();
  fp8_params_gradient_case(torch::kCUDA);
}

// The autograd graph keeps the layer's Fp8Meta, not the module: a backward pass after the module
// is gone still adds the weight gradient into main_grad (FP8 path and high-precision path; the
// graph once held a raw module pointer, and the high-precision hook captured `this`).
TEST_F(Fp8LinearTest, BackwardAfterTheModuleIsGoneFeedsItsMeta) {
  torch::manual_seed(8);
  auto x = torch::randn({40, 96});
  auto g = torch::randn({40, 48});
  const auto reference_dw = torch::matmul(g.to(torch::kDouble).t(), x.to(torch::kDouble));
  for (const bool in_region : {true, false}) {
    auto layer = make_fp8_params_layer(96, 48);
    const auto meta = layer->fp8_meta();
    torch::Tensor y;
    {
      Fp8Autocast region(Fp8RecipeOptions().fp8_amax_history_len(16), /*enabled=*/in_region);
      y = layer->forward(x);
    }
    layer = Fp8Linear(nullptr);
    y.backward(g);
    ASSERT_TRUE(meta->main_grad().tensor().defined()) << "in_region=" << in_region;
    EXPECT_LE(relative_error(meta->main_grad().tensor(), reference_dw),
              in_region ? kHybridGradBound : 1e-5)
        << "in_region=" << in_region;
  }
}

// Each module has its own meta: clone() (which copy-constructs, then resets) leaves the
// original's main_grad binding alone and starts unbound, with the same values.
TEST_F(Fp8LinearTest, ACloneHasAMetaOfItsOwn) {
  auto layer = make_fp8_params_layer(32, 48);
  auto buffer = torch::zeros({48, 32});
  layer->set_main_grad_buffer(buffer);
  auto copy = std::dynamic_pointer_cast<Fp8LinearImpl>(layer->clone());
  ASSERT_TRUE(copy);
  EXPECT_NE(copy->fp8_meta().get(), layer->fp8_meta().get());
  EXPECT_TRUE(layer->main_grad().is_same(buffer)) << "the original keeps its binding";
  EXPECT_FALSE(copy->main_grad().defined()) << "a clone starts unbound";
  EXPECT_TRUE(BytesEqual(copy->weight, layer->weight));
  EXPECT_TRUE(BytesEqual(copy->weight_scale_inv, layer->weight_scale_inv));
  // The copy's slots are views of its own buffers.
  EXPECT_EQ(copy->fp8_meta()->amax(Fp8Slot::kWeight).data_ptr(),
            copy->fp8_fwd_amax_history[0][1].data_ptr());
}

// The meta's slots are views of the module's buffers, by role (Fp8Slot), and follow them
// through a history resize and a move (to()).
TEST_F(Fp8LinearTest, MetaSlotsAreViewsOfTheBuffers) {
  Fp8Linear layer(Fp8LinearOptions(32, 48).fp8_amax_history_len(4));
  {
    torch::NoGradGuard no_grad;
    layer->fp8_fwd_amax_history[0].copy_(torch::tensor({1.0f, 2.0f}));
    layer->fp8_bwd_amax_history[0][0].fill_(3.0f);
    layer->fp8_fwd_scale.copy_(torch::tensor({5.0f, 6.0f}));
    layer->fp8_bwd_scale.fill_(7.0f);
  }
  auto& meta = *layer->fp8_meta();
  auto expect_slots = [&](const std::string& when) {
    EXPECT_EQ(meta.amax(Fp8Slot::kInput).item<double>(), 1.0) << when;
    EXPECT_EQ(meta.amax(Fp8Slot::kWeight).item<double>(), 2.0) << when;
    EXPECT_EQ(meta.amax(Fp8Slot::kGradOutput).item<double>(), 3.0) << when;
    EXPECT_EQ(meta.scale(Fp8Slot::kInput).item<double>(), 5.0) << when;
    EXPECT_EQ(meta.scale(Fp8Slot::kWeight).item<double>(), 6.0) << when;
    EXPECT_EQ(meta.scale(Fp8Slot::kGradOutput).item<double>(), 7.0) << when;
    // Views, not copies: writing a slot writes the module's buffer.
    EXPECT_EQ(meta.amax(Fp8Slot::kWeight).data_ptr(),
              layer->fp8_fwd_amax_history[0][1].data_ptr())
        << when;
    EXPECT_EQ(meta.scale(Fp8Slot::kGradOutput).data_ptr(), layer->fp8_bwd_scale.data_ptr())
        << when;
  };
  expect_slots("as built");
  meta.ensure_history_len(9);
  EXPECT_EQ(layer->fp8_fwd_amax_history.size(0), 9);
  EXPECT_EQ(layer->fp8_bwd_amax_history.size(0), 9);
  expect_slots("after a history resize");
  layer->to(torch::kDouble);
  EXPECT_EQ(meta.amax(Fp8Slot::kInput).scalar_type(), torch::kDouble);
  expect_slots("after to(kDouble)");
}

// The MLP of MlpTrainsLikeFp32 with fp8_params: FP32 masters seeded from the high-precision
// initial values, stepped by Adam on main_grad, re-quantized into the FP8 weights each step.
double train_fp8_params_mlp(torch::Device device) {
  TeacherTask task(device);
  torch::manual_seed(11);
  std::vector<Fp8Linear> layers = {make_fp8_params_layer(64, 128), make_fp8_params_layer(128, 128),
                                   make_fp8_params_layer(128, 16)};
  std::vector<torch::Tensor> params, masters;
  for (auto& layer : layers) {
    layer->to(device);
    masters.push_back(layer->high_precision_init_val().to(device).clone().requires_grad_(true));
    layer->clear_high_precision_init_val();
    params.push_back(masters.back());
    params.push_back(layer->bias);
  }
  torch::optim::Adam opt(params, torch::optim::AdamOptions(3e-3));
  torch::manual_seed(12);
  double final_loss = 0;
  const auto recipe = Fp8RecipeOptions().fp8_amax_history_len(16);
  for (int step = 0; step < 200; ++step) {
    auto [x, labels] = task.batch();
    torch::Tensor loss;
    {
      Fp8Autocast region(recipe);
      auto h = torch::gelu(layers[0]->forward(x));
      h = torch::gelu(layers[1]->forward(h));
      loss = torch::cross_entropy_loss(layers[2]->forward(h), labels);
    }
    opt.zero_grad();
    for (auto& layer : layers) layer->zero_main_grad();
    loss.backward();
    for (size_t i = 0; i < layers.size(); ++i)
      masters[i].mutable_grad() = layers[i]->main_grad().clone();
    opt.step();
    for (size_t i = 0; i < layers.size(); ++i) layers[i]->update_fp8_weight(masters[i]);
    if (step >= 180) final_loss += loss.item<double>() / 20;
  }
  return final_loss;
}

void fp8_params_mlp_case(torch::Device device) {
  const double fp32 = train_mlp(device, std::nullopt).second;
  const double fp8_params = train_fp8_params_mlp(device);
  std::printf("MLP final loss: fp32 %.5f, hybrid with fp8_params %.5f\n", fp32, fp8_params);
  EXPECT_LE(std::abs(fp8_params - fp32) / fp32, 0.02) << fp8_params << " vs fp32 " << fp32;
}

TEST_F(Fp8LinearTest, Fp8ParamsMlpTrainsLikeFp32) { fp8_params_mlp_case(torch::kCPU); }

TEST_F(Fp8LinearTest, Fp8ParamsMlpTrainsLikeFp32_CUDA) {
  AMP8_REQUIRE_CUDA();
  fp8_params_mlp_case(torch::kCUDA);
}

TEST_F(Fp8LinearTest, Fp8ParamsSaveLoad) {
  auto layer = make_fp8_params_layer(32, 32);
  std::stringstream buffer;
  torch::save(layer, buffer);
  auto restored = make_fp8_params_layer(32, 32);
  torch::load(restored, buffer);
  EXPECT_TRUE(BytesEqual(restored->weight, layer->weight));
  EXPECT_TRUE(BytesEqual(restored->weight_scale_inv, layer->weight_scale_inv));
}

TEST_F(Fp8LinearTest, BadRecipesAreNamed) {
  auto expect_error = [](const Fp8RecipeOptions& recipe, const std::string& text) {
    try {
      Fp8Autocast region(recipe);
      ADD_FAILURE() << "expected an error containing: " << text;
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what_without_backtrace(), HasSubstr(text));
    }
  };
  expect_error(Fp8RecipeOptions().fp8("e5m2"), "fp8 must be \"hybrid\" or \"e4m3\", got \"e5m2\"");
  expect_error(Fp8RecipeOptions().fp8_margin(-1), "fp8_margin must be in [0, 126], got -1");
  expect_error(Fp8RecipeOptions().fp8_amax_history_len(0),
               "fp8_amax_history_len must be in [1, 1048576], got 0");
  expect_error(Fp8RecipeOptions().fp8_amax_compute_algo("mean"),
               "fp8_amax_compute_algo must be \"max\" or \"most_recent\", got \"mean\"");
  expect_error(Fp8RecipeOptions().fp8_recipe("current"),
               "fp8_recipe must be \"delayed\", \"tensorwise\" or \"blockwise\", got \"current\"");
  expect_error(Fp8RecipeOptions().fp8_recipe("mxfp8"), "needs GPUs with MXFP8 tensor cores: NVIDIA Blackwell");
  EXPECT_FALSE(Fp8Autocast::is_enabled()) << "a failed region must not stay open";
  try {
    Fp8Linear(0, 16);
    ADD_FAILURE();
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(),
                HasSubstr("in_features and out_features must be positive"));
  }
  Fp8Linear layer(32, 16);
  Fp8Autocast region;
  try {
    layer->forward(torch::randn({4, 31}));
    ADD_FAILURE();
  } catch (const c10::Error& e) {
    EXPECT_THAT(
        e.what_without_backtrace(),
        HasSubstr("input must have in_features=32 as its last dimension, got shape [4, 31]"));
  }
}

}  // namespace
}  // namespace amp8
