"""The teacher side of CSD: the signal a teacher provides per row (:mod:`.signal`)."""

from crosskd.teacher.signal import SignalError, TeacherSignal, signal_from_logits, top_k_ids

__all__ = ["SignalError", "TeacherSignal", "signal_from_logits", "top_k_ids"]
