//! Reader for safetensors files.
