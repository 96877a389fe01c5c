"""The SGLang client: server processes, the fleet, generation calls, and the weight push into SGLang."""
