// LayerNorm on the GPU: amp8's kernels (high-precision output, FP8 output, backward, the FP8
// byte transpose) against ATen's in the same run, as bandwidth and as a fraction of the
// device-copy rate; and the fused Fp8LayerNormLinear against torch::nn::LayerNorm +
// torch::nn::Linear under bf16 autocast and against the unfused Fp8LayerNorm + Fp8Linear.

#include <ATen/ATen.h>
#include <torch/torch.h>

#include "bench/bench_util.h"
#include "ops/cuda/kernels.h"
#include "ops/layer_norm.h"
#include "plugin/fp8/fp8_autocast.h"
#include "plugin/modules/fp8_layer_norm.h"

int main(int argc, char** argv) {
  using namespace amp8;
  const std::string cmd = bench::command_line(argc, argv);
  torch::manual_seed(0);
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  const int64_t rows = 16384, hidden = 4096;
  const std::string shape = std::to_string(rows) + "x" + std::to_string(hidden);
  auto x = torch::randn({rows, hidden}, cuda.dtype(torch::kBFloat16)) * 2 + 0.5;
  auto dy = torch::randn({rows, hidden}, cuda.dtype(torch::kBFloat16));
  auto gamma = torch::rand({hidden}, cuda) + 0.5;
  auto beta = torch::randn({hidden}, cuda);
  auto gamma_bf16 = gamma.to(torch::kBFloat16), beta_bf16 = beta.to(torch::kBFloat16);
  const double elems = static_cast<double>(rows) * hidden;

  auto copy_dst = torch::empty_like(x);
  const double copy_ms = bench::median_ms([&] { copy_dst.copy_(x); });
  const double copy_gbps = 2 * 2 * elems / copy_ms / 1e6;
  auto fraction = [&](double bytes, double ms) { return bytes / ms / 1e6 / copy_gbps; };

  // What eager LibTorch does after a normalization to get its FP8 output: the amax, then scale +
  // saturate + cast (the baseline of the fused FP8 forwards below).
  auto eager_fp8_cast = [](const at::Tensor& y, const at::Tensor& scale, const at::Tensor& amax) {
    amax.copy_(y.abs().amax().to(at::kFloat).reshape({1}));
    return (y.to(at::kFloat) * scale).clamp(-448, 448).to(at::kFloat8_e4m3fn);
  };

  // Forward, bf16 → bf16: 2 B read + 2 B written per element.
  {
    const double ours = bench::median_ms([&] { layer_norm(x, gamma, beta, 1e-5); });
    const double aten =
        bench::median_ms([&] { at::native_layer_norm(x, {hidden}, gamma_bf16, beta_bf16, 1e-5); });
    bench::Record("layer_norm_fwd_bf16", shape, cmd)
        .timing(ours, "at::native_layer_norm (bf16)", aten)
        .set("gbps", 4 * elems / ours / 1e6)
        .set("fraction_of_copy", fraction(4 * elems, ours))
        .set("baseline_fraction_of_copy", fraction(4 * elems, aten))
        .set("copy_gbps", copy_gbps)
        .print();
  }
  // Forward, bf16 → E4M3 with amax: 2 B read + 1 B written.
  {
    auto scale = torch::full({1}, 16.0f, cuda);
    auto amax = torch::zeros({1}, cuda);
    const double ours = bench::median_ms(
        [&] { layer_norm_fp8(x, gamma, beta, 1e-5, scale, Fp8Format::kE4M3, amax); });
    // Eager LibTorch: LayerNorm, amax, then scale + saturate + cast.
    const double eager = bench::median_ms([&] {
      eager_fp8_cast(std::get<0>(at::native_layer_norm(x, {hidden}, gamma_bf16, beta_bf16, 1e-5)),
                     scale, amax);
    });
    bench::Record("layer_norm_fwd_fp8", shape, cmd)
        .timing(ours, "eager LibTorch: layer_norm + amax + scale/clamp/cast", eager)
        .set("gbps", 3 * elems / ours / 1e6)
        .set("fraction_of_copy", fraction(3 * elems, ours))
        .set("copy_gbps", copy_gbps)
        .print();
  }
  // RMSNorm (Llama's): forward bf16 → bf16 and → E4M3 with amax, and the backward, against
  // ATen's rms_norm (bf16, autograd for the backward) and eager LibTorch's casts.
  {
    const double ours = bench::median_ms([&] { rms_norm(x, gamma_bf16, 1e-5); });
    const double aten = bench::median_ms([&] { at::rms_norm(x, {hidden}, gamma_bf16, 1e-5); });
    bench::Record("rms_norm_fwd_bf16", shape, cmd)
        .timing(ours, "at::rms_norm (bf16)", aten)
        .set("gbps", 4 * elems / ours / 1e6)
        .set("fraction_of_copy", fraction(4 * elems, ours))
        .set("copy_gbps", copy_gbps)
        .print();
    auto scale = torch::full({1}, 16.0f, cuda);
    auto amax = torch::zeros({1}, cuda);
    const double ours_fp8 = bench::median_ms(
        [&] { rms_norm_fp8(x, gamma_bf16, 1e-5, scale, Fp8Format::kE4M3, amax); });
    const double eager_fp8 = bench::median_ms(
        [&] { eager_fp8_cast(at::rms_norm(x, {hidden}, gamma_bf16, 1e-5), scale, amax); });
    bench::Record("rms_norm_fwd_fp8", shape, cmd)
        .timing(ours_fp8, "eager LibTorch: rms_norm + amax + scale/clamp/cast", eager_fp8)
        .set("gbps", 3 * elems / ours_fp8 / 1e6)
        .set("fraction_of_copy", fraction(3 * elems, ours_fp8))
        .print();
    auto stats = rms_norm(x, gamma_bf16, 1e-5).stats;
    const double ours_bwd = bench::median_ms([&] { rms_norm_backward(dy, x, stats, gamma_bf16); });
    auto xg = x.detach().requires_grad_(true);
    auto gg = gamma_bf16.detach().requires_grad_(true);
    auto y = at::rms_norm(xg, {hidden}, gg, 1e-5);
    const double aten_bwd = bench::median_ms(
        [&] { torch::autograd::grad({y}, {xg, gg}, {dy}, /*retain_graph=*/true); });
    bench::Record("rms_norm_bwd_bf16", shape, cmd)
        .timing(ours_bwd, "at::rms_norm's autograd backward (bf16)", aten_bwd)
        .set("gbps", 6 * elems / ours_bwd / 1e6)
        .set("fraction_of_copy", fraction(6 * elems, ours_bwd))
        .print();
  }
  // Tuning sweep of the forward kernel's threads per row (the default is
  // cuda::kDefaultLayerNormThreads), bf16 and E4M3 output.
  for (int threads : {64, 128, 256, 512}) {
    auto mean = torch::empty({rows}, cuda), rstd = torch::empty({rows}, cuda);
    auto out_bf16 = torch::empty_like(x);
    auto out_fp8 = torch::empty({rows, hidden}, cuda.dtype(torch::kFloat8_e4m3fn));
    auto scale = torch::full({1}, 16.0f, cuda), scale_inv = torch::empty({1}, cuda);
    auto amax = torch::zeros({1}, cuda);
    auto stream = at::cuda::getCurrentCUDAStream().stream();
    for (int fp8 : {0, 1}) {
      const double ms = bench::median_ms([&] {
        cuda::launch_layer_norm_fwd(
            x.const_data_ptr(), cuda::InputType::kBFloat16, gamma.const_data_ptr<float>(),
            beta.const_data_ptr<float>(), cuda::InputType::kFloat, rows, hidden, 1e-5f,
            /*rms_norm=*/false, fp8 ? out_fp8.mutable_data_ptr() : out_bf16.mutable_data_ptr(), fp8,
            mean.mutable_data_ptr<float>(), rstd.mutable_data_ptr<float>(),
            scale.const_data_ptr<float>(), scale_inv.mutable_data_ptr<float>(),
            amax.mutable_data_ptr<float>(), false, stream, threads);
      });
      const double bytes = (fp8 ? 3 : 4) * elems;
      bench::Record(fp8 ? "layer_norm_fwd_fp8_threads" : "layer_norm_fwd_bf16_threads",
                    shape + " threads=" + std::to_string(threads), cmd)
          .set("ours_ms", ms)
          .set("fraction_of_copy", fraction(bytes, ms))
          .set("default_threads", static_cast<double>(cuda::kDefaultLayerNormThreads))
          .print();
    }
  }
  // Backward: dy and x read, dx written (6 B per element) plus dgamma/dbeta, at this shape and
  // at the GPT recipes' (350m: 8192 × 1024, 1b: 16384 × 2048); then the number of partial rows
  // (blocks) swept around the default (layer_norm_bwd_parts: at most one wave of resident
  // blocks, at least 16 rows each).
  for (const auto& [r, h] : std::vector<std::pair<int64_t, int64_t>>{
           {rows, hidden}, {8192, 1024}, {16384, 2048}}) {
    const std::string bshape = std::to_string(r) + "x" + std::to_string(h);
    auto bx = x.narrow(0, 0, r).narrow(1, 0, h).contiguous();
    auto bdy = dy.narrow(0, 0, r).narrow(1, 0, h).contiguous();
    auto bgamma = gamma.narrow(0, 0, h).contiguous(), bbeta = beta.narrow(0, 0, h).contiguous();
    auto bgamma_bf16 = bgamma.to(torch::kBFloat16), bbeta_bf16 = bbeta.to(torch::kBFloat16);
    auto stats = layer_norm(bx, bgamma, bbeta, 1e-5).stats;
    auto aten_fwd = at::native_layer_norm(bx, {h}, bgamma_bf16, bbeta_bf16, 1e-5);
    const double belems = static_cast<double>(r) * h;
    const double ours = bench::median_ms([&] { layer_norm_backward(bdy, bx, stats, bgamma, bbeta); });
    // gamma/beta in bf16, as a bf16 model holds them: read, and dgamma/dbeta written, as bf16.
    const double ours_bf16_params = bench::median_ms(
        [&] { layer_norm_backward(bdy, bx, stats, bgamma_bf16, bbeta_bf16); });
    const double aten = bench::median_ms([&] {
      at::native_layer_norm_backward(bdy, bx, {h}, std::get<1>(aten_fwd), std::get<2>(aten_fwd),
                                     bgamma_bf16, bbeta_bf16, {true, true, true});
    });
    // With a residual's gradient added inside (a pre-norm block's x + f(norm(x)); 8 B per
    // element) against the backward and autograd's separate add of the two gradients.
    auto bdres = torch::randn_like(bdy);
    const double with_residual = bench::median_ms(
        [&] { layer_norm_backward(bdy, bx, stats, bgamma_bf16, bbeta_bf16, bdres); });
    const double then_add = bench::median_ms([&] {
      auto grads = layer_norm_backward(bdy, bx, stats, bgamma_bf16, bbeta_bf16);
      grads.grad_input.add_(bdres);
    });
    bench::Record("layer_norm_bwd_bf16_residual", bshape, cmd)
        .timing(with_residual, "layer_norm_backward, then dx += dresidual", then_add)
        .set("fraction_of_copy", fraction(8 * belems, with_residual))
        .print();
    auto dx = torch::empty_like(bx);
    const int default_parts = cuda::layer_norm_bwd_parts(
        bdy.const_data_ptr(), bx.const_data_ptr(), /*dresidual=*/nullptr, dx.const_data_ptr(),
        bgamma.const_data_ptr<float>(), cuda::InputType::kBFloat16, cuda::InputType::kFloat, r, h,
        /*rms_norm=*/false);
    bench::Record("layer_norm_bwd_bf16", bshape, cmd)
        .timing(ours, "at::native_layer_norm_backward (bf16)", aten)
        .set("gbps", 6 * belems / ours / 1e6)
        .set("fraction_of_copy", fraction(6 * belems, ours))
        .set("baseline_fraction_of_copy", fraction(6 * belems, aten))
        .set("copy_gbps", copy_gbps)
        .set("parts", static_cast<double>(default_parts))
        .set("ours_bf16_params_ms", ours_bf16_params)
        .print();
    auto dgamma = torch::empty({h}, cuda), dbeta = torch::empty({h}, cuda);
    const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    for (int per_sm : {1, 2, 4, 8, 16}) {
      const int parts = sms * per_sm;
      auto part = torch::empty({2, parts, h}, cuda);
      const double ms = bench::median_ms([&] {
        cuda::launch_layer_norm_bwd(
            bdy.const_data_ptr(), bx.const_data_ptr(), cuda::InputType::kBFloat16,
            /*rms_norm=*/false, stats.mean.const_data_ptr<float>(), stats.rstd.const_data_ptr<float>(),
            bgamma.const_data_ptr<float>(), cuda::InputType::kFloat, r, h,
            /*dresidual=*/nullptr, dx.mutable_data_ptr(),
            part.mutable_data_ptr<float>(), parts, dgamma.mutable_data_ptr<float>(),
            dbeta.mutable_data_ptr<float>(), at::cuda::getCurrentCUDAStream().stream());
      });
      bench::Record("layer_norm_bwd_bf16_parts", bshape + " parts=" + std::to_string(parts), cmd)
          .set("ours_ms", ms)
          .set("fraction_of_copy", fraction(6 * belems, ms))
          .set("default_parts", static_cast<double>(default_parts))
          .print();
    }
  }
  // FP8 byte transpose: 1 B read + 1 B written.
  {
    auto q = quantize(x, torch::ones({1}, cuda), Fp8Format::kE4M3);
    const double ours = bench::median_ms([&] { fp8_transpose(q); });
    auto bytes = q.data.view(at::kByte);
    const double aten = bench::median_ms([&] { bytes.t().contiguous(); });
    bench::Record("fp8_transpose", shape, cmd)
        .timing(ours, "at::Tensor::t().contiguous() (uint8)", aten)
        .set("gbps", 2 * elems / ours / 1e6)
        .set("fraction_of_copy", fraction(2 * elems, ours))
        .set("copy_gbps", copy_gbps)
        .print();
  }
  // LayerNorm → Linear, forward + backward, at a transformer's MLP input (M, K, N).
  for (auto [m, k, n] :
       {std::tuple<int64_t, int64_t, int64_t>{16384, 4096, 14336}, {8192, 4096, 4096}}) {
    torch::nn::LayerNorm ref_ln(torch::nn::LayerNormOptions({k}));
    torch::nn::Linear ref_linear(k, n);
    Fp8LayerNormLinear fused(k, n);
    Fp8LayerNorm unfused_ln(std::vector<int64_t>{k});
    Fp8Linear unfused_linear(k, n);
    {
      torch::NoGradGuard no_grad;
      fused->linear->weight.copy_(ref_linear->weight);
      fused->linear->bias.copy_(ref_linear->bias);
      unfused_linear->weight.copy_(ref_linear->weight);
      unfused_linear->bias.copy_(ref_linear->bias);
    }
    for (torch::nn::Module* module : std::initializer_list<torch::nn::Module*>{
             ref_ln.get(), ref_linear.get(), fused.get(), unfused_ln.get(), unfused_linear.get()}) {
      module->to(torch::kCUDA);
    }
    auto in = torch::randn({m, k}, cuda.dtype(torch::kBFloat16)).requires_grad_(true);
    auto grad = torch::randn({m, n}, cuda.dtype(torch::kBFloat16));
    const double bf16 = bench::median_ms([&] {
      torch::Tensor y;
      {
        bench::Bf16Autocast autocast;
        y = ref_linear->forward(ref_ln->forward(in));
      }
      y.backward(grad);
    });
    const double ours = bench::median_ms([&] {
      torch::Tensor y;
      {
        bench::Bf16Autocast autocast;
        Fp8Autocast region;
        y = fused->forward(in);
      }
      y.backward(grad);
    });
    const double unfused = bench::median_ms([&] {
      torch::Tensor y;
      {
        bench::Bf16Autocast autocast;
        Fp8Autocast region;
        y = unfused_linear->forward(unfused_ln->forward(in));
      }
      y.backward(grad);
    });
    const std::string lshape =
        std::to_string(m) + "x" + std::to_string(k) + "x" + std::to_string(n);
    bench::Record("fp8_layer_norm_linear_fwd_bwd", lshape, cmd)
        .timing(ours, "torch::nn::LayerNorm + torch::nn::Linear under bf16 autocast", bf16)
        .set("unfused_fp8_ms", unfused)
        .set("speedup_vs_unfused_fp8", unfused / ours)
        .set("tflops", 3 * 2.0 * m * k * n / ours / 1e9)
        .print();
  }
  return 0;
}
