"""The swimlane's lanes, one class per file, each built from its dependencies and the
channels that join it to the others."""

from swimlane.lanes.inference import InferenceLane
from swimlane.lanes.learner import LearnerConfig, LearnerLane, Update
from swimlane.lanes.messages import Reply, Request
from swimlane.lanes.publish import PublishLane, ReceiveLane, SnapshotSlot
from swimlane.lanes.sampling import SamplingConfig, SamplingLane

__all__ = ["InferenceLane", "LearnerConfig", "LearnerLane", "Update", "PublishLane", "ReceiveLane", "Reply", "Request", "SamplingConfig", "SamplingLane",
           "SnapshotSlot"]
