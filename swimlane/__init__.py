"""The four-lane asynchronous pipeline: sampling, inference, gradient, broadcast."""

from swimlane.assembly.lifecycle import LaneError, Swimlane
from swimlane.observation.trace import Tracer, draw_gantt, load_trace, utilization

__all__ = ["LaneError", "Swimlane", "Tracer", "draw_gantt", "load_trace", "utilization"]
