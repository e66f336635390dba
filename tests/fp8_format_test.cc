#include "ops/fp8_format.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "ops/fp8_tensor.h"
#include "tests/test_util.h"

namespace amp8 {
namespace {

using ::testing::HasSubstr;

TEST(Fp8FormatTest, MaxValuesAndDtypes) {
  EXPECT_EQ(fp8_max(Fp8Format::kE4M3), 448.0f);
  EXPECT_EQ(fp8_max(Fp8Format::kE5M2), 57344.0f);
  EXPECT_EQ(fp8_dtype(Fp8Format::kE4M3), at::kFloat8_e4m3fn);
  EXPECT_EQ(fp8_dtype(Fp8Format::kE5M2), at::kFloat8_e5m2);
  // The max values are the dtypes' own largest finite values.
  EXPECT_EQ(at::tensor({448.0f}).to(at::kFloat8_e4m3fn).to(at::kFloat).item<float>(), 448.0f);
  EXPECT_EQ(at::tensor({57344.0f}).to(at::kFloat8_e5m2).to(at::kFloat).item<float>(), 57344.0f);
}

TEST(Fp8FormatTest, ParsesNamesCaseInsensitively) {
  EXPECT_EQ(fp8_format_from_string("e4m3"), Fp8Format::kE4M3);
  EXPECT_EQ(fp8_format_from_string("E5M2"), Fp8Format::kE5M2);
  EXPECT_STREQ(fp8_format_name(Fp8Format::kE5M2), "e5m2");
  EXPECT_EQ(fp8_format_of(at::kFloat8_e5m2), Fp8Format::kE5M2);
}

TEST(Fp8FormatTest, UnknownNamesNameTheParameterAndTheAcceptedValues) {
  try {
    fp8_format_from_string("e5m3", "grad_format");
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(),
                HasSubstr("grad_format must be \"e4m3\" or \"e5m2\", got \"e5m3\""));
  }
  EXPECT_THROW(fp8_format_from_string(""), c10::Error);
  try {
    fp8_format_of(at::kBFloat16);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(),
                HasSubstr("Float8_e4m3fn or Float8_e5m2, got BFloat16"));
  }
}

TEST(Fp8TensorTest, DequantizeMultipliesByScaleInv) {
  auto data = at::tensor({1.0f, -2.0f, 448.0f, 0.015625f}).to(at::kFloat8_e4m3fn);
  Fp8Tensor t(data, at::tensor({0.25f}), Fp8Format::kE4M3);
  auto x = t.dequantize();
  EXPECT_EQ(x.scalar_type(), at::kFloat);
  EXPECT_TRUE(testing::BytesEqual(x, at::tensor({0.25f, -0.5f, 112.0f, 0.00390625f})));
  EXPECT_EQ(t.dequantize(at::kBFloat16).scalar_type(), at::kBFloat16);
}

TEST(Fp8TensorTest, RejectsInconsistentParts) {
  auto data = at::zeros({4}, at::kFloat8_e4m3fn);
  try {
    Fp8Tensor(data, at::ones({1}), Fp8Format::kE5M2);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(),
                HasSubstr("data must be Float8_e5m2 for format e5m2, got Float8_e4m3fn"));
  }
  EXPECT_THROW(Fp8Tensor(data, at::ones({2}), Fp8Format::kE4M3), c10::Error);
  EXPECT_THROW(Fp8Tensor(data, at::ones({1}, at::kDouble), Fp8Format::kE4M3), c10::Error);
  EXPECT_THROW(Fp8Tensor().dequantize(), c10::Error);
}

}  // namespace
}  // namespace amp8
