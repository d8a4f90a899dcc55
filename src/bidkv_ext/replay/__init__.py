"""Trace replay: real request traces through the real vLLM scheduler, per victim policy.

Entry point: the ``bidkv-replay`` console script (:mod:`bidkv_ext.replay.cli`). Importing
this package does not import vLLM; :mod:`bidkv_ext.replay.engine` does, when it runs.
"""
