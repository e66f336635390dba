#pragma once

#include <string>
#include <utility>
#include <vector>

namespace amp8::recipes {

/// One curve of a loss plot: (step, loss) points.
struct LossCurve {
  std::string name;
  std::vector<std::pair<double, double>> points;
};

/// Writes the curves into one SVG picture (steps on x, loss on y, a legend), atomically
/// (temporary file + rename). Non-finite losses are left out of the line. Throws naming the
/// path when it cannot be written.
void write_loss_svg(const std::string& path, const std::vector<LossCurve>& curves,
                    const std::string& title);

}  // namespace amp8::recipes
