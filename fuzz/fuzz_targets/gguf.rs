//! Fuzzes reading a GGUF file's metadata into a model description: never a panic.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path =
        std::env::temp_dir().join(format!("candle-offload-fuzz-{}.gguf", std::process::id()));
    if std::fs::write(&path, data).is_ok() {
        if let Ok(files) = candle_offload_models::loader::from_gguf(&path) {
            let _ = candle_offload_models::loader::load_tokenizer(&files);
        }
    }
    // No input stays behind in the temp dir.
    let _ = std::fs::remove_file(&path);
});
