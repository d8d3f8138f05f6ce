// A marker kernel for profilers (`candle_offload_kernels::profile_mark`).
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

// An empty kernel whose only effect is its launch: a profiler's list of kernels (ncu, in
// launch order) shows it where a program marks a boundary (diag::profile_mark), the phase in
// its argument.
extern "C" __global__ void profile_mark(uint32_t phase) { (void)phase; }
