#pragma once

// amp8 in one include: `#include <amp8/amp8.h>` (installed package: include/ on the include
// path; this repository: its root). Every public header is also reachable by its own path under
// amp8/, e.g. <amp8/plugin/modules/fp8_linear.h>, so a trainer's own ops/, plugin/ or recipes/
// folders never shadow amp8's.

#include "ops/fp8_tensor.h"
#include "ops/quantize.h"
#include "plugin/distributed/process_group.h"
#include "plugin/fp8/fp8_autocast.h"
#include "plugin/fp8/fp8_recipe.h"
#include "plugin/modules/convert_module.h"
#include "plugin/modules/fp8_layer_norm.h"
#include "plugin/modules/fp8_linear.h"
#include "plugin/modules/recompute.h"
#include "plugin/precision/mixed_precision_plugin.h"
#include "plugin/training/export.h"
#include "plugin/training/trainer.h"
#include "recipes/precision.h"
