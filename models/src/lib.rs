//! LLaMA-family models (Llama 2/3, Mistral, Qwen2, SmolLM) on the candle-offload runtime.
