"""Corpora for pretraining: documents (sources.py) -> tokenizer workers (prepare.py) -> token shards on disk
(shards.py, foreign_shards.py, the shared cache corpus_cache.py) -> windows mixed into step-keyed batches
(mixture.py, datasets.py) behind the grain loader (loader.py), which fine-tuning's packed rows use too.

Empty on purpose: the tokenizer worker processes import jaxlm.data.corpora.prepare, and an import of JAX or grain
here would cost each of them seconds and hundreds of MB.
"""
