"""The swimlane's lanes, one class per lane (the broadcast lane has an end per role), each
built from its dependencies and the channels that join it to the others; beside them what
they pass and share: channels, chunks, weights, admission, snapshots, the chunk checks,
streams."""

from swimlane.lanes.broadcast import BroadcastReceiver, BroadcastSource, SnapshotSlot
from swimlane.lanes.gradient import GradientConfig, GradientLane, Update
from swimlane.lanes.inference import InferenceLane
from swimlane.lanes.messages import Reply, Request
from swimlane.lanes.sampling import SamplingConfig, SamplingLane

__all__ = ["BroadcastReceiver", "BroadcastSource", "GradientConfig", "GradientLane", "InferenceLane", "Reply",
           "Request", "SamplingConfig", "SamplingLane", "SnapshotSlot", "Update"]
