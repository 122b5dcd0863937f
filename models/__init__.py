"""Switch-, Mixtral- and DeepSeek-style decoder models (single-device code)."""
