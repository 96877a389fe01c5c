"""Test scaffolding, not a kernel library: SGLang's CPU path imports `sgl_kernel` at load, and the
package index has no CPU build of it (the CUDA one fails to import without libcuda). A text model
on the torch-native attention backend calls one of its functions, written here in torch; every
other name imports and fails if it is ever called, naming itself."""

from __future__ import annotations


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                 pool_len):
    # Request i's slots start[i]..end[i] take the next end[i] - start[i] entries of out_cache_loc,
    # in request order (what SGLang's Triton kernel of the same name writes).
    del pool_len
    taken = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True):
        n = end - start
        req_to_token[row, start:end] = out_cache_loc[taken:taken + n].to(req_to_token.dtype)
        taken += n


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} is not in the CPU test shim (scripts/sglang_cpu/shims)")

    missing.__name__ = name
    return missing
