#include "recipes/gpt/loss_plot.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <sstream>

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

std::string number(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.4g", v);
  return buf;
}

}  // namespace

void write_loss_svg(const std::string& path, const std::vector<LossCurve>& curves,
                    const std::string& title) {
  const double width = 800, height = 480, left = 70, right = 180, top = 40, bottom = 50;
  const double plot_w = width - left - right, plot_h = height - top - bottom;
  double x_min = std::numeric_limits<double>::infinity(), x_max = -x_min;
  double y_min = x_min, y_max = -x_min;
  for (const auto& curve : curves) {
    for (const auto& [x, y] : curve.points) {
      if (!std::isfinite(y)) continue;
      x_min = std::min(x_min, x);
      x_max = std::max(x_max, x);
      y_min = std::min(y_min, y);
      y_max = std::max(y_max, y);
    }
  }
  if (!std::isfinite(x_min)) x_min = 0, x_max = 1, y_min = 0, y_max = 1;
  if (x_max == x_min) x_max = x_min + 1;
  if (y_max == y_min) y_max = y_min + 1;
  const double y_pad = 0.05 * (y_max - y_min);
  y_min -= y_pad;
  y_max += y_pad;
  auto sx = [&](double x) { return left + (x - x_min) / (x_max - x_min) * plot_w; };
  auto sy = [&](double y) { return top + (y_max - y) / (y_max - y_min) * plot_h; };

  std::ostringstream svg;
  svg << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << height
      << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
      << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      << "<text x=\"" << left << "\" y=\"24\" font-size=\"15\">" << escape(title) << "</text>\n";
  for (int i = 0; i <= 5; ++i) {
    const double yv = y_min + (y_max - y_min) * i / 5.0, xv = x_min + (x_max - x_min) * i / 5.0;
    svg << "<line x1=\"" << left << "\" x2=\"" << left + plot_w << "\" y1=\"" << sy(yv)
        << "\" y2=\"" << sy(yv) << "\" stroke=\"#e5e5e5\"/>\n"
        << "<text x=\"" << left - 6 << "\" y=\"" << sy(yv) + 4 << "\" text-anchor=\"end\">"
        << number(yv) << "</text>\n"
        << "<text x=\"" << sx(xv) << "\" y=\"" << top + plot_h + 18
        << "\" text-anchor=\"middle\">" << number(std::round(xv)) << "</text>\n";
  }
  svg << "<rect x=\"" << left << "\" y=\"" << top << "\" width=\"" << plot_w << "\" height=\""
      << plot_h << "\" fill=\"none\" stroke=\"#333\"/>\n"
      << "<text x=\"" << left + plot_w / 2 << "\" y=\"" << height - 10
      << "\" text-anchor=\"middle\">step</text>\n"
      << "<text x=\"16\" y=\"" << top + plot_h / 2 << "\" transform=\"rotate(-90 16 "
      << top + plot_h / 2 << ")\" text-anchor=\"middle\">loss</text>\n";
  const char* colors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"};
  for (size_t c = 0; c < curves.size(); ++c) {
    const char* color = colors[c % 6];
    svg << "<polyline fill=\"none\" stroke=\"" << color << "\" stroke-width=\"1.5\" points=\"";
    for (const auto& [x, y] : curves[c].points) {
      if (std::isfinite(y)) svg << sx(x) << "," << sy(y) << " ";
    }
    svg << "\"/>\n";
    const double ly = top + 16 + 18.0 * static_cast<double>(c);
    svg << "<line x1=\"" << left + plot_w + 12 << "\" x2=\"" << left + plot_w + 32 << "\" y1=\""
        << ly - 4 << "\" y2=\"" << ly - 4 << "\" stroke=\"" << color << "\" stroke-width=\"2\"/>\n"
        << "<text x=\"" << left + plot_w + 38 << "\" y=\"" << ly << "\">" << escape(curves[c].name)
        << "</text>\n";
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
