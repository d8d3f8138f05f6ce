// The tiles of the flash-attention kernels (flash.cu, flash_f32.cu).
#pragma once

namespace {

constexpr int FA_BM = 64;        // query rows per tile
constexpr int FA_BN = 64;        // keys per tile

}  // namespace
