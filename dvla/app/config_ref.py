"""``dvla config-ref``: the configuration reference (:mod:`dvla.config.reference`), printed or
written into its page."""

from __future__ import annotations

from dvla.config import reference as ref


def env_option_rows() -> list[tuple[str, str, str]]:
    """A row per declared option of every env dvla ships (:mod:`dvla.envs.options`)."""
    from dvla.envs.fast import FastReachEnv
    from dvla.envs.genesis_env import GenesisFrankaEnv
    from dvla.envs.gym_adapter import GymVectorEnv
    from dvla.envs.libero_env import LiberoEnv
    from dvla.envs.options import reference_rows

    return reference_rows({"fast_reach": FastReachEnv.OPTIONS, "genesis_*": GenesisFrankaEnv.OPTIONS,
                           "gym": GymVectorEnv.OPTIONS, "libero": LiberoEnv.OPTIONS})


def full_reference() -> str:
    """The config's fields, then the envs' options."""
    return ref.reference(env_option_rows())


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="dvla config-ref", description="Print the configuration reference "
                                "(Markdown), generated from the config dataclasses and the envs' declared options.")
    p.add_argument("--write", metavar="FILE", nargs="?", const=str(ref.DOC_PAGE),
                   help="replace the reference between the markers in FILE (default: docs/configuration.md)")
    args = p.parse_args(argv)
    if args.write:
        print(f"{args.write}: {'updated' if ref.write(args.write, env_option_rows()) else 'already current'}")
    else:
        print(full_reference())
    return 0
