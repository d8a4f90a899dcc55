"""A compatible implementation of the vLLM-HUST extension manager (``vllm-hust-ext``).

The import name deliberately differs from the official ``vllm_hust_ext`` so this package
never shadows the official manager when both are installed.
"""

__version__ = "0.1.0"
