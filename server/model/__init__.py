"""Llama-family forward pass (Llama, Mistral, Qwen2) and safetensors loading."""
