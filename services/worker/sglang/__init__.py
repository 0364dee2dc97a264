"""SGLang as the llm engine of a worker: the backend, its HiCache storage, page keys and the
blocking page transport to the node's kv-agent."""
