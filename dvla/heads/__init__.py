"""Action heads that sample through a longer process and record it as rollout extras:
:mod:`dvla.heads.flow` (a flow-matching head with an exact log-prob) and
:mod:`dvla.heads.tokens` (action tokens on a language model's vocabulary)."""
