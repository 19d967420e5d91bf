"""``dvla config-ref``: the configuration reference (:mod:`dvla.config.reference`), printed or
written into its page."""

from __future__ import annotations

from dvla.config import reference as ref


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="dvla config-ref", description="Print the configuration reference "
                                "(Markdown), generated from the config dataclasses.")
    p.add_argument("--write", metavar="FILE", nargs="?", const=str(ref.DOC_PAGE),
                   help="replace the reference between the markers in FILE (default: docs/configuration.md)")
    args = p.parse_args(argv)
    if args.write:
        print(f"{args.write}: {'updated' if ref.write(args.write) else 'already current'}")
    else:
        print(ref.reference())
    return 0
