"""The count records' earlier home: they are calibrate.terms' now (a module that imports no torch), named here
for code that took them from here."""

from calibrate.data.segments import SEGMENTS  # noqa: F401
from calibrate.terms import UNSEGMENTED, RequestOutcome, SegmentCounts, StepCounts, TotalCounts  # noqa: F401
