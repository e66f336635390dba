#include "recipes/gpt/loss_plot.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>
#include <vector>

namespace amp8::recipes {
namespace {

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '<') out += "&lt;";
    else if (c == '>') out += "&gt;";
    else if (c == '&') out += "&amp;";
    else out += c;
  }
  return out;
}

// Tick values 1, 2 or 5 x 10^k apart covering [lo, hi], about `count` of them.
std::vector<double> nice_ticks(double lo, double hi, int count) {
  const double raw = (hi - lo) / count;
  const double magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  double step = magnitude;
  for (const double factor : {1.0, 2.0, 5.0, 10.0}) {
    step = factor * magnitude;
    if (raw <= step) break;
  }
  std::vector<double> ticks;
  for (double t = std::ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) {
    ticks.push_back(std::abs(t) < step * 1e-9 ? 0.0 : t);
  }
  return ticks;
}

// A tick label with as many decimals as the tick spacing needs (0.5 -> "0.5", 200 -> "200").
std::string tick_label(double value, double spacing) {
  const int decimals = std::max(0, static_cast<int>(std::ceil(-std::log10(spacing) - 1e-9)));
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.*f", decimals, value);
  return buf;
}

// An exponential moving average with TensorBoard's debiasing, over the finite points; the window
// is about a fiftieth of the curve, so noise is averaged away but the trend stays.
std::vector<std::pair<double, double>> smoothed(const std::vector<std::pair<double, double>>& points) {
  const double window = std::max(1.0, static_cast<double>(points.size()) / 50.0);
  const double keep = 1.0 - 2.0 / (window + 1.0);
  std::vector<std::pair<double, double>> out;
  double average = 0, weight = 0;
  for (const auto& [x, y] : points) {
    if (!std::isfinite(y)) continue;
    average = keep * average + (1 - keep) * y;
    weight = keep * weight + (1 - keep);
    out.emplace_back(x, average / weight);
  }
  return out;
}

}  // namespace

LossCurve relative_to(const LossCurve& curve, const LossCurve& reference, const std::string& name) {
  auto relative = [](const std::vector<std::pair<double, double>>& points,
                     const std::vector<std::pair<double, double>>& base) {
    const std::map<double, double> at(base.begin(), base.end());
    std::vector<std::pair<double, double>> out;
    for (const auto& [step, loss] : points) {
      const auto it = at.find(step);
      if (it != at.end() && it->second != 0) out.emplace_back(step, 100.0 * (loss - it->second) / it->second);
    }
    return out;
  };
  return {name, relative(curve.points, reference.points), relative(curve.validation, reference.validation)};
}

LossCurve read_loss_curve(const std::string& name, const std::string& metrics_path) {
  LossCurve curve{name, {}, {}};
  std::ifstream in(metrics_path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    const auto json = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!json.is_object() || !json.contains("step") || !json["step"].is_number() || !json.contains("loss")) continue;
    const auto step = json["step"].get<double>();
    curve.points.emplace_back(step, json["loss"].is_number() ? json["loss"].get<double>() : NAN);
    if (json.contains("val_loss") && json["val_loss"].is_number()) {
      curve.validation.emplace_back(step, json["val_loss"].get<double>());
    }
  }
  return curve;
}

