"""The text side: the tokenizer and chat template (``tokenizer``, with ``spm_vocab`` for GGUF
SentencePiece vocabularies), detectors of volatile values (``volatile``, shared by ``hotprefix lint``
and the miss diagnosis), the miss diagnosis in words (``diagnose``) and small sequence helpers
(``common``). Importing this package imports none of its modules (the cache imports ``common``
without pulling in ``transformers``)."""
