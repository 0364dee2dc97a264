"""The embed role: a sentence-embedding model (BERT encoder + pooling) behind ``Invoke``."""
