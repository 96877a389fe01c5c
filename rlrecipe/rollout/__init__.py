"""Rollout engines behind one interface: in-process (torch/transformers) and SGLang."""
