//! Fuzzes budget parsing and resolution: never a panic.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(limit) = candle_offload::MemoryLimit::parse("--gpu-memory-limit", text) {
            let _ = limit.resolve("cuda:0", Some(16 << 30));
            let _ = limit.resolve("cpu", None);
        }
    }
});
