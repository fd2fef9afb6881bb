// The emulated build's <cub/device/device_scan.cuh>: native/cuda/emulate/cub_emulated.h.
#include "../../cub_emulated.h"
