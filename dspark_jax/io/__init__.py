"""Everything that reads or writes weights: safetensors files, Hugging Face checkpoints through
declarative key tables, the DeepSpec reference layout, and our one drafter-directory format."""
