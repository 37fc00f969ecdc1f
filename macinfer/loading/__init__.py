"""Model references in: files, directories, the Hugging Face Hub and cache; weights converted
for this device; embedding pooling; memory given back. Imports gguf, text, models and kernels."""
