"""Hugging Face interop: import Llama, Mistral, Qwen2 and Qwen3 checkpoints onto any mesh, export decoders back.

- `tensor_files`: safetensors files, read a slice at a time and written a tensor at a time;
- `architectures`: one tensor table per architecture, and the config translation both ways;
- `importing`: `import_hf` (a params export) and `HFCheckpoint.read_params` (arrays on a mesh);
- `exporting`: `export_hf` (from a checkpoint) and `write_hf` (from params).
"""
