"""Loading: a recipe's model spec becomes a model and its tokenizer.

`load.py` is the one entry (`load_model`): an HF directory, the builtin SmolLM2 GGUF (converted
once and cached), a tiny random model (`tiny.py`), a layer-pruned student (`prune.py`), a Kimi
Linear student (`kimi.py`) or a reward classifier (`classifier.py`); `checks.py` reads a few
kilobytes of a directory first and names the damaged file. May import: `generation/` (for the
model's own generation-config processors), `model/families.py`, `config`; and the transplant of
`tokenizers/` (the one intended circle).
"""
