"""Hugging Face interop: `config.json` to ModelConfig (`config`, torch-free), weights in and out of any layout
(`weights`, `init`, `export`), one module per family whose mapping is not the Llama one (`gpt_oss`,
`qwen3_next`, `multimodal`, `mxfp4`), and the `hf-*` commands (`cli`)."""
