"""The GGUF format: the container (`file`), llama.cpp's architectures (`arch`, `hybrid`), its
tokenizer (`tokenizer`) and the loader that turns a file into a model (`load`). Imports text, models."""