void write_loss_svg(const std::string& path, const std::vector<LossCurve>& curves,
                    const std::string& title, const std::string& y_label) {
  // The legend goes under the plot, one line per curve, so no name is cut off.
  const double width = 820, left = 70, right = 30, top = 44, plot_h = 380;
  const double legend_top = top + plot_h + 52, line_h = 18;
  const double height = legend_top + line_h * static_cast<double>(curves.size()) + 12;
  const double plot_w = width - left - right;
  // Noisy curves (more than 100 points) are drawn faint, with their moving average on top.
  std::vector<std::vector<std::pair<double, double>>> trends;
  double x_min = std::numeric_limits<double>::infinity(), x_max = -x_min;
  std::vector<double> values;
  for (const auto& curve : curves) {
    for (const auto* points : {&curve.points, &curve.validation}) {
      for (const auto& [x, y] : *points) {
        if (!std::isfinite(y)) continue;
        x_min = std::min(x_min, x);
        x_max = std::max(x_max, x);
        values.push_back(y);
      }
    }
    trends.push_back(curve.points.size() > 100 ? smoothed(curve.points) : std::vector<std::pair<double, double>>{});
  }
  if (values.empty()) x_min = 0, x_max = 1, values = {0.0, 1.0};
  if (x_max == x_min) x_max = x_min + 1;
  // The y range: all values, except that the first steps (the first 5% of the x range, where
  // the loss falls fast and spikes) and any spike above the 98th percentile of the rest are cut
  // off at the top, with a note, instead of flattening the curve that matters.
  const double settled_x = x_min + 0.05 * (x_max - x_min);
  std::vector<double> settled;
  for (const auto& curve : curves) {
    for (const auto& [x, y] : curve.points) {
      if (std::isfinite(y) && x >= settled_x) settled.push_back(y);
    }
  }
  std::vector<double> validation_values;  // never cut off
  for (const auto& curve : curves) {
    for (const auto& [x, y] : curve.validation) {
      if (std::isfinite(y) && x >= settled_x) validation_values.push_back(y);
    }
  }
  std::sort(values.begin(), values.end());
  std::sort(settled.begin(), settled.end());
  double y_min = values.front();
  double y_max = settled.empty() ? values.back()
                                 : settled[static_cast<size_t>(0.98 * static_cast<double>(settled.size() - 1))];
  for (const auto& trend : trends) {
    for (const auto& [x, y] : trend) {
      if (x >= settled_x) y_max = std::max(y_max, y);
    }
  }
  for (const double v : validation_values) y_max = std::max(y_max, v);
  const bool clipped = y_max < values.back();
  if (!clipped) y_max = values.back();
  if (y_max == y_min) y_max = y_min + 1;
  const auto y_ticks = nice_ticks(y_min, y_max, 6);
  const auto x_ticks = nice_ticks(x_min, x_max, 8);
  const double y_spacing = y_ticks.size() > 1 ? y_ticks[1] - y_ticks[0] : (y_max - y_min);
  const double x_spacing = x_ticks.size() > 1 ? x_ticks[1] - x_ticks[0] : 1.0;
  // Widen the range to whole ticks.
  y_min = std::min(y_min, std::floor(y_min / y_spacing) * y_spacing);
  y_max = std::max(y_max, std::ceil(y_max / y_spacing - 1e-9) * y_spacing);
  auto sx = [&](double x) { return left + (x - x_min) / (x_max - x_min) * plot_w; };
  auto sy = [&](double y) { return top + (y_max - std::min(y, y_max)) / (y_max - y_min) * plot_h; };

  std::ostringstream svg;
  svg << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << height
      << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
      << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      << "<text x=\"" << left << "\" y=\"26\" font-size=\"15\">" << escape(title) << "</text>\n";
  for (double yv = y_min; yv <= y_max + y_spacing * 1e-6; yv += y_spacing) {
    svg << "<line x1=\"" << left << "\" x2=\"" << left + plot_w << "\" y1=\"" << sy(yv) << "\" y2=\""
        << sy(yv) << "\" stroke=\"#e5e5e5\"/>\n"
        << "<text x=\"" << left - 6 << "\" y=\"" << sy(yv) + 4 << "\" text-anchor=\"end\">"
        << tick_label(yv, y_spacing) << "</text>\n";
  }
  for (const double xv : x_ticks) {
    svg << "<text x=\"" << sx(xv) << "\" y=\"" << top + plot_h + 18 << "\" text-anchor=\"middle\">"
        << tick_label(xv, x_spacing) << "</text>\n";
  }
  svg << "<rect x=\"" << left << "\" y=\"" << top << "\" width=\"" << plot_w << "\" height=\"" << plot_h
      << "\" fill=\"none\" stroke=\"#333\"/>\n"
      << "<text x=\"" << left + plot_w / 2 << "\" y=\"" << top + plot_h + 38
      << "\" text-anchor=\"middle\">step</text>\n"
      << "<text x=\"16\" y=\"" << top + plot_h / 2 << "\" transform=\"rotate(-90 16 " << top + plot_h / 2
      << ")\" text-anchor=\"middle\">" << escape(y_label) << "</text>\n";
  if (clipped) {
    svg << "<text x=\"" << left + plot_w << "\" y=\"" << top - 6 << "\" text-anchor=\"end\" fill=\"#666\">"
        << "values above " << tick_label(y_max, y_spacing) << " (the first steps, spikes) cut off</text>\n";
  }
  // Matplotlib's ten "tab10" colours, so that up to ten curves are told apart.
  const char* colors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd",
                          "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};
  constexpr size_t kColors = sizeof(colors) / sizeof(colors[0]);
  auto polyline = [&](const std::vector<std::pair<double, double>>& points, const char* color, double stroke,
                      double opacity) {
    svg << "<polyline fill=\"none\" stroke=\"" << color << "\" stroke-width=\"" << stroke
        << "\" stroke-opacity=\"" << opacity << "\" points=\"";
    for (const auto& [x, y] : points) {
      if (std::isfinite(y)) svg << sx(x) << "," << sy(y) << " ";
    }
    svg << "\"/>\n";
  };
  for (size_t c = 0; c < curves.size(); ++c) {
    const char* color = colors[c % kColors];
    const bool noisy = !trends[c].empty();
    polyline(curves[c].points, color, noisy ? 0.8 : 1.5, noisy ? 0.25 : 1.0);
    if (noisy) polyline(trends[c], color, 2.0, 1.0);
    if (!curves[c].validation.empty()) {
      svg << "<polyline fill=\"none\" stroke=\"" << color << "\" stroke-width=\"1.5\" stroke-dasharray=\"5,3\" points=\"";
      for (const auto& [x, y] : curves[c].validation) {
        if (std::isfinite(y)) svg << sx(x) << "," << sy(y) << " ";
      }
      svg << "\"/>\n";
      for (const auto& [x, y] : curves[c].validation) {
        if (std::isfinite(y)) {
          svg << "<circle cx=\"" << sx(x) << "\" cy=\"" << sy(y) << "\" r=\"3.5\" fill=\"white\" stroke=\"" << color
              << "\" stroke-width=\"1.5\"/>\n";
        }
      }
    }
    const double ly = legend_top + line_h * static_cast<double>(c);
    svg << "<line x1=\"" << left << "\" x2=\"" << left + 20 << "\" y1=\"" << ly - 4 << "\" y2=\"" << ly - 4
        << "\" stroke=\"" << color << "\" stroke-width=\"2\"/>\n"
        << "<text x=\"" << left + 26 << "\" y=\"" << ly << "\">" << escape(curves[c].name)
        << (noisy ? " (faint: every step; bold: moving average)" : "")
        << (curves[c].validation.empty() ? "" : " (circles: validation)") << "</text>\n";
  }
  svg << "</svg>\n";

  const std::string temporary = path + ".tmp";
  {
    std::ofstream out(temporary, std::ios::trunc);
    TORCH_CHECK(out.good(), "cannot write the loss picture ", path);
    out << svg.str();
    out.close();
    TORCH_CHECK(out.good(), "cannot write the loss picture ", path);
  }
  TORCH_CHECK(std::rename(temporary.c_str(), path.c_str()) == 0, "cannot write the loss picture ",
              path, " (rename failed)");
}

}  // namespace amp8::recipes
