//! Fuzzes the config.json parser: any bytes give a config or an error naming the file, never a panic.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ =
            candle_offload_models::Config::from_json_str(text, std::path::Path::new("config.json"));
    }
});
