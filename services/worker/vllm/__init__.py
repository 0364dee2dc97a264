"""The llm role on vLLM (``OMNIFLOW_WORKER_ENGINE=vllm``) and its Omni-Flow KV connector.

Nothing here imports vLLM at package import: ``backend`` imports it when the engine is
loaded, ``connector`` is imported by vLLM itself (``kv_connector_module_path``).
"""
