"""Release qualification for the BidKV bundle: paired A/B arms, gates, verdicts, records.

Run from the repository root as ``python -m qualification run PROFILE`` or
``python -m qualification release-check``; see ``qualification/README.md``.
"""

RECORD_SCHEMA = "vllm-hust-bidkv.qualification-record/1"

__all__ = ["RECORD_SCHEMA"]
