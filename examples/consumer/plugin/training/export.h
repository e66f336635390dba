#pragma once
// A trainer's own plugin/ folder, on its include path (CMakeLists.txt here), with a header of the
// same path as one of amp8's: amp8's installed headers must never reach it. They include each
// other as "amp8/plugin/...", and a trainer includes <amp8/amp8.h> or <amp8/plugin/...>.
#error "an amp8 header included the trainer's own plugin/training/export.h"
