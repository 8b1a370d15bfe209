"""Data preparation: reading rows with durable sample ids (:mod:`~crosskd.data.records`),
clipping over-long texts for every model at once (:mod:`~crosskd.data.clipping`) and lockstep
packing (:mod:`~crosskd.data.packing`)."""

from crosskd.data.clipping import ClipResult, clip_text, clip_texts
from crosskd.data.packing import pack_lockstep, packed_positions, packing_efficiency, segment_ids
from crosskd.data.records import Record, read_records

__all__ = [
    "ClipResult",
    "Record",
    "clip_text",
    "clip_texts",
    "pack_lockstep",
    "packed_positions",
    "packing_efficiency",
    "read_records",
    "segment_ids",
]
