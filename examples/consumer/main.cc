#include <ATen/ATen.h>

#include <cstdio>

#include <amp8/ops/quantize.h>  // include/amp8/ops/quantize.h of the installed package

int main() {
  auto x = at::tensor({1.0f, -300.0f, 1000.0f});
  auto q = amp8::quantize(x, at::ones({1}), amp8::Fp8Format::kE4M3);
  auto back = q.dequantize();
  std::printf("consumer: %g %g %g\n", back[0].item<float>(), back[1].item<float>(),
              back[2].item<float>());
  // Saturation at 448 is what makes this line true.
  return back[2].item<float>() == 448.0f ? 0 : 1;
}
