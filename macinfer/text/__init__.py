"""Tokens <-> text: tokenizers and incremental detokenizing, chat templates, tool-call and
reasoning parsers. Imports gguf (a GGUF file's own tokenizer)."""
