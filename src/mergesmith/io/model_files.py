"""The small files of a Hugging Face model directory beside its weights, named once.

Several layers need the same names: the planners copy a tokenizer into the output, the LoRA cache
writes a complete model folder, the Hub download fetches exactly these besides one weight format.
One list keeps them from drifting apart (a tokenizer file one of them forgot would be silently
missing from a merged model).
"""

from __future__ import annotations

CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "spiece.model",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
