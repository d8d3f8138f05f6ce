//! Fuzzes loading a safetensors file into the host store: any bytes give a store or an error
//! naming the file, never a panic.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = std::env::temp_dir().join(format!(
        "candle-offload-fuzz-{}.safetensors",
        std::process::id()
    ));
    if std::fs::write(&path, data).is_ok() {
        let cfg = candle_offload::StoreConfig {
            dtype: Some(candle_core::DType::F16),
            ..Default::default()
        };
        let _ =
            candle_offload::HostStore::from_safetensors(&[&path], &cfg, &candle_core::Device::Cpu);
    }
    // No input stays behind in the temp dir.
    let _ = std::fs::remove_file(&path);
});
