"""Rollouts: a policy replica stepping a batched env, recorded as :class:`~dvla.types.RolloutBatch`.

* :mod:`dvla.rollout.collect`: batches of whole episodes, and the episode statistics;
* :mod:`dvla.rollout.episodes`: every env on its own clock (``swimlane.independent_envs``);
* :mod:`dvla.rollout.segments`: PPO's segments of consecutive decisions.
"""

from dvla.rollout.collect import (
    EPISODE_TOTALS,
    PER_EPISODE,
    EpisodeRecorder,
    RolloutTimes,
    cameras_of,
    collect_episodes,
    episode_means,
    episode_stats,
    episode_totals,
    evaluate,
)

__all__ = ["EPISODE_TOTALS", "PER_EPISODE", "EpisodeRecorder", "RolloutTimes", "cameras_of", "collect_episodes",
           "episode_means", "episode_stats", "episode_totals", "evaluate"]
