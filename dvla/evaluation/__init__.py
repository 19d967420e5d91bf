"""Scoring trained policies on fixed initial states (:mod:`dvla.evaluation.score`), with the
statistics that make two numbers comparable (:mod:`dvla.evaluation.stats`: Wilson intervals,
the two-proportion test, provenance). ``dvla eval`` is its command."""

from dvla.evaluation.score import EvalSetup, evaluate, evaluate_env, evaluate_libero, load_policy

__all__ = ["EvalSetup", "evaluate", "evaluate_env", "evaluate_libero", "load_policy"]
