"""The llm-role interface every llm engine of the worker implements: the request and output
types (``types``), the model folder's config and tokenizer (``model_folder``), the role the
edge serves (``role.LLMRole``), what out-of-process engines share (``backends``) and the
KV connector protocol with its implementations (``connector``).

It re-exports nothing: importing one of its modules loads no engine and no torch."""
