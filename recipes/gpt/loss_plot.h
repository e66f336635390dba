#pragma once

#include <string>
#include <utility>
#include <vector>

namespace amp8::recipes {

/// One curve of a loss plot: (step, loss) points, and (step, validation loss) points if any.
struct LossCurve {
  std::string name;
  std::vector<std::pair<double, double>> points;
  std::vector<std::pair<double, double>> validation;
};

/// The training and validation curves of a metrics file (metrics.jsonl: one JSON line per step
/// with "step" and "loss", and "val_loss" at the evaluations), named `name`; lines that are not
/// such JSON are passed over, and a file that cannot be read gives an empty curve.
LossCurve read_loss_curve(const std::string& name, const std::string& metrics_path);

/// `curve` against `reference`, step by step: 100 · (loss − reference's) / reference's at every
/// step (and every validation step) both have, named `name`; steps the reference lacks, and a
/// reference of zero, are left out. Two runs on the same batches (same seed and data) differ
/// step by step far less than either's loss varies from batch to batch, so this is the curve
/// to read a precision's cost from.
LossCurve relative_to(const LossCurve& curve, const LossCurve& reference, const std::string& name);

/// Writes the curves into one SVG picture, atomically (temporary file + rename): steps on x,
/// `y_label` (the loss, by default) on y, both with rounded ticks (1, 2 or 5 x 10^k apart); the legend under the plot, one
/// full line per curve. A curve of more than 100 points is drawn faint, every step, with its
/// moving average (an EMA over about a fiftieth of the curve, debiased as TensorBoard does) on
/// top. The y range ends at the 98th percentile of the values after the first 5% of the steps
/// (or the highest moving average there), so the first steps and spikes are cut off, with a
/// note, instead of flattening the curve.
/// Validation points are circles joined by a dashed line in the curve's colour. Non-finite
/// losses are left out of the lines. Throws naming the path when it cannot be written.
void write_loss_svg(const std::string& path, const std::vector<LossCurve>& curves,
                    const std::string& title, const std::string& y_label = "loss");

}  // namespace amp8::recipes
