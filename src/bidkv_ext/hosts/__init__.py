"""Host adapters: make a real serving engine call a ``vllm.preemption-policy.v1`` policy.

:mod:`bidkv_ext.hosts.vllm` adapts stock vLLM 0.33.0 (CPU or GPU) by rewriting its
scheduler's victim choice; a vLLM-HUST host needs no adapter.
"""
