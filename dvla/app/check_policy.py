"""``dvla check-policy``: whether a policy keeps dvla's contract (:mod:`dvla.contract`), check
by check."""

from __future__ import annotations

import sys

from dvla.contract import check_policy
from dvla.policy import PolicySpec


def main(argv: list[str], prog: str = "dvla check-policy") -> int:
    """``dvla check-policy``: the checks on ``policy.name`` (``--import`` is taken by
    :mod:`dvla.app.cli`), one line each; exit 0 when all pass, 1 when one fails, 2 for a mistake
    in the command line."""
    import argparse

    from dvla.config import ConfigError, apply_overrides, load_yaml
    from dvla.envs import env_spec
    from dvla.policy import policy_config
    from dvla.config.presets import get_preset

    ap = argparse.ArgumentParser(prog=prog, description=(
        "Check that a policy keeps dvla's contract, in the modes dvla runs it in (eval mode; bf16 replicas), "
        "one line per check, each failure with what to do. The policy acts in the env of --preset (its "
        "observation and action shapes; env.* and policy.action_chunk=K change them)."))
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                    help="policy.name=NAME, policy.options.KEY=VALUE, policy.action_chunk=K, env.KEY=VALUE")
    ap.add_argument("--preset", default="debug", help="the preset to start from (default: %(default)s)")
    ap.add_argument("--config", metavar="FILE.yaml", help="YAML file applied on top of the preset")
    ap.add_argument("--device", default="cpu", help="where the policy runs (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=4, help="observations per batch, >= 2 (default: %(default)s)")
    ap.add_argument("--entropy-samples", type=int, default=256, metavar="N",
                    help="samples per observation that check entropy() (0: skip that part; default: %(default)s)")
    args = ap.parse_intermixed_args(argv)
    try:
        bad = [a for a in args.overrides if "=" not in a]
        if bad:
            raise ConfigError(f"unrecognised argument(s) {' '.join(bad)}: overrides look like policy.name=NAME")
        if args.batch < 2:
            raise ConfigError(f"--batch must be >= 2, got {args.batch}")
        cfg = get_preset(args.preset)
        cfg = apply_overrides(load_yaml(cfg, args.config) if args.config else cfg, args.overrides)
        policy_config(cfg.policy.name, cfg.policy.options)
        spec = PolicySpec.for_env(env_spec(cfg.env), cfg.policy.action_chunk)
    except ConfigError as exc:
        print(f"{prog}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    print(f"{prog}: {' '.join(map(str, filter(None, (cfg.policy.name, cfg.policy.options))))} on {cfg.env.name}'s "
          f"shapes: image "
          f"{spec.image_shape}, proprio {spec.proprio_dim}, actions {spec.action_chunk} x {spec.action_dim}", flush=True)
    report = check_policy(cfg.policy.name, spec, cfg.policy.options, batch=args.batch, device=args.device,
                          entropy_samples=args.entropy_samples)
    for r in report.results:
        print(f"  {r.line()}")
    print(report.summary())
    return 0 if report.ok else 1
