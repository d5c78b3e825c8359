"""Data parallelism over dp×cp (experts over edp): gradient reduction overlapped with backward,
ZeRO stages 0–3, global grad-norm clipping and AdamW. See reducer.py for the order of operations,
buckets.py for the flat buffers and their overlapped reduction, zero3.py for parameter sharding."""
from .buckets import Bucket, is_expert
from .reducer import GradReducer

__all__ = ["Bucket", "GradReducer", "is_expert"]
