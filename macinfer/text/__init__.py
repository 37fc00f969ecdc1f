"""Tokens <-> text: tokenizers and incremental detokenizing, chat templates, tool-call and
reasoning parsers. Imports no other package of macinfer's."""
