//! Fuzzes the settings-file (config.yaml) parser: a setting or an error naming the file or
//! field, never a panic.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = candle_offload::Settings::from_yaml(text, std::path::Path::new("config.yaml"));
    }
});
