//! The one integration-test binary (each test binary links Candle again, so there is one).
//! Numeric tests are written once as `fn(&Device)` and run per device by `test_device!`; the
//! CUDA variants exist in `--features cuda` builds and run on the GPU machine.

#[macro_use]
mod util;

mod bad_input;
mod batching;
#[cfg(feature = "cuda")]
mod cuda;
mod dist;
mod gguf_families;
mod lora;
mod models;
mod moe_families;
mod nccl;
mod ops;
mod own_model;
mod quantize;
mod quantized;
mod runtime;
mod server;
mod sharding;
mod store;
mod tiers;
mod tokenizers;
mod train;
mod train_ops;
