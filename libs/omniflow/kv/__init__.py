"""KV-cache primitives shared by workers, agents, the index and the router."""
