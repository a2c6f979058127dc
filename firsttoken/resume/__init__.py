"""The resume buffer: every event of a stream, kept for readers that come back."""

from firsttoken.resume.memory import Event, EventLog, ResumeExpired

__all__ = ["Event", "EventLog", "ResumeExpired"]
