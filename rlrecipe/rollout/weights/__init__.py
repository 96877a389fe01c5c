"""How weights reach a rollout engine, and the checks that it serves them (any SGLang-API server)."""
