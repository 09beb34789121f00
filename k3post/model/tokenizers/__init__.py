"""Teachers of another tokenizer: text ↔ tokens across vocabularies.

`token_text.py` maps token ids to the bytes they decode to; `corpus.py` is the text a
transplant is fitted on; `transplant.py` builds a student head over a donor tokenizer
(`transplant_head.py` the head itself). May import: `loading/`, `config`; `loading/load.py`
imports `transplant.py` back (the one intended circle).
"""
