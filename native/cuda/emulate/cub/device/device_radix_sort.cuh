// The emulated build's <cub/device/device_radix_sort.cuh>: native/cuda/emulate/cub_emulated.h.
#include "../../cub_emulated.h"
