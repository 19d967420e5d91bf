"""The policy contract: what dvla needs of a :class:`~dvla.policy.VLAPolicy`, checked in the
modes dvla runs it in (:mod:`dvla.contract.runner` runs the checks of
:mod:`dvla.contract.checks` and reports; ``dvla check-policy`` is its command)."""

from dvla.contract.checks import BATCH_TOLERANCE, BF16_TOLERANCE, DEFAULT_SPEC, LOGP_TOLERANCE, make_obs
from dvla.contract.runner import CheckResult, Report, assert_policy_contract, check_policy

__all__ = ["check_policy", "assert_policy_contract", "Report", "CheckResult", "DEFAULT_SPEC", "BF16_TOLERANCE",
           "BATCH_TOLERANCE", "LOGP_TOLERANCE", "make_obs"]
